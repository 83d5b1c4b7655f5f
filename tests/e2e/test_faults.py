"""End to end: faults that used to hang, leak or corrupt a stream, on a real 2-replica stack.

Real processes (cost-model workers, emulated round times), `kill -9` as an operator's accident would be, a
real redis-server killed and restarted, and garbage written to Redis with a real XADD. The cost model's token
at a position depends only on the request and the position, so every stream is checked token for token
against what an untouched run gives (tests/e2e/test_migration_stack.py checks that reference itself).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from google.rpc import error_details_pb2

from sluice import client as sdk
from sluice_tools.stack import Proc, Stack, StackConfig, health_serving
from sluice_tools.stack_parts import terminate
from tests.e2e.test_migration_stack import (
    MAX_TOKENS,
    MODEL,
    Streamed,
    _assert_budgets_return_to_zero,
    _assert_exact,
    _expected,
    _finish,
    _launch,
    _metrics,
    _migrations,
    _start,
    _stream,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _relaunch_admission(stack: Stack, *extra: str) -> None:
    """Restart admission with extra flags (same address and owner) and wait until it serves."""
    admission = stack.admission
    assert admission is not None
    terminate(admission, timeout_s=10)
    admission.args = [*admission.args, *extra]
    admission.launch()
    give_up = time.monotonic() + 30
    while not health_serving(admission.address):
        assert admission.alive() and time.monotonic() < give_up, admission.log_tail()
        time.sleep(0.1)
    while not admission.metrics_url:
        admission.metrics_url = admission.printed_metrics_url()
        time.sleep(0.05)


def _restart_on_the_same_address(stack: Stack, index: int) -> float:
    """kill -9 scheduler `index` and start it again at once on its address; return the seconds until it serves."""
    proc = stack.schedulers[index]
    assert proc.popen is not None
    proc.popen.kill()
    proc.popen.wait(5)
    killed = time.monotonic()
    proc.launch()
    while not health_serving(proc.address):
        assert proc.alive() and time.monotonic() - killed < 30, proc.log_tail()
        time.sleep(0.02)
    return time.monotonic() - killed


def _replica_of(stack: Stack, request_id: str) -> str:
    with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
        return client.get_request(request_id).replica_id


def test_a_scheduler_restarted_at_once_on_its_address_strands_no_request(tmp_path: Path) -> None:
    """kill -9 of replica-0's scheduler and an immediate restart on the same address (it serves and registers
    again long before admission's stall timeout): the requests the dead incarnation held move
    (`replica_restarted`) and finish with exactly the untouched run's tokens; one of them, cancelled by its
    client while stranded, ends CANCELLED at once although the new scheduler answers its Cancel NOT_FOUND;
    admission's budgets are zero after."""
    with _start(tmp_path) as stack:
        # A stall timeout well past the restart time: the restarted scheduler answers health and is listed READY
        # when the watchdog looks, so only the incarnation can tell that its requests are gone.
        _relaunch_admission(stack, "--stall-timeout-s", "5")
        outs, threads = _launch(stack)
        placed = {out.request_id: _replica_of(stack, out.request_id) for out in outs}
        stranded = [o for o in outs if placed[o.request_id] == "replica-0"]
        assert stranded, placed
        restart_s = _restart_on_the_same_address(stack, 0)
        assert restart_s < 5, restart_s
        victim = stranded[0]
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            client.cancel(victim.request_id)
            give_up = time.monotonic() + 10
            while not client.get_request(victim.request_id).finished:
                assert time.monotonic() < give_up, "a cancel of a request its restarted scheduler forgot never ended"
                time.sleep(0.05)
            assert client.get_request(victim.request_id).status == "CANCELLED"
        _finish(outs, threads)
        assert isinstance(victim.error, sdk.SluiceError) and "CANCELLED" in str(victim.error), victim.error
        others = [o for o in outs if o is not victim]
        _assert_exact(others)
        values = _assert_budgets_return_to_zero(stack)
        moved = _migrations(values, "replica_restarted")
        assert moved >= len(stranded) - 1, (moved, len(stranded))
        print(f"\nscheduler restarted in {restart_s:.2f} s: {int(moved)} of {len(stranded) - 1} stranded requests "
              f"moved (replica_restarted), 1 cancelled while stranded, all {len(others)} others exact")


