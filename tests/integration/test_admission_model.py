"""Admission serves a model as its directory defines it: BOS on prompts, every EOS id sent to the scheduler.

Runs the real admission servicer over gRPC and Redis with the stand-in router and scheduler of
tests/integration/admission_harness.py, on a Llama-style directory (a BOS post-processor, an eos_token_id list).
"""

from __future__ import annotations

import json
from pathlib import Path

import admission_harness
import pytest
from admission_harness import StandInReplica
from tokenizers import processors

from admission_svc.frontdoor import FrontDoor
from sluice import client as sdk
from sluice.bus import Bus
from sluice.tokenizer import build_byte_tokenizer

pytestmark = pytest.mark.redis


def llama_style_dir(tmp_path: Path) -> Path:
    """A directory whose tokenizer adds <s> (256) and whose config lists two EOS ids (257 and 10)."""
    directory = tmp_path / "llama-style"
    directory.mkdir()
    tokenizer = build_byte_tokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 258, "bos_token_id": 256,
                                                       "eos_token_id": [257, 10], "max_position_embeddings": 64}))
    return directory


def test_prompt_gets_bos_and_submit_carries_every_eos(tmp_path: Path, redis_url: str, namespace: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A text prompt reaches the scheduler with the tokenizer's BOS; EOS 257 as eos_token_id and 10 as a stop id (not with ignore_eos)."""
    directory = llama_style_dir(tmp_path)
    monkeypatch.setattr(admission_harness, "model_dir", lambda _: directory)

    async def body(target: str, servicer: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            await client.generate_text("hi", max_tokens=2, stop_token_ids=[7])
            await client.generate_text("hi", max_tokens=2, ignore_eos=True)
            await client.generate_text([5, 6], max_tokens=2)
        first, ignoring, given_ids = replica.submitted
        assert list(first.prompt_token_ids) == [256, 104, 105] and first.eos_token_id == 257
        assert list(first.sampling.stop_token_ids) == [7, 10]
        assert list(ignoring.sampling.stop_token_ids) == [] and ignoring.sampling.ignore_eos
        assert list(given_ids.prompt_token_ids) == [5, 6], "token ids given by the client are sent as they are"

    admission_harness.run(tmp_path, redis_url, namespace, body)
