"""The same engine on a CUDA device: float32 matches the CPU, bfloat16 stays close, swaps cross the PCIe bus.

Skipped without a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.types import RoundPlan, SamplingParams
from worker_svc.engine.manual import ManualPlanner
from worker_svc.engine.presets import write_preset
from worker_svc.torch_backend import TorchBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BLOCK_SIZE = 16
PROMPTS = [
    list(b"The paged cache on a GPU"),
    list(b"short"),
    list(b"A third, somewhat longer prompt for the batch."),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset(tmp_path_factory.mktemp("tiny"), "tiny")


def final_logits(backend: TorchBackend, swap: bool = False) -> list[torch.Tensor]:
    """Prefill and decode PROMPTS greedily (optionally swapping the first out and back in), then return each sequence's next-token logits."""
    planner = ManualPlanner(backend, BLOCK_SIZE, backend.cache.num_blocks, backend.cache.num_host_blocks)
    seqs = [planner.add(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    planner.generate(seqs, 4)
    if swap:
        backend.execute(planner.swap_out(seqs[0]))
        planner.run(seqs[1:])
        planner.run([seqs[0]], swaps=planner.swap_in(seqs[0]))
        planner.generate(seqs, 6)
    logits = backend.round_logits(RoundPlan(0, tuple(planner.scheduled(s) for s in seqs)))
    return [logits[i] for i in range(len(seqs))]


def test_cuda_float32_matches_cpu(model_dir: Path) -> None:
    """Float32 on CUDA gives the CPU's logits within 1e-3, including after a swap out and in."""
    for swap in (False, True):
        cpu = TorchBackend(model_dir, device="cpu", dtype="float32", num_blocks=64, num_host_blocks=16)
        cuda = TorchBackend(model_dir, device="cuda", dtype="float32", num_blocks=64, num_host_blocks=16)
        assert cuda.info().device.startswith("cuda")
        for expected, found in zip(final_logits(cpu, swap), final_logits(cuda, swap), strict=True):
            torch.testing.assert_close(found, expected, atol=1e-3, rtol=0)


def test_cuda_auto_dtype_is_bfloat16_and_close_to_float32(model_dir: Path) -> None:
    """dtype auto on CUDA is bfloat16; its logits stay within 0.25 of float32's and sampling works."""
    bf16 = TorchBackend(model_dir, device="cuda", num_blocks=64)
    assert bf16.info().dtype == "bfloat16"
    f32 = TorchBackend(model_dir, device="cuda", dtype="float32", num_blocks=64)
    for low, high in zip(final_logits(bf16), final_logits(f32), strict=True):
        assert (low - high).abs().max() < 0.25
    planner = ManualPlanner(bf16, BLOCK_SIZE, 64)
    seq = planner.add("s", PROMPTS[0], SamplingParams(temperature=0.8, top_p=0.9, seed=3))
    planner.generate([seq], 5)
    assert len(seq.output) == 5 and all(0 <= t < 258 for t in seq.output)
