"""Find the model a user named, convert GGUF files once, and load safetensors into our modules.

Weights come only from `*.safetensors` (never pickle) and no remote code is run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from paged_backend.default_model import NAME as DEFAULT_MODEL_NAME
from paged_backend.default_model import default_model_file, file_sha256
from paged_backend.file_cache import cache_dir, locked, notice
from paged_backend.models.config import ModelConfig
from paged_backend.models.llama import param_shard

# In a GGUF file's directory of configuration and tokenizer: the file its weights are read from.
GGUF_WEIGHTS = "gguf_weights.json"
CONVERTED_FROM = "paged_backend_source.json"  # in a `convert_gguf` directory: its GGUF file
# What a model directory needs from a hub repository: no pickle weights, no GGUF variants.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """Return a Hugging Face style directory (config.json, tokenizer, *.safetensors) for a
    local directory, a .gguf file, a hub id ("org/name", at `revision`: a branch, tag or
    commit) or a GGUF file in a hub repository ("org/name/file.gguf"). A GGUF file's directory
    has no weights: they stay in the file (`gguf_weights_file`), but for the embedded default
    model's, whose dequantized copy its tuned bf16 path runs."""
    if model is None:
        return convert_gguf(default_model_file())
    path = Path(model).expanduser()
    hub = _hub_ref(model)
    if hub is not None:
        path = snapshot_from_hub(*hub, revision=revision)
    elif revision is not None:
        raise ValueError(
            f"revision applies to hub ids ('org/name'), not to the local path {str(model)!r}"
        )
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist; expected a Hugging Face model directory, "
            "a .gguf file or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        return gguf_model_dir(path)
    ModelConfig.from_dir(path)  # a missing config or unsupported architecture is named first
    if not any(path.glob("*.safetensors")) and gguf_weights_file(path) is None:
        raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
    return path


def model_name(model: str | Path | None) -> str:
    """The name users know a model by: the default model's, a hub id, or the file's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    return str(model) if _hub_ref(model) else Path(model).expanduser().name


def _hub_ref(model: str | Path) -> tuple[str, str | None] | None:
    """(repository id, GGUF file name or None) when `model` names a hub repository ("org/name")
    or a GGUF file in one ("org/name/file.gguf") and no such local path exists; else None."""
    name = str(model)
    parts = name.split("/")
    if not all(parts) or name.startswith((".", "~")) or Path(name).expanduser().exists():
        return None
    if len(parts) == 2:
        return name, None
    if len(parts) == 3 and parts[2].endswith(".gguf"):
        return "/".join(parts[:2]), parts[2]
    return None


def snapshot_from_hub(
    repo_id: str, filename: str | None = None, *, revision: str | None = None
) -> Path:
    """A hub repository's model directory (or its GGUF file `filename`), resolved as
    transformers resolves it: the local Hugging Face cache first, a download only where one is
    allowed (not under `HF_HUB_OFFLINE=1`) and a network exists."""
    from huggingface_hub import hf_hub_download, snapshot_download

    def fetch(**kwargs) -> Path:
        if filename is not None:
            return Path(hf_hub_download(repo_id, filename, revision=revision, **kwargs))
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, **kwargs)
        )

    what = repo_id + (f"/{filename}" if filename else "") + (f"@{revision}" if revision else "")
    try:
        return fetch(local_files_only=True)
    except Exception as exc:  # not cached (or a partial cache): name why below
        cache_miss = exc
    how = (
        f"download it where a network exists (`hf download {repo_id}"
        + (f" {filename}" if filename else "")
        + (f" --revision {revision}" if revision else "")
        + "`, into the same HF_HOME cache) or pass a local path"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise FileNotFoundError(
            f"model {what!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
            f"set ({type(cache_miss).__name__}); {how}"
        )
    notice(f"downloading {what} from the Hugging Face hub")
    try:
        return fetch()
    except Exception as exc:
        raise FileNotFoundError(
            f"model {what!r} is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(exc).__name__}: {exc}); {how}"
        ) from exc


def gguf_model_dir(path: Path) -> Path:
    """A cached directory with the configuration and tokenizer of GGUF file `path`, written
    once (keyed by the file's path, size and time: hashing a multi-GB file took seconds a
    start), and `GGUF_WEIGHTS` naming the file."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir() / "gguf" / f"{path.stem}-config-{key.hexdigest()[:24]}"
    if not _gguf_dir_complete(target):
        with locked(target.name):
            if not _gguf_dir_complete(target):  # written by another process while we waited?
                _write_gguf_dir(path, target, weights=False)
    return target


def _gguf_dir_complete(target: Path) -> bool:
    """Whether `target` holds all a `gguf_model_dir` has now (not one an older version wrote)."""
    try:
        return "tensors" in json.loads((target / GGUF_WEIGHTS).read_text())
    except (OSError, ValueError):
        return False


def gguf_source(model_dir: Path) -> dict | None:
    """What a `gguf_model_dir` knows of its GGUF file: "gguf" (its path), "architecture"
    (general.architecture) and "tensors" (`paged_backend.gguf.weights.tensor_table`); None for
    other directories."""
    marker = Path(model_dir) / GGUF_WEIGHTS
    return json.loads(marker.read_text()) if marker.is_file() else None


def gguf_weights_file(model_dir: Path) -> Path | None:
    """The GGUF file whose weights a `gguf_model_dir` stands for; None for other directories."""
    source = gguf_source(model_dir)
    return None if source is None else Path(source["gguf"])


