"""The worker's end of the round link (sluice/round_link.py): ExecuteStream's rounds over a plain stream.

Theory of operation
- Offered next to the gRPC service, on the same host (`--round-link-port`, 0: a free port); `Info` advertises
  the port (`WorkerInfo.round_link_port`) and the scheduler uses it unless told not to. Health, Info, Execute
  and the KV transfer stay on gRPC.
- A connection is one ExecuteStream: its plans go through `WorkerServicer.rounds`, the very code of the gRPC
  stream (converted, validated and queued on the runtime's backend thread as each arrives; a plan refused as a
  whole answered with a failed round; results written in order; the rounds of a closed link that have not
  started cancelled). Spans of traced rounds name `rpc.method` "RoundLink".
- Under mutual TLS (the gRPC service's files) a peer must present a certificate of a role that may call
  ExecuteStream (sluice.tls.CALLERS: the scheduler); any other is refused and disconnected.
- A peer that sends something that is not a frame of the link (no preface, a frame over the size limit, bytes
  that are not a RoundPlan) is logged with its address and what it sent, counted
  (`sluice_worker_round_link_errors_total{reason}`) and disconnected; the worker goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from google.protobuf.message import DecodeError

from sluice import round_link, tls
from sluice.prom import WorkerMetrics
from sluice.round_link import FrameError, FrameStream
from sluice.tls import TlsFiles
from sluice.v1 import worker_pb2

__all__ = ["RoundLinkServer"]

log = logging.getLogger(__name__)

RPC = "RoundLink"
"""How the link's rounds are named in metrics (`sluice_worker_rounds_total{rpc}`) and spans (`rpc.method`)."""
PREFACE_TIMEOUT_S = 10.0
"""A connection that has not sent its preface (nor a TLS handshake) by then is dropped."""
_METHOD = "/sluice.v1.WorkerService/ExecuteStream"
RoundsFn = Callable[[AsyncIterator[worker_pb2.RoundPlan], Callable[[], bool], str],
                    AsyncGenerator[worker_pb2.RoundResult, None]]
"""`WorkerServicer.rounds`: (plans, closed, rpc) -> results in order."""


class RoundLinkServer:
    """Accepts round links and serves each with the servicer's `rounds`."""

    def __init__(self, rounds: RoundsFn, metrics: WorkerMetrics, tls_files: TlsFiles | None = None) -> None:
        self._rounds = rounds
        self._metrics = metrics
        self._ssl = round_link.server_ssl(tls_files) if tls_files is not None else None
        self._server: asyncio.AbstractServer | None = None
        self._links: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: a free port); return the bound port. Raises OSError when it cannot bind."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port, ssl=self._ssl,
                                                ssl_handshake_timeout=PREFACE_TIMEOUT_S if self._ssl else None)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("round link on %s:%d%s", host, self.port, " (mutual TLS)" if self._ssl else "")
        return self.port

    async def close(self) -> None:
        """Stop accepting and close every link (their queued rounds that have not started are cancelled)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._links):
            task.cancel()
        if self._links:
            await asyncio.gather(*self._links, return_exceptions=True)

    def _accept(self) -> FrameStream:
        stream = FrameStream()
        task = asyncio.get_running_loop().create_task(self._serve(stream))
        self._links.add(task)
        task.add_done_callback(self._links.discard)
        return stream

    async def _serve(self, stream: FrameStream) -> None:
        try:
            async with asyncio.timeout(PREFACE_TIMEOUT_S):
                await stream.opened
        except TimeoutError:
            stream.close(FrameError(f"no preface within {PREFACE_TIMEOUT_S:.0f} s", reason="no_preface"))
        except ConnectionError:
            stream.close()  # a bad preface (its FrameError is the stream's), or the peer left at once
        else:
            role = round_link.peer_role(stream.transport)
            if self._ssl is not None and not tls.may_call(_METHOD, role):
                stream.close(FrameError(f"role {role!r} may not run rounds", reason="forbidden"))
            else:
                await self._run(stream)
        if isinstance(stream.error, FrameError):
            log.error("round link from %s refused (%s): %s", stream.peer, stream.error.reason, stream.error)
            self._metrics.round_link_errors.labels(stream.error.reason).inc()

    async def _run(self, stream: FrameStream) -> None:
        metrics = self._metrics
        metrics.round_links.inc()
        metrics.round_link_frames.track(stream)
        log.info("round link from %s opened", stream.peer)
        try:
            async with contextlib.aclosing(self._rounds(_plans(stream), lambda: stream.error is not None,
                                                        RPC)) as results:
                async for result in results:
                    stream.write(result.SerializeToString())
                    await stream.drain()
        except ConnectionError:
            pass  # the scheduler closed the link (it opens another), or sent a bad frame (logged by `_serve`)
        except Exception as exc:  # Unavailable before warm-up and the like: the link ends, as ExecuteStream would
            log.warning("round link from %s ended: %s", stream.peer, exc)
        finally:
            stream.close()
            metrics.round_link_frames.untrack(stream)
            metrics.round_links.dec()
            log.info("round link from %s closed", stream.peer)


async def _plans(stream: FrameStream) -> AsyncIterator[worker_pb2.RoundPlan]:
    """The plans a link brings, until the peer closes it. Raises FrameError for a frame that is not a RoundPlan."""
    from_string = worker_pb2.RoundPlan.FromString
    while True:
        try:
            payload = await stream.read()
        except FrameError:
            raise
        except ConnectionError:
            return
        try:
            plan = from_string(payload)
        except DecodeError as exc:
            error = FrameError(f"a {len(payload)}-byte frame is not a RoundPlan: {exc}", reason="not_a_plan")
            stream.close(error)
            raise error from None
        yield plan
