"""The chaos run's configuration (sluice_tools/chaos.py): `--disagg P:D` is the same run on a disaggregated stack;
and how its HTTP client judges a stream."""

from __future__ import annotations

import http.server
import json
import random
import threading
from collections import Counter
from pathlib import Path

import pytest

from sluice_tools.chaos import (
    DISAGG_FAULTS,
    FAULTS,
    MODEL,
    ChaosConfig,
    Tally,
    _handoffs,
    _nothing_held,
    _one_http_request,
    _run_dir,
    faults_for,
    main,
    rss_growth_kb_per_min,
    stack_config,
)
from sluice_tools.stack_parts import replica_role
from worker_svc.costmodel import CostModel

NOTHING = {"admission_reserved": {}, "scheduler_requests": 0, "kv_blocks_used": 0, "kv_blocks_held": 0,
           "host_blocks_beyond_tier": 0, "redis_pending": {}}


@pytest.mark.parametrize(("disagg", "roles", "faults"), [
    (None, ["both", "both"], FAULTS),
    ((1, 1), ["prefill", "decode"], DISAGG_FAULTS),
    ((2, 2), ["prefill", "prefill", "decode", "decode"], DISAGG_FAULTS),
    ((1, 3), ["prefill", "decode", "decode", "decode"], DISAGG_FAULTS),
])
def test_the_split_changes_only_the_stack_roles_and_the_faults(disagg: tuple[int, int] | None, roles: list[str],
                                                               faults: tuple[str, ...], tmp_path: Path) -> None:
    """Aggregated or P:D, the stack is the same cost-model one with emulated time; the split decides the roles of
    its replicas (the first P prefill) and the faults drawn (each side's workers and schedulers apart)."""
    config = stack_config(ChaosConfig(disagg=disagg), tmp_path, tmp_path / "tenants.toml")
    assert (config.backend, config.emulate_time, config.disagg, config.config_file) == (
        "costmodel", True, disagg, str(tmp_path / "tenants.toml"))
    assert [replica_role(config, i) for i in range(sum(disagg) if disagg else config.replicas)] == roles
    assert faults_for(disagg) == faults


def test_a_disaggregated_run_faults_both_sides_and_everything_else_as_an_aggregated_one() -> None:
    """Every fault of an aggregated run has a disaggregated twin: a worker or scheduler fault on each side, the
    router, admission and Redis as they are."""
    split = {f.replace("prefill-", "").replace("decode-", "") for f in DISAGG_FAULTS}
    assert split == set(FAULTS)
    assert {f for f in DISAGG_FAULTS if "prefill-" in f} == {f.replace("decode-", "prefill-")
                                                             for f in DISAGG_FAULTS if "decode-" in f}


@pytest.mark.parametrize("leak", [{"kv_blocks_held": 2}, {"kv_blocks_used": 1}, {"scheduler_requests": 1},
                                  {"redis_pending": {"router": 1}}, {"admission_reserved": {"active": 1.0}},
                                  {"host_blocks_beyond_tier": 3}])
def test_a_hold_left_on_a_prefill_scheduler_fails_the_run_as_any_leak(leak: dict[str, object]) -> None:
    """Nothing held passes; a held KV block left on a scheduler fails the leak check like every other leak."""
    assert _nothing_held(NOTHING)
    assert not _nothing_held({**NOTHING, **leak})


def test_handoff_counts_are_reported_by_outcome_and_by_reason() -> None:
    """The schedulers' series become the report's transfers by outcome and holds ended by reason (zeros left out)."""
    counts = Counter({'sluice_kv_transfers_total{outcome="received"}': 40.0,
                      'sluice_kv_transfers_total{outcome="stale"}': 2.0,
                      'sluice_kv_transfers_total{outcome="failed"}': 0.0,
                      'sluice_kv_holds_ended_total{reason="expired"}': 1.0})
    assert _handoffs(counts) == {"transfers": {"received": 40, "stale": 2}, "holds_ended": {"expired": 1}}


