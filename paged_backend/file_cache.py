"""The on-disk cache (converted models, the compiled C ops): where it lives, who may write to
it, a lock for processes that fill it at once, and the `paged-backend:` status lines on stderr
(the slow first-time work that fills it, so a first start does not look hung).

What is in the cache gets loaded into this process (a shared library, model weights), so the
directory must be ours alone: it is created owner-only and refused if another user owns it or
others may write to it (anyone who can write there could run code in our process)."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_path() -> Path:
    """`$PAGED_BACKEND_CACHE`, else `~/.cache/paged_backend`: where the cache is, untouched."""
    return Path(os.environ.get("PAGED_BACKEND_CACHE") or Path.home() / ".cache" / "paged_backend")


def cache_dir() -> Path:
    """`cache_path()`, created with mode 0700 and checked to be ours alone."""
    root = cache_path()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"cache directory {root} is owned by another user or writable by group/others; "
            "its files are loaded as code and weights, so it must be private: chmod 700 it "
            "or set PAGED_BACKEND_CACHE to a directory of your own"
        )
    return root


@contextmanager
def locked(name: str) -> Iterator[None]:
    """Hold an exclusive lock, across processes, while filling the cache entry `name`. Fillers
    check for the entry again once they hold it (another process may have just made it) and
    move it into place with an atomic rename, so a reader never sees half of one."""
    with open(cache_dir() / f".{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def installed_stamp(package: str) -> str:
    """Where an installed package lives and when it was installed there: what a cache entry
    derived from its behaviour depends on (found without importing it)."""
    origin = importlib.util.find_spec(package).origin
    return f"{origin} {Path(origin).stat().st_mtime_ns}"


def read_checked(path: Path) -> bytes | None:
    """What `write_checked` stored at `path`; None where there is no such file or its content no
    longer matches the digest stored with it (cut short, overwritten): the caller rebuilds it
    rather than trust it."""
    try:
        digest, _, data = path.read_bytes().partition(b"\n")
    except OSError:
        return None
    return data if digest == hashlib.sha256(data).hexdigest().encode() else None


def write_checked(path: Path, data: bytes) -> None:
    """Store `data` at `path` (under `cache_dir()`) after its sha256, atomically: a reader sees
    the whole file or none, and `read_checked` refuses one that changed afterwards."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(hashlib.sha256(data).hexdigest().encode() + b"\n" + data)
    os.replace(tmp, path)


_shown: set[str] = set()  # the `once` keys of the notices this process printed


def notice(message: str, *, once: str | None = None) -> None:
    """Tell the user about work that takes seconds to minutes, or a condition worth knowing. A
    notice with a `once` key prints once per process: each engine start in it would meet the
    condition again, and a repeated line says nothing new."""
    if once is not None:
        if once in _shown:
            return
        _shown.add(once)
    print(f"paged-backend: {message}", file=sys.stderr, flush=True)
