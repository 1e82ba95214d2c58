"""The cache holds code and weights this process loads: it must be private, and processes that
start at once must each get a whole entry, made once."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid

import pytest
from conftest import REAL_CACHE

from paged_backend import cpu
from paged_backend.cpu import library
from paged_backend.file_cache import cache_dir
from paged_backend.gguf.random_checkpoint import write_checkpoint


def test_created_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "fresh"))
    assert stat.S_IMODE(cache_dir().stat().st_mode) == 0o700


def test_a_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(shared))
    with pytest.raises(PermissionError, match="writable by group/others"):
        cache_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the directory away")
def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, -1)
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(theirs))
    with pytest.raises(PermissionError, match="owned by another user"):
        cache_dir()


def _twice_at_once(code: str, cache) -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, PAGED_BACKEND_CACHE=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(600), *p.communicate()) for p in procs]


def test_two_processes_building_the_c_ops_at_once(tmp_path):
    code = "from paged_backend import cpu; assert cpu.load_library(); print('ok')"
    runs = _twice_at_once(code, tmp_path / "cache")
    assert all(r.returncode == 0 and r.stdout.strip() == "ok" for r in runs), runs
    assert sum(r.stderr.count("paged-backend: building the C kernels") for r in runs) == 1
    assert len(list((tmp_path / "cache").glob("cpu_ops-*.so"))) == 1


@pytest.mark.slow
def test_two_processes_converting_one_gguf_at_once(tmp_path):
    gguf = write_checkpoint("tiny", tmp_path, ("q4_0",))[0]  # small: the lock is what is tested
    code = (
        "from paged_backend.model_loader import convert_gguf; from pathlib import Path; "
        f"print(convert_gguf(Path({str(gguf)!r})))"
    )
    runs = _twice_at_once(code, tmp_path / "cache")
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert runs[0].stdout == runs[1].stdout
    assert sum(r.stderr.count("paged-backend: converting") for r in runs) == 1
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1


def test_the_test_session_has_its_own_cache(default_model_path):
    """Tests never write into the user's cache; the default model is still found (linked)."""
    active = cache_dir().resolve()
    assert active != REAL_CACHE.resolve() and not active.is_relative_to(REAL_CACHE.resolve())
    assert default_model_path.parent.parent == cache_dir()  # found through the session cache
    assert (default_model_path / "model.safetensors").is_file()


def _names(root) -> set[str]:
    return set(os.listdir(root)) if root.is_dir() else set()


def test_a_kernel_build_lands_in_the_session_cache_only(monkeypatch):
    """A build no other run makes (its flags hold a fresh token) appears in the active cache
    and not in the real one."""
    real_before, active_before = _names(REAL_CACHE), _names(cache_dir())
    token = uuid.uuid4().hex
    monkeypatch.setattr(library, "FLAGS", [*library.FLAGS, "-O0", f"-DCACHE_TEST_{token}"])
    cpu.load_library.cache_clear()
    try:
        assert cpu.available()
    finally:
        cpu.load_library.cache_clear()
    built = {n for n in _names(cache_dir()) - active_before if n.startswith("cpu_ops-")}
    assert built, "the build wrote nothing into the active cache"
    assert not built & (_names(REAL_CACHE) - real_before)
