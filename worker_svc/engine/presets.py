"""Built-in model presets: deterministic random-weight Llama models with a byte-level tokenizer.

`write_preset(dir, "tiny")` writes config.json, generation_config.json, model.safetensors,
tokenizer.json and tokenizer_config.json (special tokens, no BOS added to prompts, and a Zephyr-style
chat template so a demo can chat) that the loader reads like any Hugging Face Llama directory. Weights come from a fixed seed and are scaled
so that every block's output has unit size, the embedding is small next to it (the prediction
depends on the context, not only on the last token) and the logits spread over a few units.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from sluice.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_tokenizer
from worker_svc.engine.config import LlamaConfig
from worker_svc.engine.model import LlamaForCausalLM
from worker_svc.engine.preset_configs import BYTE_VOCAB, PRESETS

__all__ = ["BYTE_VOCAB", "CHAT_TEMPLATE", "DEFAULT_SEED", "PRESETS", "preset_config", "random_weights", "write_json",
           "write_preset"]

LOGIT_SCALE = 2.0
"""Standard deviation the output logits aim at."""
EMBED_STD = 0.1
"""Small next to the unit-size outputs of the attention and MLP blocks, so the prediction depends
on the context (with std 1 the residual stream is dominated by the current token's embedding and
the model degenerates into a bigram table: 3 distinct greedy tokens over 64 random contexts for
the tiny preset, against about 50 with 0.1)."""

DEFAULT_SEED = 0
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The presets' chat template (Zephyr's layout): each turn is `<|role|>`, a newline, the text, `</s>`."""


def preset_config(name: str) -> LlamaConfig:
    """Return the configuration of a preset; raises ValueError listing the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]


def random_weights(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Return deterministic random weights for config (HF names; tied lm_head omitted)."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            # with tied embeddings the final norm sets the logit scale (the embedding has std 1)
            tied_final = name == "model.norm.weight" and config.tie_word_embeddings
            value = LOGIT_SCALE / (EMBED_STD * math.sqrt(config.hidden_size)) if tied_final else 1.0
            weights[name] = torch.full(shape, value)
            continue
        std = EMBED_STD if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(shape[1])
        if name == "lm_head.weight":
            std = LOGIT_SCALE / math.sqrt(shape[1])
        weights[name] = torch.randn(shape, generator=generator) * std
    return weights


def write_preset(target: str | Path, name: str, seed: int = DEFAULT_SEED) -> Path:
    """Write preset `name` into directory target (created if needed) and return its path.

    Raises ValueError for an unknown preset.
    """
    config = preset_config(name)
    root = Path(target)
    root.mkdir(parents=True, exist_ok=True)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.torch_dtype]
    weights = {k: v.to(dtype).contiguous() for k, v in random_weights(config, seed).items()}
    # a single metadata key: safetensors writes its map in hash order, and the bytes should not vary
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict() | {"sluice_preset": name, "sluice_seed": seed}
    write_json(root / "config.json", hf)
    build_byte_tokenizer().save(str(root / "tokenizer.json"))
    write_json(root / "generation_config.json",
               {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    write_json(root / "tokenizer_config.json", {
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE, "model_max_length": config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    return root


def write_json(path: Path, content: dict[str, object]) -> None:
    """Write content as indented JSON with sorted keys (the same bytes every time)."""
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
