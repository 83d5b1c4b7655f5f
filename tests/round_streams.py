"""A stream of rounds to a real worker, over gRPC's ExecuteStream or the worker's round link, driven the same way:
the worker tests that write plans and read results on a stream run over both (`@pytest.mark.parametrize("kind",
KINDS)`)."""

from __future__ import annotations

import ssl

import grpc

from sluice import round_link
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.server import RunningWorker

__all__ = ["KINDS", "RoundStream"]

KINDS = ("grpc_stream", "round_link")


class RoundStream:
    """Plans written, results read in order, on one stream of `kind`."""

    def __init__(self, kind: str, call: grpc.aio.StreamStreamCall | None = None,
                 link: round_link.FrameStream | None = None) -> None:
        self.kind = kind
        self.call = call
        self.link = link

    @classmethod
    async def open(cls, kind: str, worker: RunningWorker, channel: grpc.aio.Channel,
                   ssl_context: ssl.SSLContext | None = None) -> RoundStream:
        """Open a stream of `kind` to `worker` (the round link at the port its Info advertises)."""
        if kind == "grpc_stream":
            return cls(kind, call=worker_pb2_grpc.WorkerServiceStub(channel).ExecuteStream())
        info = await worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest())
        assert info.round_link_port, "the worker offers its round link"
        return cls(kind, link=await round_link.open_stream("127.0.0.1", info.round_link_port, ssl_context))

    async def write(self, wire: worker_pb2.RoundPlan) -> None:
        if self.call is not None:
            await self.call.write(wire)
        else:
            assert self.link is not None
            self.link.write(wire.SerializeToString())

    async def read(self) -> worker_pb2.RoundResult:
        if self.call is not None:
            reply = await self.call.read()
            assert reply is not grpc.aio.EOF
            return reply  # type: ignore[no-any-return]
        assert self.link is not None
        return worker_pb2.RoundResult.FromString(await self.link.read())

    async def done_writing(self) -> None:
        if self.call is not None:
            await self.call.done_writing()
        elif self.link is not None:
            self.link.close()