def _exact_or_explicit(outs: list[Streamed], max_tokens: int = MAX_TOKENS) -> tuple[int, int]:
    """Assert every stream either finished with exactly the untouched run's tokens or ended with an explicit
    error status, and that no stream ever carried a token the model did not produce at its position; return
    (exact, explicitly failed)."""
    exact = failed = 0
    for out in outs:
        expected = _expected(out.request_id, out.prompt, max_tokens)
        assert out.index_errors == 0, out
        assert out.tokens == expected[:len(out.tokens)], (out.request_id, len(out.tokens))
        if out.error is None:
            assert (out.status, out.output_tokens, len(out.tokens)) == ("FINISHED_LENGTH", max_tokens, max_tokens)
            exact += 1
        else:
            assert isinstance(out.error, sdk.SluiceError), out.error
            failed += 1
    return exact, failed


def test_a_redis_restart_mid_stream_never_streams_a_token_the_model_did_not_produce(tmp_path: Path) -> None:
    """With admission's reader behind (SIGSTOP) while Redis is killed -9 and restarted empty, the token entries it
    had not read are gone: every stream resumes from its last exact token (moved, `token_gap`) or from a
    completion fetched again from its scheduler, and ends with exactly the untouched run's tokens; nothing is
    padded, and admission's budgets are zero after."""
    with _start(tmp_path) as stack:
        outs, threads = _launch(stack)
        _kill_redis_behind_admission(stack, lambda: time.sleep(0.5))  # tokens pile up unread in Redis
        _finish(outs, threads)
        exact, failed = _exact_or_explicit(outs)
        assert (exact, failed) == (len(outs), 0)
        values = _assert_budgets_return_to_zero(stack)
        gaps = _migrations(values, "token_gap")
        assert gaps >= 1
        print(f"\nRedis killed and restarted behind admission's reader: {exact} of {len(outs)} streams exact, "
              f"{failed} failed explicitly, {int(gaps)} moved from their last exact token")


def _kill_redis_behind_admission(stack: Stack, wait: Callable[[], None]) -> None:
    """SIGSTOP admission, `wait()`, kill -9 Redis and restart it empty on its port, SIGCONT admission: what admission
    had not read is gone."""
    assert stack.admission is not None and stack.admission.popen is not None and stack.redis is not None
    admission = stack.admission.popen
    admission.send_signal(signal.SIGSTOP)
    try:
        wait()
        assert stack.redis.pid is not None
        os.kill(stack.redis.pid, signal.SIGKILL)
        give_up = time.monotonic() + 5
        while stack.redis.running:
            assert time.monotonic() < give_up
            time.sleep(0.01)
        stack.redis.restart()
    finally:
        admission.send_signal(signal.SIGCONT)


def test_requests_that_ended_while_their_completions_were_lost_end_exact(tmp_path: Path) -> None:
    """Short requests finish on their schedulers while admission's reader is stopped, then Redis is killed -9 and
    restarted: their last tokens and their completions are gone. Each request goes quiet, its scheduler's Lookup
    returns the completion it remembers, the missing tail is recomputed from the last exact token, and every
    stream ends exact; nothing hangs and admission's budgets are zero after. Each fetched completion is judged by
    its bus copy within the grace: late (a copy the scheduler's publisher held while Redis was away came after all)
    or lost, and only the lost ones are WARNINGs of a loss on the bus."""
    max_tokens = 120
    grace_s = 3.0
    with Stack(StackConfig(replicas=2, backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path,
                           admission_args=("--completion-fetch-grace-s", str(grace_s)))) as stack:
        outs = [Streamed([1 + (i * 3 + j) % 200 for j in range(16 + i)]) for i in range(8)]
        threads = [threading.Thread(target=_stream, args=(stack.endpoint, stack.api_key, out, max_tokens, 90))
                   for out in outs]
        for thread in threads:
            thread.start()
        give_up = time.monotonic() + 60
        while not all(len(o.tokens) >= 10 or o.error for o in outs):
            assert time.monotonic() < give_up, [len(o.tokens) for o in outs]
            time.sleep(0.01)

        def until_all_ended() -> None:
            while sum(s.running + s.waiting for s in stack.scheduler_stats()):
                assert time.monotonic() < give_up
                time.sleep(0.05)

        _kill_redis_behind_admission(stack, until_all_ended)
        _finish(outs, threads)
        exact, failed = _exact_or_explicit(outs, max_tokens)
        assert (exact, failed) == (len(outs), 0)
        values = _assert_budgets_return_to_zero(stack)
        assert stack.admission is not None
        fetched = _log_lines(stack.admission, "its completion was fetched from its scheduler")
        assert fetched >= 1
        give_up = time.monotonic() + grace_s + 5
        while True:
            judged = {o: _metrics(stack.admission)[f'sluice_admission_completions_fetched_total{{outcome="{o}"}}']
                      for o in ("late", "lost", "unresolved")}
            if sum(judged.values()) >= fetched or time.monotonic() > give_up:
                break
            time.sleep(0.2)
        assert (judged["late"] + judged["lost"], judged["unresolved"]) == (fetched, 0)
        assert _log_lines(stack.admission, "its completion was lost on the bus") == judged["lost"]
        print(f"\n{len(outs)} requests ended while their completions were lost: {fetched} completions fetched again "
              f"by Lookup ({int(judged['lost'])} lost on the bus, {int(judged['late'])} late), "
              f"{int(_migrations(values, 'token_gap'))} tails recomputed, all exact")


