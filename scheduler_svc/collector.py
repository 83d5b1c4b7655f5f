"""The garbage collector's settings for a process that runs a scheduler core.

Why: CPython (3.11) starts a young collection whenever tracked allocations outnumber
deallocations by `threshold0` (700). A round allocates a few tracked objects per scheduled
sequence (its ScheduledSeq and token tuple, the worker's output, the emitted token) that live
until its result is applied; from about 200 running requests on, every round crosses 700 while
they are alive, so they are promoted, and each time the old generation has grown by a quarter a
full collection walks every live request: 17-65 ms at 1024 running and 4096 waiting, the p99 of a
round. With `threshold0` above one round's transient objects, collections follow the real growth
of live objects (new requests), not the churn of rounds. `sluice.serve` freezes the start-up heap;
this sets the thresholds for what comes after.
"""

from __future__ import annotations

import gc

TRANSIENT_OBJECTS_PER_SEQ = 16
"""Tracked objects one scheduled sequence may allocate per round, with headroom (about 4 today)."""


def young_threshold(max_num_seqs: int) -> int:
    """Return the young-generation threshold for rounds of up to `max_num_seqs` sequences."""
    return TRANSIENT_OBJECTS_PER_SEQ * max_num_seqs


def tune_collector(max_num_seqs: int) -> tuple[int, int, int]:
    """Raise the collector's young threshold above one round's transient objects; return the thresholds.

    Never lowers a threshold (a process running several cores keeps the largest).
    """
    threshold0, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(max(threshold0, young_threshold(max_num_seqs)), threshold1, threshold2)
    return gc.get_threshold()  # type: ignore[return-value]
