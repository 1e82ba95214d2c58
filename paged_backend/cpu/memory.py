"""The KV cache's memory: zero pages that are committed as they are first used, on 2 MiB pages
where Linux allows."""

from __future__ import annotations

import math
import mmap

import torch

_HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in a private anonymous mapping of its own. The kernel hands out such
    pages zeroed at their first touch, so nothing is written or committed here: zeroing a 2 GiB
    cache took ~4 s of every engine start, and kept all of it resident whatever the process used.

    The kernel is asked (madvise, before the first touch) to back it with 2 MiB pages, where
    transparent huge pages allow it (`madvise` mode is a common default). The KV cache needs
    them: a decode step reads each sequence's blocks, a few hundred bytes each, from all over the
    cache, and on 4 KiB pages nearly every block read missed the TLB."""
    size = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX system
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive as long as it lives
    start = -raw.data_ptr() % _HUGE_PAGE  # the mapping's first 2 MiB boundary
    if hasattr(mmap, "MADV_HUGEPAGE") and size:
        buf.madvise(mmap.MADV_HUGEPAGE, start, size)
    return raw[start : start + size].view(dtype).view(shape)
