"""Stop-string matcher cost: the linear StopTrimmer against the previous per-prefix matcher, side by side (JSON).

Streams `tokens` one-character pieces of text that keep nearly matching a stop string of `length` characters
(the worst case of the previous matcher) and prints the median seconds per piece of each, in one run.
Usage: PYTHONPATH=. python scripts/bench_stop_strings.py [--lengths 16,256,4096] [--pieces 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

from admission_svc.stops import StopTrimmer


class PreviousTrimmer:
    """The matcher StopTrimmer replaced: every prefix of every stop string against the end of the text."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.held, self.stopped = tuple(stops), "", False

    def push(self, text: str) -> str:
        pending = self.held + text
        hits = [at for stop in self.stops if (at := pending.find(stop)) != -1]
        if hits:
            self.stopped, self.held = True, ""
            return pending[:min(hits)]
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if pending.endswith(stop[:n])), default=0)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]


def _per_piece(make: Callable[[list[str]], object], length: int, pieces: int) -> float:
    stop = "a" * (length - 1) + "b"
    text = ("a" * (length - 1) + "c") * (pieces // length + 1)
    trimmer = make([stop])
    started = time.perf_counter()
    for char in text[:pieces]:
        trimmer.push(char)  # type: ignore[attr-defined]
    return (time.perf_counter() - started) / pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="16,256,4096")
    parser.add_argument("--pieces", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        new = statistics.median(_per_piece(StopTrimmer, length, args.pieces) for _ in range(args.repeats))
        old = statistics.median(_per_piece(PreviousTrimmer, length, args.pieces) for _ in range(args.repeats))
        rows.append({"stop_chars": length, "linear_us_per_piece": round(new * 1e6, 2),
                     "previous_us_per_piece": round(old * 1e6, 2), "speedup": round(old / new, 1)})
    print(json.dumps({"benchmark": "stop_string_matcher", "pieces": args.pieces, "repeats": args.repeats,
                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
