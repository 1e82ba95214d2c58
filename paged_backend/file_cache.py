"""The on-disk cache (converted models, the compiled C ops): where it lives, and a line on
stderr for the slow first-time work that fills it, so a first start does not look hung."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """`$PAGED_BACKEND_CACHE`, else `~/.cache/paged_backend`."""
    root = os.environ.get("PAGED_BACKEND_CACHE") or Path.home() / ".cache" / "paged_backend"
    return Path(root)


def notice(message: str) -> None:
    """Tell the user about work that takes seconds to minutes and happens once."""
    print(f"paged-backend: {message}", file=sys.stderr, flush=True)