def converted_from(model_dir: Path) -> dict | None:
    """For a `convert_gguf` directory whose GGUF file is still in place: `gguf_source` of that
    file (its path, architecture and tensor table); None for other directories."""
    marker = Path(model_dir) / CONVERTED_FROM
    if not marker.is_file():
        return None
    path = Path(json.loads(marker.read_text())["gguf"])
    return gguf_source(gguf_model_dir(path)) if path.is_file() else None


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file through transformers' loader into a cached fp32 HF directory
    (once: concurrent first starts wait for one conversion)."""
    target = cache_dir() / "gguf" / f"{path.stem}-{file_sha256(path)[:24]}"
    if not (target / "model.safetensors").is_file():
        with locked(target.name):
            if not (target / "model.safetensors").is_file():
                _write_gguf_dir(path, target, weights=True)
    return target


def _write_gguf_dir(path: Path, target: Path, weights: bool) -> None:
    """Write GGUF file `path`'s configuration and tokenizer (read by transformers' GGUF loader)
    into `target`, with its weights dequantized to fp32 safetensors where `weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from paged_backend.gguf.weights import apply_config_fixes, read_gguf_faster, read_metadata

    read_gguf_faster()
    what = "converting" if weights else "reading the configuration and tokenizer of"
    notice(f"{what} {path.name} once into {target}" + (" (under a minute)" if weights else ""))
    target.parent.mkdir(mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp_dir:
        tmp = Path(tmp_dir) / target.name
        try:
            kwargs = {"gguf_file": path.name}
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
            config = AutoConfig.from_pretrained(path.parent, **kwargs)
            arch, fixes, tensors = read_metadata(path)
            apply_config_fixes(config, fixes)
            model = weights and AutoModelForCausalLM.from_pretrained(
                path.parent, config=config, dtype=torch.float32, **kwargs
            )
        except Exception as exc:
            raise ValueError(f"could not read GGUF file {path}: {exc}") from exc
        # The GGUF quantizer config makes save_pretrained refuse: rebuild a plain model instead.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if weights:
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(model.state_dict())
            plain.save_pretrained(tmp)
            (tmp / CONVERTED_FROM).write_text(json.dumps({"gguf": str(path)}))
        else:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            tmp.mkdir()
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
            config.save_pretrained(tmp)
            marker = {"gguf": str(path.absolute()), "architecture": arch, "tensors": tensors}
            (tmp / GGUF_WEIGHTS).write_text(json.dumps(marker))
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)  # a partial directory from an older version
        tmp.rename(target)  # atomic: readers see the whole directory or none


def load_safetensors(
    module: torch.nn.Module, path: Path, rename, elsewhere: frozenset[str] = frozenset()
) -> None:
    """Copy every tensor of `path/*.safetensors` into `module` through `rename`.

    `rename(name)` maps a checkpoint name to (parameter name, shard index or None, shard sizes)
    so fused projections (qkv, gate_up) are filled piece by piece; None skips the tensor.
    `elsewhere`: parameters another reader fills (an int4 checkpoint's linears).
    """
    params = dict(module.named_parameters())
    loaded_numel = dict.fromkeys(params, 0)
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(file, framework="pt") as f, file.open("rb", buffering=0) as raw:
                offsets = _data_offsets(raw)
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    target = rename(name)
                    if target is None:
                        continue
                    param_name, shard, sizes = target
                    if param_name not in params:
                        raise ValueError(f"{file}: unexpected weight {name!r}")
                    data = param_shard(params[param_name].data, shard, sizes)
                    stored = f.get_slice(name)
                    if list(data.shape) != stored.get_shape():
                        raise ValueError(
                            f"{file}: weight {name!r} has shape {tuple(stored.get_shape())}, "
                            f"expected {tuple(data.shape)}"
                        )
                    if _readable_into(data, stored.get_dtype()):
                        _read_into(data, raw, offsets[name], file)
                    else:
                        data.copy_(f.get_tensor(name))
                    loaded_numel[param_name] += data.numel()
        except SafetensorError as exc:
            raise ValueError(f"corrupt weight file {file}: {exc}") from exc
    # A fused parameter counts as loaded only when every shard arrived.
    missing = [n for n, p in params.items() if loaded_numel[n] != p.numel() and n not in elsewhere]
    if missing:
        raise ValueError(f"weights missing from {path}: {missing[:5]}")


def stored_dtypes(path: Path) -> set[torch.dtype | str]:
    """The dtypes the tensors of `path/*.safetensors` are stored in (from their headers; a name
    safetensors gives for one torch does not read straight is kept as that name)."""
    found: set[torch.dtype | str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                stored = f.get_slice(name).get_dtype()
                found.add(_DTYPES.get(stored, stored))
    return found


# safetensors dtype names, of the tensors read straight into a parameter of the same dtype
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _readable_into(data: torch.Tensor, stored_dtype: str) -> bool:
    """Whether a tensor stored as `stored_dtype` can be read straight into `data`."""
    same = _DTYPES.get(stored_dtype) == data.dtype
    return same and data.device.type == "cpu" and data.is_contiguous()


def _data_offsets(raw) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file (its header, which `safe_open`
    has validated: an 8-byte length, then JSON with each tensor's `data_offsets`)."""
    length = int.from_bytes(raw.read(8), "little")
    header = json.loads(raw.read(length))
    header.pop("__metadata__", None)
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items()}


def _read_into(data: torch.Tensor, raw, offset: int, file: Path) -> None:
    """Read a tensor's bytes from the file straight into `data` (contiguous, of its dtype):
    copying them out of safetensors' memory map, page fault by page fault, took 2-4x as long
    (the default model's 538 MB: 0.9-1.8 s against 0.3-0.7 s on a 2-core VM)."""
    view = memoryview(data.view(-1).view(torch.uint8).numpy())
    raw.seek(offset)
    done = 0
    while done < len(view):
        count = raw.readinto(view[done:])
        if not count:
            raise ValueError(f"{file} ends inside a weight: was it changed while loading?")
        done += count
