"""The round link: a scheduler's plans and its worker's results as length-prefixed protobuf frames on one stream.

Why: at a GPU's pace (a round every few ms, 16 sequences) grpc.aio's bidi stream costs the scheduler more CPU per
round than the rest of the round's work: each message wakes its completion-queue thread, which wakes the event loop
through a socket. The same messages on a plain asyncio stream cost a socket read or write each
(sluice_tools/bench_link.py measures both; docs/benchmarks.md). vLLM links its API server and engine core the
same way (ZMQ) for the same reason.

Rules of the link
- The protos stay the only wire types: the scheduler writes `RoundPlan`s, the worker `RoundResult`s, in order,
  one result per plan. A frame is a 4-byte big-endian length and that many bytes of one serialized message.
- Each side first writes `PREFACE` and checks the other's: a peer that is not a round link (an HTTP client, a gRPC
  client on the wrong port) is told so in a `FrameError` and the connection is closed; nothing else is read.
- A frame longer than `max_frame_bytes` is a `FrameError` (the connection is closed): a peer cannot make the
  other buffer without bound.
- TLS: when the deployment's gRPC calls use mutual TLS (sluice.tls), so does the link, with the same files; the
  worker admits only a peer whose certificate names a role that may call ExecuteStream (`sluice.tls.CALLERS`).
- `FrameStream` is one asyncio Protocol for both ends: `write` puts a frame on the transport (no await: a socket
  write), `read` returns the next whole frame (no await when one is buffered), `ConnectionError` once the peer
  has gone or sent something that is not a frame (`error` says what).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import struct
from typing import Any, cast

from sluice.tls import TlsFiles

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "FrameError", "FrameStream", "PREFACE", "client_ssl", "open_stream",
           "peer_role", "server_ssl"]

PREFACE = b"SLUICE-ROUNDS/1\n"
"""What each end writes first (the protocol and its version)."""
DEFAULT_MAX_FRAME_BYTES = 64 << 20
"""Largest frame either end accepts: a plan of 1,024 sequences with long prompts is a few MB."""
_HEADER = struct.Struct(">I")
_pack = _HEADER.pack


class FrameError(ConnectionError):
    """The peer sent something that is not a frame of this link (the message says what, `reason` names it for a
    metric label: bad_preface, frame_too_large, not_a_plan, not_a_result, forbidden, no_preface); the link is
    closed."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class FrameStream(asyncio.Protocol):
    """One end of a round link: whole frames in, whole frames out. See the module docstring."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        """The peer's HOST:PORT, for logs."""
        self.error: ConnectionError | None = None
        """Why the link ended (None while it is up)."""
        self.frames_in = self.frames_out = self.bytes_in = self.bytes_out = 0
        self._frames: collections.deque[bytes] = collections.deque()
        self._buffer = bytearray()
        self._preface = False
        """The peer's preface has been read."""
        self._waiter: asyncio.Future[None] | None = None
        self._resumed: asyncio.Future[None] | None = None
        """While the transport's write buffer is over its high mark: resolved when it drains."""
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved when the peer's preface has arrived (an exception when the link ended before)."""

    # ---- asyncio.Protocol --------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple) and len(address) >= 2:
            self.peer = f"{address[0]}:{address[1]}"
        self.transport.write(PREFACE)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if not buffer and self._preface and len(data) >= 4:
            # The common case, a whole frame in one read: no copy into the buffer.
            size = _HEADER.unpack_from(data)[0]
            if len(data) == size + 4 and size <= self.max_frame_bytes:
                self._frames.append(data[4:])
                self.frames_in += 1
                self.bytes_in += size
                self._wake()
                return
        buffer += data
        try:
            self._split()
        except FrameError as exc:
            self._fail(exc)
            return
        self._wake()

    def eof_received(self) -> bool | None:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = ConnectionError(f"the round link closed: {exc}" if exc else "the peer closed the round link")
        self.transport = None
        if not self.opened.done():
            self.opened.set_exception(self.error)
            self.opened.exception()  # retrieved: a link that ends unopened is read through `read`
        self._wake()
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)

    def pause_writing(self) -> None:
        self._resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    # ---- the link's side -----------------------------------------------------------------------------------------
    def write(self, payload: bytes) -> None:
        """Put one frame on the wire. Raises ConnectionError (the link's `error`) once the link is down."""
        transport = self.transport
        if transport is None or self.error is not None:
            raise self.error or ConnectionError("the round link is not open")
        transport.write(_pack(len(payload)) + payload)
        self.frames_out += 1
        self.bytes_out += len(payload)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark (a peer that does not read)."""
        if self._resumed is not None:
            await self._resumed

    async def read(self) -> bytes:
        """Return the next frame's payload. Raises ConnectionError (FrameError for a bad frame) once the link is
        down and every frame received before has been read."""
        frames = self._frames
        while not frames:
            if self.error is not None:
                raise self.error
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return frames.popleft()

    def close(self, error: ConnectionError | None = None) -> None:
        """Close the link (`error`: why, for `read`)."""
        if self.error is None:
            self.error = error or ConnectionError("the round link was closed here")
        if self.transport is not None:
            self.transport.close()
        self._wake()

    # ---- inside --------------------------------------------------------------------------------------------------
    def _split(self) -> None:
        buffer, frames = self._buffer, self._frames
        if not self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise FrameError(f"the peer is not a Sluice round link (it sent {bytes(buffer[:32])!r})",
                                     reason="bad_preface")
                return
            if buffer[:len(PREFACE)] != PREFACE:
                raise FrameError(f"the peer is not a Sluice round link (it sent {bytes(buffer[:32])!r})",
                                 reason="bad_preface")
            del buffer[:len(PREFACE)]
            self._preface = True
            if not self.opened.done():
                self.opened.set_result(None)
        start, end = 0, len(buffer)
        while end - start >= 4:
            size = _HEADER.unpack_from(buffer, start)[0]
            if size > self.max_frame_bytes:
                raise FrameError(f"the peer sent a {size}-byte frame; the most is {self.max_frame_bytes}",
                                 reason="frame_too_large")
            if end - start - 4 < size:
                break
            frames.append(bytes(buffer[start + 4:start + 4 + size]))
            self.frames_in += 1
            self.bytes_in += size
            start += 4 + size
        if start:
            del buffer[:start]

    def _fail(self, exc: FrameError) -> None:
        self.error = exc
        if not self.opened.done():
            self.opened.set_exception(exc)
            self.opened.exception()
        if self.transport is not None:
            self.transport.abort()  # nothing more of this peer is read

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def open_stream(host: str, port: int, ssl_context: ssl.SSLContext | None = None, *,
                      timeout_s: float = 5.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> FrameStream:
    """Connect to a round link at host:port and wait for its preface; return the stream.

    Raises ConnectionError (FrameError for a peer that is not a round link), OSError when it cannot connect,
    TimeoutError when it does not answer within `timeout_s`."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        _, stream = await loop.create_connection(lambda: FrameStream(max_frame_bytes), host, port, ssl=ssl_context)
        try:
            await stream.opened
        except BaseException:
            stream.close()
            raise
    transport = stream.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return stream


def server_ssl(files: TlsFiles) -> ssl.SSLContext:
    """Return the worker's TLS context: its certificate, and a client certificate from the CA required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl(files: TlsFiles) -> ssl.SSLContext:
    """Return the scheduler's TLS context: its certificate presented, only the CA trusted, the host name checked."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def peer_role(transport: Any) -> str | None:
    """Return the role (the certificate's common name) of a TLS peer, None without a certificate."""
    cert = transport.get_extra_info("peercert") if transport is not None else None
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
