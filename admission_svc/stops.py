"""Stop strings: their limits, and cutting streamed text at the first one in time linear in the text.

Limits (both transports, checked before anything is tokenized): at most MAX_STOP_STRINGS stop strings (OpenAI's
own limit) of at most MAX_STOP_STRING_CHARS characters each; more is INVALID_ARGUMENT / HTTP 400 naming the field.

`StopTrimmer` cuts the text of a generation at the first stop string, holding back a tail that may be the start
of one. Each stop string runs a Knuth-Morris-Pratt automaton over the text as it arrives, so the work per piece
is proportional to the piece (times the number of stop strings) plus the tail held back, never to the square of
a stop string's length: the previous matcher compared every prefix of every stop string with the end of the
text on each piece, which a 50 KB stop string made a half-second stall of every stream of the process.
The text shown is what the previous matcher showed: up to the earliest start, among the stop strings found in
the text so far, of each one's first occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "StopTrimmer", "stop_strings_problem"]

MAX_STOP_STRINGS = 4
"""Stop strings one request may give (OpenAI's limit)."""
MAX_STOP_STRING_CHARS = 256
"""Characters one stop string may have."""


def stop_strings_problem(stops: Sequence[str]) -> str | None:
    """Return why `stops` is refused (too many, one too long), or None when it is within the limits."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    for index, stop in enumerate(stops):
        if len(stop) > MAX_STOP_STRING_CHARS:
            return f"stop string {index} has {len(stop)} characters, at most {MAX_STOP_STRING_CHARS} are allowed"
    return None


def _failure(stop: str) -> list[int]:
    """Return the KMP prefix function: for each i, the longest proper prefix of stop[:i+1] that is also its suffix."""
    failure = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        if stop[i] == stop[k]:
            k += 1
        failure[i] = k
    return failure


class _Matcher:
    """One stop string's automaton: `state` is the longest prefix of it that ends the text seen so far."""

    __slots__ = ("failure", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.failure = _failure(stop)
        self.state = 0

    def feed(self, text: str) -> int:
        """Advance over `text`; return the index in `text` where the first complete match ends, or -1."""
        stop, failure, state = self.stop, self.failure, self.state
        for at, char in enumerate(text):
            while state and stop[state] != char:
                state = failure[state - 1]
            if stop[state] == char:
                state += 1
                if state == len(stop):
                    self.state = failure[state - 1]
                    return at
        self.state = state
        return -1


class StopTrimmer:
    """Cuts the text at the first stop string, holding back a tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._matchers = [_Matcher(stop) for stop in self.stops if stop]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Return the part of `text` (after what was held back) that can be shown now."""
        if self.stopped or not self._matchers:
            return "" if self.stopped else text
        held = self._held
        starts = [len(held) + end - len(m.stop) + 1 for m in self._matchers if (end := m.feed(text)) != -1]
        if starts:
            self.stopped, self._held = True, ""
            cut = min(starts)
            return held[:cut] + text[:max(cut - len(held), 0)]
        keep = max(m.state for m in self._matchers)
        shown = len(held) + len(text) - keep
        if keep <= len(text):
            self._held = text[len(text) - keep:] if keep else ""
        else:
            self._held = held[len(held) - (keep - len(text)):] + text
        return held[:shown] + text[:max(shown - len(held), 0)]

    def flush(self) -> str:
        """Return what was held back (the generation ended without completing a stop string)."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held
