"""The torch engine: a Llama-architecture decoder with a paged KV cache that executes RoundPlans.

Modules: `config` (model configuration), `model` (the decoder and the full-recompute reference),
`kv_cache` (device and host block pools), `attention` (paged attention), `batch` (a plan turned
into flat tensors), `sampler` (token choice and stop strings), `tokenizer`, `loader`, `presets`.
"""
