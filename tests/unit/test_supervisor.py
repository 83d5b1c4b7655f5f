"""The supervisor's restart bookkeeping (pure: times are arguments) and how it names a death."""

from __future__ import annotations

import signal

from sluice_tools.supervisor import RestartPolicy, Restarts, describe_exit


def test_a_process_that_keeps_dying_is_given_up_on() -> None:
    """Backoff doubles per quick death up to its cap, resets after a stable run, and gives up past the limit."""
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=4.0, stable_after_s=30.0, max_restarts=3)
    track = Restarts(policy)
    assert track.died(100.0) == 101.0
    track.restarted(101.0)
    assert track.died(102.0) == 104.0
    track.restarted(104.0)
    assert track.died(105.0) == 109.0
    track.restarted(109.0)
    assert track.died(110.0) is None and track.gave_up
    stable = Restarts(policy)
    stable.died(0.0)
    stable.restarted(1.0)
    assert stable.died(40.0) == 41.0  # ran 39 s: the streak starts over
    assert stable.total == 1


def test_a_death_is_described_by_its_exit_code_or_signal() -> None:
    """Negative return codes are signals by name; others are exit codes."""
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(None) == "unknown exit"


def test_each_launch_reads_back_only_the_metrics_url_its_own_incarnation_printed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A relaunched process's metrics_url is cleared at launch and read from what the new incarnation printed,
    not the last URL of the log it appends to (the dead one's port)."""
    import sys

    from sluice.serve import METRICS_LINE
    from sluice_tools.stack import Proc

    command = [sys.executable, "-c", f"import os, sys; print({METRICS_LINE!r} + os.environ['URL']); "
                                     "sys.exit(int(os.environ.get('CODE', '0')))"]
    proc = Proc("svc", command, tmp_path / "svc.log", env={"URL": "http://h:1/metrics"})
    proc.launch()
    assert proc.popen is not None and proc.popen.wait(30) == 0
    proc.metrics_url = proc.printed_metrics_url()
    assert proc.metrics_url == "http://h:1/metrics"
    proc.env = {"URL": "http://h:2/metrics", "CODE": "0"}
    proc.args = [sys.executable, "-c", "pass"]  # an incarnation that has not printed its URL (yet)
    proc.launch()
    assert proc.metrics_url == ""
    assert proc.popen.wait(30) == 0 and proc.printed_metrics_url() == ""
    proc.args = command
    proc.launch()
    assert proc.popen.wait(30) == 0 and proc.printed_metrics_url() == "http://h:2/metrics"
    assert (tmp_path / "svc.log").read_text().count(METRICS_LINE) == 2
