"""The built-in presets' configurations, without torch: what `worker_svc.gpu_profiles` reads for model shapes.

`worker_svc.engine.presets` (which needs torch) writes these presets as model directories and re-exports the
table; the simulator and the CLI's flag choices import only this module, so they start without importing torch.
"""

from __future__ import annotations

from worker_svc.engine.config import LlamaConfig

BYTE_VOCAB = 258
"""256 byte tokens, then <s> (256) and </s> (257)."""
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        torch_dtype="float32",
    ),
    # ~100M parameters; the vocabulary is padded to 32000, ids past the tokenizer are never sampled.
    "small-100m": LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=257,
        torch_dtype="bfloat16",
    ),
}
