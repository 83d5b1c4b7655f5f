"""End to end: requests of a killed or drained replica move to the other one and finish with exactly their tokens.

Each test starts a real 2-replica stack (cost-model workers, emulated round times), streams long requests,
then kills a process with SIGKILL (no restart: supervision is not what these tests rely on) or drains a
replica through the router's Drain RPC. The cost model's token at a position depends only on the request
and the position (worker_svc/costmodel.py), so the tokens an untouched run gives are known exactly:
`CostModel.token_for(request_id, prompt_len + i)`; the first test checks that against a real untouched run.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest

from sluice import client as sdk
from sluice.v1 import router_pb2, router_pb2_grpc
from sluice_tools.stack import Proc, Stack, StackConfig, health_serving
from tests.processes import scraped_metrics
from worker_svc.costmodel import CostModel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "llama-3-8b"
MAX_TOKENS = 400
STREAMS = 8
BUDGETS = ("active", "queued", "pending_input_tokens", "reserved_output_tokens")


@dataclass
class Streamed:
    """What one client saw."""

    prompt: list[int]
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    status: str = ""
    output_tokens: int = -1
    error: BaseException | None = None
    index_errors: int = 0


def _expected(request_id: str, prompt: list[int], count: int) -> list[int]:
    model = CostModel(MODEL)
    return [model.token_for(request_id, len(prompt) + i) for i in range(count)]


def _stream(endpoint: str, key: str, out: Streamed, max_tokens: int = MAX_TOKENS, timeout: float = 120,
            retry: sdk.RetryPolicy | None = None) -> None:
    with sdk.Client(endpoint, api_key=key, retry=retry) as client:
        try:
            for chunk in client.generate(out.prompt, max_tokens=max_tokens, ignore_eos=True, timeout=timeout):
                out.request_id = chunk.request_id
                if chunk.finished:
                    out.status = chunk.status
                    out.output_tokens = chunk.usage.output_tokens if chunk.usage else -1
                    continue
                out.index_errors += chunk.index != len(out.tokens)
                out.tokens.extend(chunk.token_ids)
        except sdk.SluiceError as exc:
            out.error = exc


def _start(tmp_path: Path, *scheduler_args: str, http: bool = False) -> Stack:
    """Return the (unstarted: `with` starts it) 2-replica stack, with the HTTP edge on a free port if `http`."""
    return Stack(StackConfig(replicas=2, backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path,
                             scheduler_args=scheduler_args, http_port=0 if http else None))


def _run_all(stack: Stack, outs: list[Streamed], max_tokens: int = MAX_TOKENS) -> list[threading.Thread]:
    """Start one client thread per stream; return the threads."""
    threads = [threading.Thread(target=_stream, args=(stack.endpoint, stack.api_key, out, max_tokens)) for out in outs]
    for thread in threads:
        thread.start()
    return threads


def _launch(stack: Stack, min_tokens: int = 40) -> tuple[list[Streamed], list[threading.Thread]]:
    """Start STREAMS long requests (distinct prompts) and return once each has streamed `min_tokens`."""
    outs = [Streamed(_prompt(i)) for i in range(STREAMS)]
    threads = _run_all(stack, outs)
    _wait_streamed(outs, lambda out: len(out.tokens), min_tokens)
    return outs, threads


def _prompt(i: int) -> list[int]:
    """Long request `i`'s prompt (distinct for each i)."""
    return [1 + (i * 7 + j) % 200 for j in range(24 + i)]


def _wait_streamed(outs: list[Any], streamed: Callable[[Any], int], min_tokens: int) -> None:
    """Return once every client has `streamed` at least `min_tokens` (or failed); 60 s at most."""
    give_up = time.monotonic() + 60
    while not all(streamed(o) >= min_tokens or o.error for o in outs):
        assert time.monotonic() < give_up, [streamed(o) for o in outs]
        time.sleep(0.01)


def _finish(outs: list[Any], threads: list[threading.Thread]) -> float:
    """Join the clients; return when the last one ended."""
    for thread in threads:
        thread.join(150)
    return time.monotonic()


def _assert_exact(outs: list[Streamed], max_tokens: int = MAX_TOKENS) -> None:
    for out in outs:
        assert out.error is None, out.error
        assert (out.status, out.output_tokens, out.index_errors) == ("FINISHED_LENGTH", max_tokens, 0)
        assert out.tokens == _expected(out.request_id, out.prompt, max_tokens)


def _metrics(proc: Proc) -> dict[str, float]:
    return scraped_metrics(proc.metrics_url)


