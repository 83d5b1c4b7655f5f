"""Load a Hugging Face-style Llama directory: config.json, *.safetensors, tokenizer.json.

The directory's serving facts (EOS ids, BOS, tokenizer and its special tokens, generation defaults,
chat template) are read by sluice.model_spec.load_model_spec, the same reader admission uses, so the
worker and admission agree on them; this module adds the architecture and the weights.

Every problem a caller can cause (a missing directory or file, another architecture, a missing,
unexpected or misshapen tensor, an unsupported dtype) raises ModelLoadError naming the file or
tensor, what was expected and what was found. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sluice.model_spec import ModelSpec, load_model_spec, read_json
from sluice.tokenizer import TextTokenizer
from worker_svc.engine.config import LlamaConfig
from worker_svc.engine.errors import ModelLoadError
from worker_svc.engine.model import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer and where it came from."""

    model: LlamaForCausalLM
    config: LlamaConfig
    tokenizer: TextTokenizer
    device: torch.device
    dtype: torch.dtype
    model_dir: Path
    spec: ModelSpec
    """What admission reads from the same directory (EOS ids, generation defaults, chat template)."""


def resolve_device(device: str) -> torch.device:
    """Return the torch device for "cpu", "cuda", "cuda:N" or "auto" (cuda when available).

    Raises ModelLoadError for an unknown name or cuda without a CUDA device.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but torch sees no CUDA device")
        return torch.device(device)
    raise ModelLoadError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Return the compute dtype for a name or "auto" (bfloat16 on cuda, float32 on cpu).

    Raises ModelLoadError for a name outside float32, bfloat16, float16, auto.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)} or auto")
    return DTYPES[dtype]


def load_config(model_dir: Path) -> LlamaConfig:
    """Return the Llama configuration of model_dir; raises ModelLoadError when absent or unsupported."""
    path = model_dir / "config.json"
    try:
        raw = read_json(path, required=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read config.json: {exc}") from None
    return LlamaConfig.from_hf_dict(raw, str(path))


def load_spec(model_dir: Path) -> ModelSpec:
    """Return the ModelSpec of model_dir; raises ModelLoadError naming the file that is absent or malformed."""
    try:
        return load_model_spec(model_dir, model_dir.name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(str(exc)) from None


def weight_files(model_dir: Path) -> list[Path]:
    """Return the safetensors files of model_dir (from the index when there is one).

    Raises ModelLoadError when there are none or the index names a file that is missing.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: cannot read weight_map: {exc}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names weight files that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files found")
    return files


def read_tensors(files: list[Path], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Return every tensor of files, converted to dtype on device.

    Raises ModelLoadError for a tensor stored in an unsupported dtype or present in two files.
    """
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    stored = handle.get_slice(name).get_dtype()
                    if stored not in FILE_DTYPES:
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} has unsupported dtype {stored} "
                            f"(supported: {sorted(FILE_DTYPES)})"
                        )
                    if name in tensors:
                        raise ModelLoadError(f"{path}: tensor {name!r} also appears in another weight file")
                    tensors[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file: {exc}") from None
    return tensors


def check_tensors(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ModelLoadError unless tensors has exactly the model's parameters with their shapes.

    With tied embeddings, `lm_head.weight` may be absent (it is the embedding) or present; a
    present one is ignored because the tied model has no separate matrix to put it in.
    """
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"missing tensors: {missing}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelLoadError(f"unexpected tensors: {unexpected}")
    for name, shape in expected.items():
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {list(found)}, expected {list(shape)}")


def load_model(model_dir: str | Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Return the model, tokenizer and config of a Hugging Face-style Llama directory.

    Raises ModelLoadError for anything wrong with the directory, its files or the options.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    spec = load_spec(root)
    config = load_config(root)
    bos = config.bos_token_id if spec.bos_token_id is None else spec.bos_token_id
    config = dataclasses.replace(config, eos_token_id=spec.eos_token_id, bos_token_id=bos)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = read_tensors(weight_files(root), torch_dtype, torch_device)
    check_tensors(model, tensors)
    model.load_state_dict(tensors, strict=not config.tie_word_embeddings, assign=True)
    model.tie_weights()
    model.eval().requires_grad_(False)
    model.prepare_rope()
    return LoadedModel(model, config, spec.tokenizer, torch_device, torch_dtype, root, spec)
