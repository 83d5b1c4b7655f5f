"""Stop strings (admission_svc/stops.py): the linear matcher shows what the previous one showed, and the limits."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from admission_svc.stops import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, StopTrimmer, stop_strings_problem


class _Reference:
    """The previous matcher, kept as the oracle: every prefix of every stop against the text's end, per piece."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.held, self.stopped = tuple(s for s in stops if s), "", False

    def push(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        pending = self.held + text
        hits = [at for stop in self.stops if (at := pending.find(stop)) != -1]
        if hits:
            self.stopped, self.held = True, ""
            return pending[:min(hits)]
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if pending.endswith(stop[:n])), default=0)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        held, self.held = ("" if self.stopped else self.held), ""
        return held


_text = st.text(alphabet="abc", max_size=12)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet="abc", max_size=5), max_size=MAX_STOP_STRINGS), pieces=st.lists(_text))
def test_the_linear_matcher_shows_exactly_what_the_previous_one_showed(stops: list[str], pieces: list[str]) -> None:
    """For any stop strings and any split of the text into pieces, every push and the flush return what the
    previous (quadratic) matcher returned: text up to the earliest stop string, a possible start held back."""
    fast, slow = StopTrimmer(stops), _Reference(stops)
    assert [fast.push(p) for p in pieces] == [slow.push(p) for p in pieces]
    assert fast.flush() == slow.flush() and fast.stopped == slow.stopped


def test_a_long_stop_string_split_over_many_pieces_is_found_and_a_false_start_released() -> None:
    """A stop string of the longest allowed length, arriving one character at a time after a near miss, is held
    back while it may still match, released when it does not, and cuts the text where it starts."""
    stop = "x" * (MAX_STOP_STRING_CHARS - 1) + "y"
    trimmer = StopTrimmer([stop])
    near_miss = "x" * (MAX_STOP_STRING_CHARS - 1) + "z"
    shown = "".join(trimmer.push(c) for c in "ab" + near_miss + "cd" + stop + "tail")
    assert shown == "ab" + near_miss + "cd" and trimmer.stopped and trimmer.flush() == ""


def test_stop_strings_over_the_limits_are_named() -> None:
    """More than MAX_STOP_STRINGS stop strings, or one over MAX_STOP_STRING_CHARS characters, is a problem that
    says which; within the limits there is none."""
    assert stop_strings_problem(["a"] * MAX_STOP_STRINGS) is None
    assert stop_strings_problem(["a", "b" * MAX_STOP_STRING_CHARS]) is None
    assert "at most 4 stop strings, got 5" in (stop_strings_problem(["a"] * 5) or "")
    assert "stop string 1 has 1048576 characters" in (stop_strings_problem(["a", "b" * (1 << 20)]) or "")