def _log_lines(proc: Proc, text: str) -> int:
    return sum(text in line for line in proc.log_path.read_text(errors="replace").splitlines())


def test_a_poison_entry_on_each_stream_is_skipped_once_and_disturbs_no_request(tmp_path: Path) -> None:
    """Garbage XADDed (by the operator's Redis user) to admission's token stream, to `completions` and to a `kv`
    shard while streams run: each is skipped once (counted per stream, logged once with its id, dead-lettered
    where the consumer may write), every running stream finishes exact, and a request started afterwards
    streams all its tokens (before: the token reader retried the entry forever and later requests got none)."""
    with _start(tmp_path) as stack:
        outs, threads = _launch(stack)
        assert stack.admission is not None and stack.router is not None
        client = redis.Redis.from_url(stack.redis_url)
        namespace = stack.config.namespace
        poisoned = {stream: client.xadd(f"sluice:{{{namespace}:{stream}}}", {"p": b"\xff\x07garbage", "d": b"\xff"})
                    for stream in (f"tokens:{stack.admission_owner}", "completions", "kv:0")}
        _finish(outs, threads)
        _assert_exact(outs)
        later = Streamed([9, 8, 7, 6, 5])
        _stream(stack.endpoint, stack.api_key, later, max_tokens=20, timeout=30)
        assert (later.error, later.status, len(later.tokens)) == (None, "FINISHED_LENGTH", 20)
        admission, router = _metrics(stack.admission), _metrics(stack.router)
        assert admission['sluice_bus_poison_entries_total{stream="tokens"}'] == 1
        assert admission['sluice_bus_poison_entries_total{stream="completions"}'] == 1
        assert router['sluice_bus_poison_entries_total{stream="completions"}'] == 1
        assert router['sluice_bus_poison_entries_total{stream="kv"}'] == 1
        for stream, entry_id in poisoned.items():
            logs = [stack.admission] if stream.startswith("tokens") else [stack.router]
            logs += [stack.admission] if stream == "completions" else []
            for proc in logs:
                # With the stream's key: entries XADDed in the same millisecond to other streams share the id.
                key = f"sluice:{{{namespace}:{stream}}}"
                assert _log_lines(proc, f"skipped entry {entry_id.decode()} of {key}:") == 1, (stream, proc.name)
        dead = [fields[b"source_id"] for _, fields in client.xrange(f"sluice:{{{namespace}:completions}}:dead")]
        assert dead == [poisoned["completions"]] * 2  # admission's group and the router's
        _assert_budgets_return_to_zero(stack)
        client.close()


