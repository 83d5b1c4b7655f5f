"""The model configuration read from a Hugging Face-style `config.json` (Llama architecture)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sluice.model_spec import token_ids
from worker_svc.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURE = "LlamaForCausalLM"
SUPPORTED_MODEL_TYPE = "llama"


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-architecture decoder."""

    vocab_size: int
    """Rows of the embedding and of the output projection."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    head_dim: int
    """Width of one head."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_llama3: tuple[float, float, float, int] | None = None
    """Llama 3.1-style frequency scaling: (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None for plain RoPE."""
    max_position_embeddings: int = 2048
    """Longest sequence (prompt + output) the model accepts."""
    tie_word_embeddings: bool = False
    """The output projection shares the embedding matrix."""
    bos_token_id: int = 1
    """Beginning-of-sequence token."""
    eos_token_id: int = 2
    """End-of-sequence token (the first one when config.json lists several; ModelSpec has them all)."""
    torch_dtype: str = "float32"
    """The dtype the weights were saved in."""

    @property
    def num_parameters(self) -> int:
        """Return the number of distinct parameters (tied embeddings counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h

    def to_hf_dict(self) -> dict[str, Any]:
        """Return the config.json contents for this configuration (Hugging Face field names)."""
        out = asdict(self)
        out.update(
            architectures=[SUPPORTED_ARCHITECTURE],
            model_type=SUPPORTED_MODEL_TYPE,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            rope_scaling=None,
        )
        out.pop("rope_llama3")
        if self.rope_llama3 is not None:
            factor, low, high, original = self.rope_llama3
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        """Return the configuration in a parsed config.json.

        Raises ModelLoadError when the architecture is not Llama, a required field is missing or
        a feature this engine does not implement (biases, a rope scaling other than llama3, another
        activation) is on.
        """
        _check_architecture(raw, source)
        _check_unsupported(raw, source)
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                rope_llama3=_rope_llama3(raw, source),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=_token_id(raw.get("bos_token_id"), 1),
                eos_token_id=_token_id(raw.get("eos_token_id"), 2),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: required field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: bad field value: {exc}") from None


def _check_architecture(raw: dict[str, Any], source: str) -> None:
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if SUPPORTED_ARCHITECTURE not in architectures or model_type != SUPPORTED_MODEL_TYPE:
        raise ModelLoadError(
            f"{source}: only architectures=[{SUPPORTED_ARCHITECTURE!r}] with model_type="
            f"{SUPPORTED_MODEL_TYPE!r} is supported; found architectures={architectures!r}, "
            f"model_type={model_type!r}"
        )


def _check_unsupported(raw: dict[str, Any], source: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelLoadError(f"{source}: {flag}=true is not supported")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise ModelLoadError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 writes the base inside "rope_parameters"; older configs have "rope_theta"
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    return float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _rope_llama3(raw: dict[str, Any], source: str) -> tuple[float, float, float, int] | None:
    # transformers 4 writes "rope_scaling" (None for plain RoPE), transformers 5 "rope_parameters"
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{source}: rope scaling {scaling!r} is not supported (only 'default' and 'llama3')"
        )
    try:
        return (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {exc.args[0]!r}") from None


def _token_id(value: Any, default: int) -> int:
    # null means "use the Llama default"; a list (Llama 3) contributes its first id. The loader
    # replaces both ids with the ModelSpec's, which also reads generation_config.json.
    ids = token_ids(value)
    return ids[0] if ids else default
