"""End to end: `--disagg P:D` stacks of real processes (router, admission, schedulers, workers, Redis).

Each request's prompt runs on a prefill replica (max_tokens 1, its KV held), its first token streams from there,
and its decode half runs on a decode replica after that replica's worker pulled the prompt's blocks from the
prefill worker. The cost model's token at a position depends only on the request and the position
(worker_svc/costmodel.py), so the tokens a fault-free run gives are known exactly; the torch test compares
greedy output with an aggregated stack's. Faults are kill -9 of real processes (no supervision restarts them).
After each test: every request ended exactly once, no KV block used or held on a living replica, and admission's
budgets are back to zero.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from sluice import client as sdk
from sluice.redis_server import free_port
from sluice.telemetry import read_span_file
from sluice.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluice_tools.stack import Proc, Stack, StackConfig
from sluice_tools.stack_parts import proc_serving
from tests.processes import read_until, scraped_metrics
from worker_svc.costmodel import CostModel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "llama-3-8b"
BUDGETS = ("active", "queued", "pending_input_tokens", "reserved_output_tokens")


@dataclass
class Streamed:
    """What one client saw."""

    prompt: list[int]
    max_tokens: int
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    status: str = ""
    output_tokens: int = -1
    cached_tokens: int = -1
    finished_chunks: int = 0
    error: BaseException | None = None
    index_errors: int = 0


def _stream(stack: Stack, out: Streamed, timeout: float = 120) -> None:
    with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
        try:
            for chunk in client.generate(out.prompt, max_tokens=out.max_tokens, ignore_eos=True, timeout=timeout):
                out.request_id = chunk.request_id
                if chunk.finished:
                    out.finished_chunks += 1
                    out.status = chunk.status
                    out.output_tokens = chunk.usage.output_tokens if chunk.usage else -1
                    out.cached_tokens = chunk.usage.cached_tokens if chunk.usage else -1
                    continue
                out.index_errors += chunk.index != len(out.tokens)
                out.tokens.extend(chunk.token_ids)
        except sdk.SluiceError as exc:
            out.error = exc


def _started(stack: Stack, outs: list[Streamed]) -> list[threading.Thread]:
    threads = [threading.Thread(target=_stream, args=(stack, out)) for out in outs]
    for thread in threads:
        thread.start()
    return threads


def _wait(condition, what: str, timeout: float = 60) -> None:  # noqa: ANN001
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.005)


def _assert_exact(out: Streamed) -> None:
    model = CostModel(MODEL)
    assert out.error is None, out.error
    assert (out.status, out.output_tokens, out.index_errors, out.finished_chunks) == (
        "FINISHED_LENGTH", out.max_tokens, 0, 1)
    assert out.tokens == [model.token_for(out.request_id, len(out.prompt) + i) for i in range(out.max_tokens)]


def _metrics(proc: Proc) -> dict[str, float]:
    return scraped_metrics(proc.metrics_url)


def _stats(proc: Proc, stack: Stack | None = None) -> scheduler_pb2.SchedulerStats:
    with (stack.channel(proc.address) if stack is not None else grpc.insecure_channel(proc.address)) as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)


def _assert_nothing_left(stack: Stack, dead: tuple[Proc, ...] = ()) -> None:
    """No living scheduler uses or holds a KV block and admission's budgets are zero (within a few seconds)."""
    assert stack.admission is not None
    give_up = time.monotonic() + 10
    while True:
        values = _metrics(stack.admission)
        used = {b: values.get(f'sluice_admission_budget_in_use{{budget="{b}"}}') for b in BUDGETS}
        blocks = {s.name: (st.kv_blocks_used, st.kv_blocks_held, st.waiting, st.running)
                  for s in stack.schedulers if s not in dead for st in [_stats(s, stack)]}
        if (all(v == 0.0 for v in used.values()) and all(v == (0, 0, 0, 0) for v in blocks.values())) \
                or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    assert used == dict.fromkeys(BUDGETS, 0.0)
    assert all(v == (0, 0, 0, 0) for v in blocks.values()), blocks
    assert values["sluice_admission_active_requests"] == 0.0


def _transfers(proc: Proc, outcome: str) -> float:
    return _metrics(proc).get(f'sluice_kv_transfers_total{{outcome="{outcome}"}}', 0.0)


def _costmodel(tmp_path: Path, split: tuple[int, int], *scheduler_args: str, mtls: bool = False) -> Stack:
    return Stack(StackConfig(backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path, disagg=split,
                             scheduler_args=scheduler_args, mtls=mtls,
                             env=(("SLUICE_TRACE_FILE", str(tmp_path / "spans.jsonl")),)))


