"""Fixtures shared by the unit tests that run the torch engine on the tiny preset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run the module's torch code on one thread, restoring the previous count afterwards."""
    import torch

    # tiny tensors gain nothing from threads, and OpenMP threads on a shared CPU slow down ~4x
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny preset (config, weights, tokenizer), written once; tests must not modify it."""
    from worker_svc.engine.presets import write_preset

    return write_preset(tmp_path_factory.mktemp("tiny"), "tiny")