def _assert_budgets_return_to_zero(stack: Stack) -> dict[str, float]:
    assert stack.admission is not None
    give_up = time.monotonic() + 5
    while True:
        values = _metrics(stack.admission)
        used = {b: values.get(f'sluice_admission_budget_in_use{{budget="{b}"}}') for b in BUDGETS}
        if all(v == 0.0 for v in used.values()) or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    assert used == dict.fromkeys(BUDGETS, 0.0)
    assert values["sluice_admission_active_requests"] == 0.0
    return values


def _migrations(values: dict[str, float], cause: str) -> float:
    return values.get(f'sluice_admission_migrations_total{{cause="{cause}"}}', 0.0)


def _replicas(stack: Stack) -> dict[str, int]:
    assert stack.router is not None
    with grpc.insecure_channel(stack.router.address) as channel:
        listed = router_pb2_grpc.RouterServiceStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
    return {r.replica_id: r.state for r in listed.replicas}


def test_untouched_streams_give_the_cost_models_tokens(tmp_path: Path) -> None:
    """Without a fault every stream gets exactly token_for(request, position), the reference the other tests use."""
    with _start(tmp_path) as stack:
        outs, threads = _launch(stack)
        _finish(outs, threads)
        _assert_exact(outs)
        values = _assert_budgets_return_to_zero(stack)
        assert sum(v for k, v in values.items() if k.startswith("sluice_admission_migrations_total")) == 0


@pytest.mark.parametrize("victims,cause,link", [
    (("scheduler",), "scheduler_gone", "round_link"),
    (("worker",), "worker_down", "round_link"),
    (("worker",), "worker_down", "grpc_stream"),
    (("scheduler", "worker"), "scheduler_gone", "round_link"),
])
def test_a_killed_replica_process_loses_no_request_and_no_token(tmp_path: Path, victims: tuple[str, ...],
                                                                 cause: str, link: str) -> None:
    """kill -9 of replica-0's scheduler, worker or both mid-stream, rounds on the worker's round link (the default)
    or on ExecuteStream (--no-round-link): every request finishes with exactly the untouched run's tokens (indices
    continuous), those on replica-0 moved, and admission's budgets are zero after."""
    with _start(tmp_path, *(["--no-round-link"] if link == "grpc_stream" else [])) as stack:
        outs, threads = _launch(stack)
        assert _metrics(stack.schedulers[0])[f'sluice_scheduler_worker_link{{kind="{link}"}}'] == 1.0
        killed = time.monotonic()
        for victim in victims:
            proc = stack.schedulers[0] if victim == "scheduler" else stack.workers[0]
            assert proc.popen is not None
            proc.popen.kill()
        ended = _finish(outs, threads)
        _assert_exact(outs)
        values = _assert_budgets_return_to_zero(stack)
        assert _migrations(values, cause) >= 1
        print(f"\nkill {'+'.join(victims)}: {int(_migrations(values, cause))} of {STREAMS} requests migrated "
              f"({cause}); all {STREAMS} exact; last stream ended {ended - killed:.1f} s after the kill")


@dataclass
class HttpStreamed:
    """What one OpenAI HTTP client saw: the text of its chunks, its finish, usage and [DONE]."""

    prompt: list[int]
    request_id: str = ""
    text: str = ""
    finish: str | None = None
    completion_tokens: int = -1
    done: bool = False
    error: BaseException | None = None


def _http_stream(base_url: str, key: str, out: HttpStreamed) -> None:
    """A streamed completion over HTTP/1.1 (chunked: the token reader may write its chunks at once), read as it
    comes with the standard library."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)
    body = {"model": MODEL, "prompt": out.prompt, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        conn.request("POST", f"{url.path}/completions", body=json.dumps(body),
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        response = conn.getresponse()
        out.request_id = response.getheader("x-request-id") or ""
        assert response.status == 200, response.read()
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if not data:
                continue
            if data == "[DONE]":
                out.done = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event["choices"]:
                out.text += choice["text"]
                out.finish = choice["finish_reason"] or out.finish
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        out.error = exc
    finally:
        conn.close()


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_openai_http_streams_whose_chunks_are_written_at_once_survive_a_killed_replica(tmp_path: Path,
                                                                                        victim: str) -> None:
    """Streamed completions over the OpenAI HTTP API, whose text chunks the token reader writes the moment their
    tokens arrive (sluice_admission_http_stream_events_total{way="at_once"} moves), and kill -9 of replica-0's
    worker or scheduler mid-stream: every stream ends once with finish "length", usage 400 and [DONE], and its text
    is exactly the untouched run's tokens' (the cost model's tokens are one printable character each in admission's
    tokenizer); the requests on replica-0 moved, and admission's budgets are zero after."""
    from sluice.model_spec import load_model_spec
    from worker_svc.models import resolve_model

    tokenizer = load_model_spec(resolve_model("tiny"), "tiny").tokenizer
    with _start(tmp_path, http=True) as stack:
        outs = [HttpStreamed(_prompt(i)) for i in range(STREAMS)]
        threads = [threading.Thread(target=_http_stream, args=(stack.http_base_url, stack.api_key, out))
                   for out in outs]
        for thread in threads:
            thread.start()
        _wait_streamed(outs, lambda out: len(out.text), 40)
        proc = stack.schedulers[0] if victim == "scheduler" else stack.workers[0]
        assert proc.popen is not None
        proc.popen.kill()
        _finish(outs, threads)
        for out in outs:
            assert out.error is None, out.error
            assert (out.finish, out.completion_tokens, out.done) == ("length", MAX_TOKENS, True)
            assert out.text == tokenizer.decode(_expected(out.request_id, out.prompt, MAX_TOKENS))
        values = _assert_budgets_return_to_zero(stack)
        assert _migrations(values, "scheduler_gone" if victim == "scheduler" else "worker_down") >= 1
        assert values['sluice_admission_http_stream_events_total{way="at_once"}'] > 0