def _handoff_trace(tmp_path: Path, request_id: str) -> tuple[list[str], list[str]]:
    """Return the names of the request's root span events and of its KV transfer span's events (once written)."""
    give_up = time.monotonic() + 10
    while True:
        spans = read_span_file(tmp_path / "spans.jsonl")
        roots = [s for s in spans if s["attributes"].get("sluice.request_id") == request_id
                 and s["parent_span_id"] == ""]
        transfers = [s for s in spans if s["name"] == "replica.kv_transfer"
                     and s["attributes"].get("sluice.request_id", "").startswith(request_id)]
        if (roots and transfers) or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    assert len(roots) == 1 and len(transfers) == 1, (len(roots), len(transfers))
    assert transfers[0]["trace_id"] == roots[0]["trace_id"]  # one trace per request, across the pair
    return [e["name"] for e in roots[0]["events"]], [e["name"] for e in transfers[0]["events"]]


class GatedProxy:
    """A loopback TCP forwarder that accepts connections at once but forwards them only once opened: a connection
    accepted while it is shut waits (the client's call hangs), so a test can act between a call's start and its
    reaching the server behind."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = ""
        self.accepted = threading.Event()
        self.opened = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.set()
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        self.opened.wait()
        host, port = self.target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def _prompt(length: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 13 + j * 7) % 200 for j in range(length)]


def test_costmodel_pair_serves_exact_tokens_through_a_transfer(tmp_path: Path) -> None:
    """1:1 under mutual TLS (each hand-off RPC admits only its callers' roles: sluice/tls.py): every request's tokens
    are the cost model's, the decode side found the prompt's full blocks in its prefix cache (cached_tokens = full
    blocks x 16: they came with the transfer), and nothing is left held."""
    with _costmodel(tmp_path, (1, 1), mtls=True) as stack:
        outs = [Streamed(_prompt(20 + 23 * i, i), 12) for i in range(4)]
        for thread in _started(stack, outs):
            thread.join(120)
        for out in outs:
            _assert_exact(out)
            assert out.cached_tokens == len(out.prompt) // 16 * 16
        prefill, decode = stack.schedulers
        assert _transfers(decode, "received") == 4
        assert _metrics(prefill)['sluice_kv_holds_ended_total{reason="received"}'] == 4
        assert _stats(prefill, stack).finished == 4 and _stats(decode, stack).finished == 4
        _assert_nothing_left(stack)
        root, transfer = _handoff_trace(tmp_path, outs[0].request_id)
        order = [name for name in root if name in ("routed", "first_token", "kv_held", "handed_off", "completed")]
        assert order == ["routed", "first_token", "kv_held", "handed_off", "completed"], root
        assert transfer == ["transfer_started", "transfer_done"]


def test_many_requests_at_once_through_a_two_by_two_split(tmp_path: Path) -> None:
    """2:2, 24 concurrent requests (prompts of 20 to 480 tokens): every one exact and ended once, every prompt's
    blocks received by a decode replica (none recomputed), and both sides spread the work."""
    with _costmodel(tmp_path, (2, 2)) as stack:
        outs = [Streamed(_prompt(20 + 20 * i, i), 20 + (i % 4) * 10) for i in range(24)]
        for thread in _started(stack, outs):
            thread.join(150)
        for out in outs:
            _assert_exact(out)
            assert out.cached_tokens >= len(out.prompt) // 16 * 16
        received = [_transfers(s, "received") for s in stack.schedulers[2:]]
        assert sum(received) == 24 and min(received) > 0, received
        assert all(_stats(s).finished > 0 for s in stack.schedulers[:2])
        _assert_nothing_left(stack)


def test_torch_pair_is_token_exact_against_aggregated_serving(tmp_path: Path) -> None:
    """Greedy output of `--disagg 1:1` on the torch tiny model equals a one-replica aggregated stack's, and the
    decode side computed with the transferred blocks (cached_tokens), not by recomputing the prompt.
    (tests/integration/test_kv_transfer.py shows the same rounds over zeroed K/V give other logits.)"""
    prompts = [_prompt(n, n) for n in (17, 40, 75, 130)]

    def run(config: StackConfig) -> tuple[list[Streamed], Stack]:
        with Stack(config) as stack:
            outs = [Streamed(p, 16) for p in prompts]
            for thread in _started(stack, outs):
                thread.join(120)
            for out in outs:
                assert out.error is None and out.status == "FINISHED_LENGTH" and out.index_errors == 0, out
            if config.disagg:
                _assert_nothing_left(stack)
                assert _transfers(stack.schedulers[1], "received") == len(prompts)
            return outs, stack

    aggregated, _ = run(StackConfig(backend="torch", model="tiny", run_dir=tmp_path / "aggregated"))
    disaggregated, _ = run(StackConfig(backend="torch", model="tiny", run_dir=tmp_path / "disagg", disagg=(1, 1)))
    assert [o.tokens for o in disaggregated] == [o.tokens for o in aggregated]
    assert [o.cached_tokens for o in disaggregated] == [len(p) // 16 * 16 for p in prompts]


def test_prefill_worker_restarted_between_the_lookup_and_the_pull_is_fenced(tmp_path: Path) -> None:
    """1:1 torch tiny, the prefill worker reached for KV pulls through a gated proxy (`--kv-worker-address`): the
    decode worker's pull connects (after HeldKv answered the blocks and the worker's incarnation) and waits; the
    prefill worker is killed and started again on its port (empty cache, a new incarnation), then the pull goes
    through. The restarted worker refuses it (FAILED_PRECONDITION: another incarnation), the decode replica
    recomputes the prompt, and greedy output equals an aggregated stack's. Without the fence the new worker
    would serve its empty blocks as the prompt's (other tokens, cached_tokens > 0). A later hand-off from the
    restarted worker is received (its scheduler answers the new incarnation)."""
    prompt = _prompt(75, 75)
    with Stack(StackConfig(backend="torch", model="tiny", run_dir=tmp_path / "aggregated")) as stack:
        expected = Streamed(prompt, 16)
        _stream(stack, expected)
    assert expected.status == "FINISHED_LENGTH", expected
    proxy = GatedProxy()
    try:
        with Stack(StackConfig(backend="torch", model="tiny", run_dir=tmp_path / "disagg", disagg=(1, 1),
                               scheduler_args=("--kv-worker-address", proxy.address))) as stack:
            prefill_worker = stack.workers[0]
            proxy.target = prefill_worker.address
            out = Streamed(prompt, 16)
            threads = _started(stack, [out])
            assert proxy.accepted.wait(60), "the decode worker never started its pull"
            assert prefill_worker.popen is not None
            prefill_worker.popen.kill()
            prefill_worker.popen.wait(10)
            stack.fleet.relaunch(prefill_worker)
            _wait(lambda: proc_serving(prefill_worker, files=stack.operator), "the prefill worker did not come back")
            proxy.opened.set()
            threads[0].join(120)
            assert out.error is None and out.status == "FINISHED_LENGTH" and out.index_errors == 0, out
            assert out.tokens == expected.tokens
            decode = stack.schedulers[1]
            assert _transfers(decode, "stale") == 1 and _transfers(decode, "received") == 0
            assert out.cached_tokens == 0  # recomputed: nothing came from the transfer
            after = Streamed(_prompt(50, 3), 4)  # the prefill scheduler took the new incarnation: pulls work again
            _stream(stack, after)
            assert after.status == "FINISHED_LENGTH" and after.cached_tokens == 48, after
            assert _transfers(decode, "received") == 1
            _assert_nothing_left(stack)
    finally:
        proxy.close()


def test_prefill_replica_killed_before_the_transfer(tmp_path: Path) -> None:
    """2:1, kill -9 of the prefill replica (scheduler and worker) while it still prefills a long prompt: the request
    moves to the other prefill replica, hands off to the decode replica from there and is exact."""
    with _costmodel(tmp_path, (2, 1), "--max-num-batched-tokens", "64", "--max-prefill-chunk", "64") as stack:
        out = Streamed(_prompt(2000), 24)
        threads = _started(stack, [out])
        running = []

        def prefilling() -> bool:
            running[:] = [i for i in (0, 1) if _stats(stack.schedulers[i]).running]
            return bool(running)

        _wait(prefilling, "the prompt never started on a prefill replica")
        assert not out.tokens
        victim = running[0]
        for proc in (stack.schedulers[victim], stack.workers[victim]):
            assert proc.popen is not None
            proc.popen.kill()
        threads[0].join(120)
        _assert_exact(out)
        values = _metrics(stack.admission)  # type: ignore[arg-type]
        assert values['sluice_admission_migrations_total{cause="scheduler_gone"}'] == 1
        assert _transfers(stack.schedulers[2], "received") == 1
        _assert_nothing_left(stack, dead=(stack.schedulers[victim],))


def test_decode_replica_killed_after_the_transfer(tmp_path: Path) -> None:
    """1:2, kill -9 of the decode replica that received the blocks, mid-decode: the request is placed again (a new
    pair: the prefill replica recomputes prompt + streamed tokens, the other decode replica pulls them) and every
    token is exact, none lost or repeated."""
    with _costmodel(tmp_path, (1, 2)) as stack:
        out = Streamed(_prompt(100), 300)
        threads = _started(stack, [out])
        _wait(lambda: len(out.tokens) >= 30, "no decode tokens")
        victim = next(i for i in (1, 2) if _stats(stack.schedulers[i]).running)
        assert _transfers(stack.schedulers[victim], "received") == 1
        for proc in (stack.schedulers[victim], stack.workers[victim]):
            assert proc.popen is not None
            proc.popen.kill()
        threads[0].join(150)
        _assert_exact(out)
        other = 3 - victim
        assert _transfers(stack.schedulers[other], "received") == 1
        _assert_nothing_left(stack, dead=(stack.schedulers[victim],))


def test_transfer_cut_mid_stream_recomputes_on_the_decode_replica(tmp_path: Path) -> None:
    """1:1, a long prompt (125 blocks of 2 MiB: ~0.6 s on the wire here), kill -9 of the prefill worker at the first token, while its blocks
    stream: the decode replica's pull fails and it recomputes the prompt; the tokens are exact, and the prefill
    scheduler (alive) holds nothing afterwards (the decode side released the hold)."""
    with _costmodel(tmp_path, (1, 1)) as stack:
        out = Streamed(_prompt(2000), 8)
        threads = _started(stack, [out])
        _wait(lambda: bool(out.tokens), "no first token")
        assert stack.workers[0].popen is not None
        stack.workers[0].popen.kill()
        threads[0].join(120)
        _assert_exact(out)
        decode = stack.schedulers[1]
        assert _transfers(decode, "failed") == 1 and _transfers(decode, "received") == 0
        assert out.cached_tokens == 0  # recomputed: nothing came from the transfer
        _assert_nothing_left(stack)


def test_cancel_during_the_transfer_releases_both_sides(tmp_path: Path) -> None:
    """1:1, a long prompt; the client cancels at its first token, while the hand-off runs: the request ends
    CANCELLED exactly once and neither side keeps a block. The cancel lands where the request is then: almost
    always on the decode side during the pull (which it stops), else on the prefill side's hold before the decode
    half was sent (which it releases); either way the hand-off is cut, not finished."""
    with _costmodel(tmp_path, (1, 1)) as stack:
        out = Streamed(_prompt(2000), 8)
        threads = _started(stack, [out])
        _wait(lambda: bool(out.tokens), "no first token")
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            client.cancel(out.request_id)
        threads[0].join(60)
        assert out.status in ("", "CANCELLED") and out.tokens == out.tokens[:1]
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            info = client.get_request(out.request_id)
        assert info.status == "CANCELLED", info
        prefill, decode = stack.schedulers
        cut = ("sluice_kv_transfers_total{outcome=\"cancelled\"}", "sluice_kv_holds_ended_total{reason=\"cancelled\"}")
        _wait(lambda: _metrics(decode).get(cut[0], 0.0) + _metrics(prefill).get(cut[1], 0.0) >= 1,
              "the cancel did not cut the hand-off", timeout=10)
        assert _transfers(decode, "received") == 0
        _assert_nothing_left(stack)


def test_sluice_up_disagg_through_the_command_line(tmp_path: Path) -> None:
    """`sluice up --disagg 1:1` (the CLI, mTLS on by default) starts a prefill and a decode replica, says which is
    which, and `sluice generate` through it is served by a hand-off (the decode scheduler received one transfer)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    port = free_port()
    cli = [sys.executable, "-m", "sluice_tools.cli"]
    up = subprocess.Popen([*cli, "up", "--disagg", "1:1", "--backend", "costmodel", "--model", MODEL, "--port",
                           str(port), "--http-port", "-1", "--run-dir", str(tmp_path)],
                          cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = read_until(up, "Ctrl-C to stop", 120)
        banner = "".join(lines)
        assert "1 prefill + 1 decode x" in banner, banner
        roles = {line.split()[0]: line.split()[-1] for line in lines if line.strip().startswith("scheduler-")}
        assert roles == {"scheduler-0": "(prefill)", "scheduler-1": "(decode)"}, banner
        done = subprocess.run([*cli, "generate", "hello there, a prompt of more than one block", "--max-tokens", "5",
                               "--target", f"127.0.0.1:{port}", "--ids"], cwd=root, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and len(done.stdout.split()) == 5, done.stderr
        decode_metrics = next(line.split("metrics ")[1].split()[0] for line in lines
                              if line.strip().startswith("scheduler-1"))
        assert scraped_metrics(decode_metrics)['sluice_kv_transfers_total{outcome="received"}'] == 1.0
    finally:
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
