"""A Llama-architecture decoder in torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names follow Hugging Face Llama checkpoints (`model.layers.{i}.self_attn.q_proj.weight`
and so on) so a real checkpoint loads with `load_state_dict`. The layers never see a cache: each
layer gets an `attend(layer_index, q, k, v)` callable, so the paged round forward
(`forward_paged`) and the plain full-recompute reference (`reference_forward`) share every
weight and every operation except attention itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.engine.config import LlamaConfig

# (layer_index, q [..., H, D], k [..., KVH, D], v [..., KVH, D]) -> attention output [..., H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return x normalised to unit RMS over its last dimension, times the weight."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(config: LlamaConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos, sin), each [max_position_embeddings, head_dim] in float32."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_llama3 is not None:
        inv_freq = llama3_scaled(inv_freq, *config.rope_llama3)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float64, device=device)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    """Return RoPE frequencies scaled the Llama 3.1 way.

    Wavelengths shorter than original/high stay; longer than original/low are divided by factor;
    in between, a smooth blend of the two.
    """
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return x [..., heads, D] rotated by (cos, sin) [..., D] (the rotate-half convention of HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class LlamaAttention(nn.Module):
    """Q/K/V/O projections; the attention itself is delegated to the caller's `attend`."""

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False, device=device)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False, device=device)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False, device=device)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False, device=device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_index: int, attend: AttendFn
    ) -> torch.Tensor:
        """Return the attention block's output for x [..., hidden] (before the residual add)."""
        lead = x.shape[:-1]
        q = apply_rope(self.q_proj(x).view(*lead, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        out = attend(layer_index, q, k, v)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the MLP output for x [..., hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, device)
        self.mlp = LlamaMLP(config, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_index: int, attend: AttendFn
    ) -> torch.Tensor:
        """Return the layer's output for the residual stream x [..., hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_index, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (the `model.` prefix of HF names)."""

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """The full decoder with its output projection; `forward_hidden` runs the layers."""

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        self.tie_weights()
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare_rope(self) -> None:
        """Build the RoPE tables on the weights' device and dtype (after the weights are in place)."""
        weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(self.config, weight.device)
        self.rope_cos, self.rope_sin = cos.to(weight.dtype), sin.to(weight.dtype)

    def forward_hidden(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Return the final-normed hidden states [..., hidden] for token_ids at positions."""
        if self.rope_cos is None or self.rope_sin is None:
            self.prepare_rope()
        assert self.rope_cos is not None and self.rope_sin is not None
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.model.embed_tokens(token_ids)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, index, attend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return float32 logits [..., vocab] for final hidden states."""
        return self.lm_head(hidden).float()


def _causal_attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # [B, L, H, D] -> [B, H, L, D]; the whole sequence is recomputed, so a plain causal mask fits.
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


@torch.inference_mode()
def reference_forward(
    model: LlamaForCausalLM, token_ids: torch.Tensor, last_only: bool = False
) -> torch.Tensor:
    """Return float32 logits for every position of token_ids, recomputed from scratch without a cache.

    token_ids is [L] (returns [L, vocab]) or [B, L] of equal-length sequences (returns
    [B, L, vocab]); with last_only, only the last position's logits ([vocab] or [B, vocab]),
    which is what a full-recompute decoder needs per step. This is the correctness reference for
    the paged engine and the baseline of the benchmark.
    """
    batched = token_ids.dim() == 2
    ids = token_ids if batched else token_ids.unsqueeze(0)
    ids = ids.to(model.model.embed_tokens.weight.device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = model.forward_hidden(ids, positions, _causal_attend)
    logits = model.logits(hidden[:, -1] if last_only else hidden)
    return logits if batched else logits[0]