def test_a_drained_replica_hands_its_requests_over_and_retires(tmp_path: Path) -> None:
    """Drain the replica running more of the long requests (drain timeout 0.2 s, far below the ~1 s their remaining
    ~360 tokens take even on a quiet machine; at 1 s they sometimes all finished first): it hands the rest to
    migration, leaves the router's table and turns NOT_SERVING (retired; a SIGTERM then stops it at once, exit 0);
    every request is exact.

    The drained replica is chosen by its running-requests gauge, not by name: the router may place the 8
    requests unevenly, and a replica with none would drain with nothing to hand off."""
    with _start(tmp_path, "--drain-timeout", "0.2") as stack:
        outs, threads = _launch(stack)
        running = [_metrics(s)["sluice_running_requests"] for s in stack.schedulers]
        victim = max(range(len(running)), key=running.__getitem__)
        other = f"replica-{1 - victim}"
        assert running[victim] >= 1, running
        assert stack.router is not None
        with grpc.insecure_channel(stack.router.address) as channel:
            reply = router_pb2_grpc.RouterServiceStub(channel).Drain(
                router_pb2.DrainRequest(replica_id=f"replica-{victim}"), timeout=5)
        assert reply.state == router_pb2.DRAINING
        drained = time.monotonic()
        _finish(outs, threads)
        _assert_exact(outs)
        values = _assert_budgets_return_to_zero(stack)
        assert _migrations(values, "handed_off") >= 1
        give_up = time.monotonic() + 20
        while health_serving(stack.schedulers[victim].address) and time.monotonic() < give_up:
            time.sleep(0.1)
        retired = time.monotonic() - drained
        assert not health_serving(stack.schedulers[victim].address)
        assert f"replica-{victim}" not in _replicas(stack) and _replicas(stack)[other] == router_pb2.READY
        popen = stack.schedulers[victim].popen
        assert popen is not None
        popen.terminate()
        assert popen.wait(10) == 0
        print(f"\ndrain replica-{victim} (running {running}): {int(_migrations(values, 'handed_off'))} of "
              f"{STREAMS} requests handed off; "
              f"replica retired {retired:.1f} s after Drain")


def _refused_or_finished(endpoint: str, key: str, out: Streamed, max_tokens: int) -> None:
    """Run one request without client retries (an UNAVAILABLE must reach the test, not be retried away)."""
    _stream(endpoint, key, out, max_tokens=max_tokens, timeout=60, retry=sdk.RetryPolicy(max_attempts=1))


