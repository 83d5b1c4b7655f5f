"""The round link's framing (sluice/round_link.py `FrameStream`) as a transport delivers bytes: in any chunking."""

from __future__ import annotations

import asyncio
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.round_link import PREFACE, FrameError, FrameStream


def _wire(payloads: list[bytes]) -> bytes:
    return PREFACE + b"".join(struct.pack(">I", len(p)) + p for p in payloads)


def _received(data: bytes, cuts: list[int], max_frame_bytes: int = 1 << 20) -> tuple[list[bytes], FrameStream]:
    """Feed `data` to a FrameStream cut at `cuts`; return the frames it gives back and the stream."""
    async def body() -> tuple[list[bytes], FrameStream]:
        stream = FrameStream(max_frame_bytes)
        edges = [0, *sorted(c for c in set(cuts) if 0 < c < len(data)), len(data)]
        for start, end in zip(edges, edges[1:], strict=False):
            stream.data_received(data[start:end])
        frames = []
        while stream._frames:
            frames.append(await stream.read())
        return frames, stream
    return asyncio.run(body())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=8), st.lists(st.integers(min_value=0, max_value=3000), max_size=12))
def test_frames_come_back_whole_and_in_order_however_the_bytes_are_cut(payloads: list[bytes], cuts: list[int]) -> None:
    """Whatever the reads' boundaries (the preface split, several frames in one read, a frame across reads, empty
    frames), every payload comes back once, whole, in order, and the preface opens the stream."""
    boundaries = [len(PREFACE)]
    for payload in payloads:  # one read per frame: the common case, which skips the buffer
        boundaries.append(boundaries[-1] + 4 + len(payload))
    for cut_at in (cuts, boundaries):
        frames, stream = _received(_wire(payloads), cut_at)
        assert frames == payloads
        assert stream.opened.done() and stream.opened.exception() is None
        assert (stream.frames_in, stream.bytes_in) == (len(payloads), sum(map(len, payloads)))


def test_a_frame_over_the_limit_ends_the_stream_before_its_bytes_are_buffered() -> None:
    """A length over `max_frame_bytes` is a FrameError (frame_too_large) at once, from its 4-byte header alone; the
    frames before it are still read, then `read` raises it."""
    data = _wire([b"ok"]) + struct.pack(">I", 1025)
    frames, stream = _received(data, [len(PREFACE) + 3], max_frame_bytes=1024)  # a cut inside the good frame
    assert frames == [b"ok"]
    assert isinstance(stream.error, FrameError) and stream.error.reason == "frame_too_large"

    async def read() -> None:
        await stream.read()
    try:
        asyncio.run(read())
    except FrameError as exc:
        assert "1025-byte frame" in str(exc)
    else:
        raise AssertionError("read() after a bad frame raises it")


def test_a_peer_that_does_not_start_with_the_preface_is_refused_at_its_first_wrong_byte() -> None:
    """An HTTP request on the link's port is a FrameError (bad_preface) naming what it sent, after its first bytes
    (a prefix of the preface is waited on; the first byte that differs is enough)."""
    _, waiting = _received(PREFACE[:5], [])
    assert waiting.error is None and not waiting.opened.done()
    _, refused = _received(b"GET / HTTP/1.1\r\n", [2])
    assert isinstance(refused.error, FrameError) and refused.error.reason == "bad_preface"
    assert "GET" in str(refused.error)
    assert isinstance(refused.opened.exception(), FrameError)