def test_a_dead_admissions_requests_stop_on_the_schedulers_within_seconds(tmp_path: Path) -> None:
    """While admission lives, its lease renewals keep its 8 long requests running past the first lease; after a
    kill -9 of admission the lease lapses at the schedulers, which cancel every one of its requests (nothing
    queued or running) within lease + sweep time, instead of running them to max_tokens for clients that are
    gone."""
    max_tokens = 2000
    # Llama-3-70B's modelled decode rounds (~30 ms on an H200) make 2,000 tokens outlast the first lease on any
    # machine; with 8B's (~4 ms) they were done before the kill on a quiet one. Blocks set so that 8 of them fit.
    with Stack(StackConfig(replicas=2, backend="costmodel", model="llama-3-70b", emulate_time=True, run_dir=tmp_path,
                           num_blocks=4096)) as stack:
        outs = [Streamed([1 + (i * 5 + j) % 200 for j in range(20 + i)]) for i in range(8)]
        threads = [threading.Thread(target=_stream, args=(stack.endpoint, stack.api_key, out, max_tokens, 60))
                   for out in outs]
        for thread in threads:
            thread.start()
        give_up = time.monotonic() + 60
        while not all(len(o.tokens) >= 20 for o in outs):
            assert time.monotonic() < give_up and not any(o.error for o in outs), [(len(o.tokens), o.error)
                                                                                   for o in outs]
            time.sleep(0.02)
        time.sleep(6)  # past the first lease a Submit starts: only renewals keep the requests alive
        assert not any(o.error for o in outs) and sum(s.cancelled for s in stack.scheduler_stats()) == 0
        assert sum(s.running + s.waiting for s in stack.scheduler_stats()) == len(outs)  # all still running
        assert stack.admission is not None and stack.admission.popen is not None
        stack.admission.popen.kill()
        killed = time.monotonic()
        while True:
            stats = stack.scheduler_stats()
            busy = sum(s.running + s.waiting for s in stats)
            if busy == 0 and sum(s.cancelled for s in stats) == len(outs):  # ended (a round in flight first answers)
                break
            assert time.monotonic() - killed < 8, f"{busy} requests of a dead admission still run"
            time.sleep(0.1)
        stopped = time.monotonic() - killed
        assert sum(s.cancelled for s in stats) == len(outs)
        for thread in threads:
            thread.join(30)
        print(f"\nadmission killed: all {len(outs)} of its requests cancelled on the schedulers {stopped:.1f} s after")


def _post(base_url: str, path: str, body: dict[str, object], key: str) -> tuple[int, dict[str, object]]:
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    conn.request("POST", url.path + path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, answer


def test_a_huge_or_extra_stop_string_is_refused_naming_the_field_and_stalls_no_other_stream(tmp_path: Path) -> None:
    """While another client streams, an HTTP completion with a 1 MB stop string, or with 5 stop strings, is 400 in
    OpenAI's error shape with `param` "stop", and over gRPC 5 stop strings are INVALID_ARGUMENT naming
    sampling.stop_strings; the other stream's largest gap between tokens stays far below a second (before: the
    1 MB stop string was accepted and froze admission for every stream for about 90 s)."""
    config = StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", emulate_time=True, run_dir=tmp_path,
                         http_port=0)
    with Stack(config) as stack:
        arrivals: list[float] = []

        def follow() -> None:
            with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
                for chunk in client.generate([5, 6, 7], max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60):
                    arrivals.extend([time.monotonic()] * len(chunk.token_ids))

        other = threading.Thread(target=follow)
        other.start()
        while len(arrivals) < 20:
            time.sleep(0.01)
        base = {"model": stack.model_id, "prompt": "hello", "max_tokens": 8}
        for stop in ("x" * (1 << 20), ["a", "b", "c", "d", "e"]):
            status, answer = _post(stack.http_base_url, "/completions", {**base, "stop": stop}, stack.api_key)
            error = answer["error"]
            assert isinstance(error, dict)
            assert (status, error["param"], error["type"]) == (400, "stop", "invalid_request_error"), answer
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client, pytest.raises(sdk.SluiceError) as refused:
            list(client.generate([5, 6], max_tokens=4, stop=["a", "b", "c", "d", "e"], timeout=10))
        assert isinstance(refused.value, sdk.InvalidArgument), refused.value
        violations = [v.field for d in refused.value.details if isinstance(d, error_details_pb2.BadRequest)
                      for v in d.field_violations]
        assert violations == ["sampling.stop_strings"], refused.value.details
        other.join(60)
        assert len(arrivals) == MAX_TOKENS
        largest_gap = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
        assert largest_gap < 1.0, largest_gap
        print(f"\n1 MB stop string refused 400 (param stop); the other stream's largest token gap {largest_gap:.3f} s")
