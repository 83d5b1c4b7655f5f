"""Named GPUs and model shapes for the cost model (facts from public datasheets and configs).

GPU figures are the vendor's dense (no sparsity) BF16 tensor-core peak and HBM bandwidth:
- NVIDIA H100 SXM5 80GB: 989 TFLOP/s BF16 dense (the datasheet's 1,979 is with 2:4 sparsity),
  3.35 TB/s HBM3, 80 GB; PCIe Gen5 x16 host link, 64 GB/s per direction.
  Source: NVIDIA H100 Tensor Core GPU datasheet.
- NVIDIA H200 SXM 141GB: same Hopper compute, 989 TFLOP/s BF16 dense, 4.8 TB/s HBM3e, 141 GB;
  PCIe Gen5 x16, 64 GB/s per direction. Source: NVIDIA H200 Tensor Core GPU datasheet.
- NVIDIA GH200 Grace Hopper Superchip, HBM3e variant: the same Hopper GPU, 989 TFLOP/s BF16 dense, up to 144 GB
  HBM3e at 4.9 TB/s, tied to the Grace CPU's 480 GB of LPDDR5X by NVLink-C2C, 900 GB/s both directions together:
  450 GB/s per direction, 7x PCIe Gen5 (what a host KV tier copies over). Source: NVIDIA GH200 Grace Hopper
  Superchip datasheet.

Model shapes are the published `config.json` numbers of Meta Llama 3 (8B and 70B). The repo's own
presets (`tiny`, `small-100m`) come from `worker_svc.engine.preset_configs` (torch-free) when that module exists, so
the cost model and the torch engine agree on one definition; the fallbacks below are used otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProfile:
    """Peak numbers of one accelerator."""

    name: str
    peak_flops: float
    """Dense BF16 tensor FLOP/s."""
    memory_bandwidth: float
    """HBM bytes/s."""
    memory_bytes: float
    """Device memory in bytes."""
    host_link_bandwidth: float
    """Host <-> device bytes/s per direction (KV swap)."""


GPUS: dict[str, GpuProfile] = {
    "h100": GpuProfile(
        "h100", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9, host_link_bandwidth=64e9
    ),
    "h200": GpuProfile(
        "h200", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9, host_link_bandwidth=64e9
    ),
    "gh200": GpuProfile(
        "gh200", peak_flops=989e12, memory_bandwidth=4.9e12, memory_bytes=144e9, host_link_bandwidth=450e9
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-architecture decoder that set its cost."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    eos_token_id: int
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        """Return the width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: attention projections, SwiGLU MLP, two norms."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h

    @property
    def lm_head_params(self) -> int:
        """Return the weights of the output head (vocab x hidden)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All weights, embedding and (untied) output head included."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else self.lm_head_params
        return embed + self.num_layers * self.layer_params + head + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Return the KV cache bytes one token occupies (keys and values, every layer)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


# Meta Llama 3 config.json: hidden 4096/8192, layers 32/80, heads 32/64, kv heads 8, intermediate
# 14336/28672, vocab 128256, max_position_embeddings 8192, eos <|end_of_text|> = 128001.
# Llama 3.1 has the same shapes with a 131072-token context (max_position_embeddings).
LLAMA_SHAPES: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 128001),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 128001),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072, 128001),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072, 128001),
}

# Used only when worker_svc.engine.preset_configs is absent; keep in step with it.
_FALLBACK_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", 4, 128, 4, 2, 352, 258, 2048, 257),
    "small-100m": ModelShape("small-100m", 12, 768, 12, 4, 2048, 32000, 2048, 257, tie_embeddings=True),
}


def _shape_from_config(name: str, config: Mapping[str, object]) -> ModelShape:
    def number(*keys: str, default: int | None = None) -> int:
        for key in keys:
            if key in config:
                return int(config[key])  # type: ignore[call-overload]
        if default is None:
            raise ValueError(f"preset {name!r} lacks {keys[0]!r}")
        return default

    heads = number("num_attention_heads", "num_heads")
    return ModelShape(
        name=name,
        num_layers=number("num_hidden_layers", "num_layers"),
        hidden_size=number("hidden_size"),
        num_heads=heads,
        num_kv_heads=number("num_key_value_heads", "num_kv_heads", default=heads),
        intermediate_size=number("intermediate_size"),
        vocab_size=number("vocab_size"),
        max_position=number("max_position_embeddings", "max_position", default=2048),
        eos_token_id=number("eos_token_id", default=0),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _engine_presets() -> Mapping[str, Mapping[str, object]]:
    try:
        module = importlib.import_module("worker_svc.engine.preset_configs")  # torch-free
    except ImportError:
        return {}
    presets = getattr(module, "PRESETS", {})
    return presets if isinstance(presets, Mapping) else {}


def model_shape(name: str) -> ModelShape:
    """Return the shape of a named model (Llama 3 or a repo preset); raises ValueError listing the known names."""
    if name in LLAMA_SHAPES:
        return LLAMA_SHAPES[name]
    preset = _engine_presets().get(name)
    if isinstance(preset, Mapping):
        return _shape_from_config(name, preset)
    if preset is not None and dataclasses.is_dataclass(preset) and not isinstance(preset, type):
        return _shape_from_config(name, dataclasses.asdict(preset))
    if name in _FALLBACK_PRESETS:
        return _FALLBACK_PRESETS[name]
    raise ValueError(f"unknown model {name!r}; known: {', '.join(known_models())}")


def known_models() -> list[str]:
    """Return every name `model_shape` accepts (Llama 3 shapes and the repo's presets), sorted."""
    return sorted({*LLAMA_SHAPES, *_engine_presets(), *_FALLBACK_PRESETS})


def gpu_profile(name: str) -> GpuProfile:
    """Return a named GPU profile; raises ValueError listing the known names."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}") from None