@pytest.mark.parametrize("split", ["0:1", "2", "a:b"])
def test_a_bad_split_ends_in_one_line_naming_the_flag(split: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--disagg that is not P:D with both sides >= 1 exits 2 before anything starts, naming --disagg."""
    with pytest.raises(SystemExit) as ended:
        main(["--disagg", split])
    assert ended.value.code == 2 and "--disagg" in capsys.readouterr().err


@pytest.mark.parametrize("counts", [["--http-clients", "-1"], ["--clients", "-2"], ["--clients", "0", "--http-clients", "0"]])
def test_client_counts_below_zero_or_none_at_all_end_in_one_line_naming_them(counts: list[str],
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A negative --clients or --http-clients, or no client at all, exits 2 before anything starts, naming both."""
    with pytest.raises(SystemExit) as ended:
        main(counts)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "--clients" in err and "--http-clients" in err


@pytest.mark.parametrize(("faults", "named"), [("kill:gpu", "kill:gpu"), ("kill:worker,stop:admission", "stop:admission"),
                                               (",", "none given")])
def test_faults_not_of_the_stack_end_in_one_line_naming_them(faults: str, named: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--faults names only faults of the stack's kind (at least one): another exits 2 before anything starts,
    naming it and the known ones."""
    with pytest.raises(SystemExit) as ended:
        main(["--faults", faults])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "--faults" in err and named in err and "kill:scheduler" in err


def test_the_host_tier_run_gives_every_replica_a_small_device_and_a_host_prefix_tier(tmp_path: Path) -> None:
    """--host-tier: 64 device blocks (so prompts are evicted and paged out), host blocks on every worker and the
    tier on every scheduler; without it the stack has neither."""
    tier = stack_config(ChaosConfig(host_tier=True), tmp_path, tmp_path / "tenants.toml")
    assert (tier.num_blocks, tier.worker_args, tier.scheduler_args) == (64, ("--host-blocks", "1024"),
                                                                        ("--host-prefix-cache",))
    plain = stack_config(ChaosConfig(), tmp_path, tmp_path / "tenants.toml")
    assert (plain.num_blocks, plain.worker_args, plain.scheduler_args) == (None, (), ())


def test_the_intervals_reach_the_schedulers_and_admission_and_bad_ones_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--publish-interval-ms goes to every scheduler (beside the host tier's flag), --stream-interval to admission;
    a negative interval or a stream interval below 1 is a usage error naming the flag."""
    both = stack_config(ChaosConfig(host_tier=True, publish_interval_ms=5.0, stream_interval=4), tmp_path,
                        tmp_path / "tenants.toml")
    assert both.scheduler_args == ("--host-prefix-cache", "--publish-interval-ms", "5.0")
    assert both.admission_args == ("--stream-interval", "4")
    for flag, value in (("--publish-interval-ms", "-1"), ("--stream-interval", "0")):
        with pytest.raises(SystemExit) as ended:
            main([flag, value])
        assert ended.value.code == 2 and flag in capsys.readouterr().err


def test_an_admission_restarting_at_the_leak_check_is_read_again_not_a_crash(tmp_path: Path) -> None:
    """The leak check reads admission's budgets from its metrics; one restarted by the last fault has not printed
    its metrics URL yet: that is an OSError the settle loop reads again (a chaos run ended in ValueError
    'unknown url type' instead)."""
    from types import SimpleNamespace

    from sluice_tools.chaos import _admission_budgets
    from sluice_tools.stack_parts import Proc

    log = tmp_path / "admission.log"
    log.write_text("starting\n")
    restarting = Proc("admission", ["python", "-m", "admission_svc"], log)
    with pytest.raises(OSError, match="metrics URL"):
        _admission_budgets(SimpleNamespace(admission=restarting))  # type: ignore[arg-type]


def test_two_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path: Path) -> None:
    """Without --run-dir each run makes a fresh absolute directory (two runs in one second shared one, and the second
    one's embedded Redis never answered); with it, that directory, made."""
    first, second = _run_dir(ChaosConfig(), tmp_path / "out"), _run_dir(ChaosConfig(), tmp_path / "out")
    assert first != second and first.is_dir() and second.is_dir() and first.is_absolute()
    assert first.name.startswith("chaos-") and first.parent == (tmp_path / "out").resolve()
    given = _run_dir(ChaosConfig(run_dir=str(tmp_path / "given" / "here")))
    assert given == (tmp_path / "given" / "here").resolve() and given.is_dir()


def test_memory_growth_is_the_second_halfs_slope_of_a_process_never_restarted_in_it() -> None:
    """kB per minute over the second half of the samples: a warm-up jump in the first half does not count, a steady
    growth does, and a process restarted in the second half (a new pid) has no figure."""
    samples = []
    for i in range(10):
        t = 30.0 * i
        samples.append({"t": t, "worker-0": (100, 60_000 + (5_000 if i >= 2 else 0)),  # warm-up, then flat
                        "scheduler-0": (200, 60_000 + 10 * i * 30),                  # 10 kB per second
                        "admission": (300 if i < 7 else 301, 70_000)})                # restarted at i = 7
    growth = rss_growth_kb_per_min(samples)
    assert growth == {"worker-0": 0.0, "scheduler-0": 600.0}
    assert rss_growth_kb_per_min([]) == {}


class _StreamServer(http.server.ThreadingHTTPServer):
    """A local HTTP/1.1 server answering one streamed completion the way admission does, with the cost model's
    text for the posted prompt, ended with [DONE] or cut off after `cut_after` tokens (the connection closed)."""

    cut_after: int | None = None


class _StreamHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        model, request_id = CostModel(MODEL), "r-1"
        tokens = [model.token_for(request_id, len(body["prompt"]) + i) for i in range(body["max_tokens"])]
        self.send_response(200)
        self.send_header("x-request-id", request_id)
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            chunk = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

        cut = getattr(self.server, "cut_after", None)
        for i, token in enumerate(tokens):
            if cut is not None and i == cut:
                self.wfile.flush()
                self.close_connection = True
                return  # no [DONE], no last chunk: the connection closes
            event(json.dumps({"choices": [{"index": 0, "text": chr(token), "finish_reason": None}]}))
        event(json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
        event(json.dumps({"choices": [], "usage": {"completion_tokens": len(tokens)}}))
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("cut_after", "pid_changes", "outcome"), [
    (None, False, "exact"),
    (5, True, "failed:CONNECTION_CLOSED"),
    (5, False, "wrong"),
])
def test_an_http_stream_cut_off_is_explicit_only_when_admission_went_away(cut_after: int | None, pid_changes: bool,
                                                                       outcome: str) -> None:
    """The HTTP client of a chaos run: a whole stream with the model's text is exact; one cut off before [DONE] is
    `failed:CONNECTION_CLOSED` when the admission process changed meanwhile, and `wrong` when the same one lived."""
    server = _StreamServer(("127.0.0.1", 0), _StreamHandler)
    server.cut_after = cut_after
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    pids = iter([100, *([200] * 1000 if pid_changes else [100] * 1000)])
    tally = Tally()
    try:
        config = ChaosConfig(max_tokens=(16,), cancel_fraction=0.0, request_timeout_s=10)
        _one_http_request(f"http://127.0.0.1:{server.server_address[1]}/v1", random.Random(1), config,
                          CostModel(MODEL), lambda ids: "".join(map(chr, ids)), lambda: next(pids), tally)
    finally:
        server.shutdown()
        server.server_close()
    assert tally.outcomes == Counter({outcome: 1}) and tally.http_outcomes == tally.outcomes
