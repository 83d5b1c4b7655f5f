"""The client SDK's view of a streamed message (sluice.client._chunk): every field as the server sent it."""

from __future__ import annotations

import time

from sluice.client import Usage, _chunk
from sluice.v1 import admission_pb2, common_pb2


def test_every_status_reads_as_its_enum_name_and_token_chunks_carry_no_usage() -> None:
    """Each RequestStatus (and an unknown number) reads as the name protobuf gives it; a token chunk keeps its
    request id, index, tokens in order, text and the server's stamp, and carries no usage."""
    before = time.time()
    for value in common_pb2.RequestStatus.DESCRIPTOR.values:
        message = admission_pb2.GenerateChunk(request_id="r", index=3, token_ids=[7, 8, 9], text="ab",
                                              status=value.number, created_unix_s=12.5)
        chunk = _chunk(message)
        assert chunk.status == common_pb2.RequestStatus.Name(value.number) == value.name
        assert (chunk.request_id, chunk.index, chunk.token_ids, chunk.text, chunk.created_unix_s) == (
            "r", 3, (7, 8, 9), "ab", 12.5)
        assert chunk.usage is None and not chunk.finished and chunk.received_s >= before


def test_the_last_chunk_carries_usage_finish_reason_and_status() -> None:
    """The final message's usage, finish reason and terminal status come through whole."""
    message = admission_pb2.GenerateChunk(request_id="r", index=4, finished=True, finish_reason="length",
                                          status=common_pb2.FINISHED_LENGTH)
    message.usage.input_tokens, message.usage.output_tokens, message.usage.cached_tokens = 10, 4, 2
    chunk = _chunk(message)
    assert (chunk.finished, chunk.finish_reason, chunk.status) == (True, "length", "FINISHED_LENGTH")
    assert chunk.usage == Usage(input_tokens=10, output_tokens=4, cached_tokens=2)