def test_requests_admitted_right_after_a_scheduler_dies_are_routed_to_the_survivor(tmp_path: Path) -> None:
    """kill -9 of replica-0's scheduler, then at once (long before the router's heartbeat timeout drops it)
    requests: a Submit refused by the dead scheduler is routed again, every request finishes with exactly its
    tokens, none is refused UNAVAILABLE; the re-routes are counted, the router took replica-0 out of routing
    (UNHEALTHY) on admission's report, and admission's budgets are zero after."""
    max_tokens, count = 40, 8
    with _start(tmp_path) as stack:
        assert stack.schedulers[0].popen is not None
        stack.schedulers[0].popen.kill()
        stack.schedulers[0].popen.wait(5)
        killed = time.monotonic()
        outs = [Streamed([1 + (i * 11 + j) % 200 for j in range(20 + i)]) for i in range(count)]
        threads = [threading.Thread(target=_refused_or_finished, args=(stack.endpoint, stack.api_key, out, max_tokens))
                   for out in outs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        ended = time.monotonic() - killed
        assert [o.error for o in outs] == [None] * count
        for out in outs:
            assert (out.status, out.output_tokens, out.index_errors) == ("FINISHED_LENGTH", max_tokens, 0)
            assert out.tokens == _expected(out.request_id, out.prompt, max_tokens)
        values = _assert_budgets_return_to_zero(stack)
        reroutes = values.get('sluice_admission_reroutes_total{code="UNAVAILABLE"}', 0.0)
        assert reroutes >= 1
        assert _replicas(stack)["replica-0"] == router_pb2.UNHEALTHY
        print(f"\nscheduler killed, {count} requests sent at once: {int(reroutes)} re-routed, all exact, "
              f"none UNAVAILABLE; last ended {ended:.1f} s after the kill")


def _host_blocks(proc: Proc) -> tuple[float, float, float]:
    """(host blocks in use, of them prefix-tier copies, device KV blocks in use) on a scheduler."""
    values = _metrics(proc)
    return values["sluice_host_blocks_used"], values["sluice_host_blocks_cached"], values["sluice_kv_blocks_used"]


def test_a_worker_killed_while_its_host_prefix_tier_copies_loses_no_token_and_comes_back_with_the_tier_empty(
        tmp_path: Path) -> None:
    """Both replicas with the host prefix tier (`--host-prefix-cache`, 512 host blocks) and 96 device blocks each, so
    finished prompts' cached blocks are paged out to the tier and evicted while long streams grow. Short requests
    keep arriving (new prompts and repeats of paged-out ones); once a replica has copied a prompt back from its tier
    (a host hit), its worker is killed -9 with copies out and in still going on: every request, long or short, ends
    with exactly the untouched run's tokens, and admission's budgets are zero. The survivor, idle, holds no device
    block and no host block beyond its tier's copies. The worker started again on its address: its scheduler empties
    the tier (the copies were in the dead process), so it holds no host block and no device block, and requests
    after the restart are exact too."""
    short_tokens = 4
    config = StackConfig(replicas=2, backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path,
                         num_blocks=96, worker_args=("--host-blocks", "512"), scheduler_args=("--host-prefix-cache",))
    warm = [[3 + (i * 13 + j) % 190 for j in range(64)] for i in range(8)]  # 4 full blocks each
    with Stack(config) as stack:
        first = [Streamed(list(p)) for p in warm]
        for thread in _run_all(stack, first, short_tokens):
            thread.join(60)
        _assert_exact(first, short_tokens)
        outs, threads = _launch(stack)  # long streams: rounds with other work, so the cached blocks are paged out
        churn: list[Streamed] = []
        churn_threads: list[threading.Thread] = []
        stop = threading.Event()

        def keep_sending() -> None:
            i = 0
            while not stop.is_set():
                prompt = warm[i % len(warm)] if i % 2 else [5 + (i * 17 + j) % 180 for j in range(48 + i % 16)]
                out = Streamed(list(prompt))
                churn.append(out)
                churn_threads.extend(_run_all(stack, [out], short_tokens))
                i += 1
                time.sleep(0.02)

        sender = threading.Thread(target=keep_sending)
        sender.start()
        try:
            give_up = time.monotonic() + 30
            while True:
                hits = [_metrics(s).get("sluice_host_prefix_hit_tokens_total", 0.0) for s in stack.schedulers]
                if max(hits) > 0:
                    break
                assert time.monotonic() < give_up, "no replica copied a prompt back from its host tier"
                time.sleep(0.02)
            victim = hits.index(max(hits))
            worker = stack.workers[victim]
            assert worker.popen is not None
            worker.popen.kill()
            worker.popen.wait(5)
            time.sleep(0.5)
        finally:
            stop.set()
            sender.join(10)
        _finish(outs, threads)
        for thread in churn_threads:
            thread.join(60)
        _assert_exact(outs)
        _assert_exact(churn, short_tokens)
        values = _assert_budgets_return_to_zero(stack)
        assert _migrations(values, "worker_down") >= 1
        used, cached, device = _host_blocks(stack.schedulers[1 - victim])
        assert device == 0 and used == cached, f"the survivor holds blocks: {(used, cached, device)}"

        worker.launch()
        give_up = time.monotonic() + 30
        while (_replicas(stack).get(f"replica-{victim}") != router_pb2.READY
               or _host_blocks(stack.schedulers[victim]) != (0.0, 0.0, 0.0)):
            assert worker.alive() and time.monotonic() < give_up, (_host_blocks(stack.schedulers[victim]),
                                                                   worker.log_tail())
            time.sleep(0.1)
        after = [Streamed(list(p)) for p in warm]
        for thread in _run_all(stack, after, short_tokens):
            thread.join(60)
        _assert_exact(after, short_tokens)
        print(f"\nhost tier: worker-{victim} killed after {hits[victim]:.0f} host-hit tokens, with {len(churn)} short "
              f"requests arriving: all {STREAMS + len(churn)} exact, {int(_migrations(values, 'worker_down'))} "
              f"migrated; the worker back with its tier empty")
