"""The KV cache's memory: zero pages that are committed as they are first used, on 2 MiB pages
where Linux allows once the cache is well used; and how much of a set of tensors is resident."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap

import numpy as np
import torch

_HUGE_PAGE = 2 << 20
_TRIM_BYTES = 32 << 20  # `move_to_huge_pages_` hands freed heap pages back this often
_COPY_BYTES = 16 << 20  # and copies a storage in parts of this size


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, advise: bool = True
) -> torch.Tensor:
    """A zero CPU tensor in a private anonymous mapping of its own, starting on a 2 MiB
    boundary. The kernel hands out such pages zeroed at their first touch, so nothing is written
    or committed here: zeroing a 2 GiB cache took ~4 s of every engine start, and kept all of it
    resident whatever the process used.

    With `advise`, the kernel is asked (madvise, before the first touch) to back it with 2 MiB
    pages, where transparent huge pages allow it (`madvise` mode is a common default); else later,
    by `advise_huge_pages`. A busy KV cache needs them: a decode step reads each sequence's
    blocks, a few hundred bytes each, from all over the cache, and on 4 KiB pages nearly every
    block read missed the TLB. But a first touch then commits 2 MiB, and the cache is one region
    per layer, K or V and KV head: the first token of a 1B Llama committed 512 MiB."""
    size = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX system
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive as long as it lives
    start = -raw.data_ptr() % _HUGE_PAGE  # the mapping's first 2 MiB boundary
    tensor = raw[start : start + size].view(dtype).view(shape)
    if advise:
        advise_huge_pages([tensor])
    return tensor


def advise_huge_pages(tensors: list[torch.Tensor]) -> bool:
    """Ask for 2 MiB pages, from now on, behind the memory that `tensors` span (views of one
    `zeros_on_huge_pages` tensor; pages touched before may be merged by the kernel later). False
    where Linux offers no such advice."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    start = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    start -= start % mmap.PAGESIZE
    if advice is None or end <= start:
        return False
    madvise = _libc("madvise", ctypes.c_int)
    if madvise is None:
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0


def move_to_huge_pages_(tensors) -> int:
    """Copy the storages behind `tensors` (each once) into one `zeros_on_huge_pages` region and
    point every one of `tensors` that views them there, in place (`Tensor.set_`); returns the
    bytes moved. Each storage is freed once nothing else holds it, before the next is copied,
    and the pages of one in a file mapping (a GGUF file's blocks) leave the process's resident
    set as each `_COPY_BYTES` of it are copied (freed heap pages every `_TRIM_BYTES`), so the
    peak stays near the weights' size: whole, Gemma 3's 262,144-token embedding (~140 MB) was
    held twice, +110 MB at the loading peak.

    Why: a one-row step streams every weight from memory, and on 4 KiB pages this VM read
    18-20 GB/s on one thread and ~29 on two, against 31-32 and ~35 on 2 MiB pages (torch's
    allocator and a file mapping give 4 KiB pages; a page walk is costly under
    virtualization). Anything holding a moved tensor's address (a table of pointers) must be
    rebuilt afterwards."""
    by_storage: dict[int, tuple[torch.UntypedStorage, dict[int, torch.Tensor]]] = {}
    for tensor in tensors:
        if tensor.device.type == "cpu" and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            views = by_storage.setdefault(storage.data_ptr(), (storage, {}))[1]
            # a view keeps the tensor it was made from (`_base`), and that its storage
            for view in (tensor, tensor._base) if tensor._base is not None else (tensor,):
                views[id(view)] = view
    starts, total = {}, 0
    for key, (storage, _) in by_storage.items():
        starts[key] = total
        total += -(-storage.nbytes() // mmap.PAGESIZE) * mmap.PAGESIZE
    if not total:
        return 0
    region = zeros_on_huge_pages((total,), torch.uint8)
    target, files, freed = region.untyped_storage(), _file_mappings(), 0
    for key in list(by_storage):
        storage, views = by_storage.pop(key)
        size, start = storage.nbytes(), region.storage_offset() + starts[key]
        source = torch.empty(0, dtype=torch.uint8).set_(storage)
        in_file = _within(key, size, files)
        for at in range(0, size, _COPY_BYTES):  # a file's pages leave as each part is copied
            part = min(_COPY_BYTES, size - at)
            region[starts[key] + at : starts[key] + at + part].copy_(source[at : at + part])
            if in_file:
                _drop_pages(key + at, part)
        with torch.no_grad():
            for view in views.values():
                offset = start + view.storage_offset() * view.element_size()
                view.set_(target, offset // view.element_size(), view.size(), view.stride())
        if in_file:  # and the pages that straddle two parts
            _drop_pages(key, size)
        del storage, views, source
        freed += size
        if freed >= _TRIM_BYTES:  # freed heap pages go back now, not after the last copy
            release_freed_heap()
            freed = 0
    return total


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (Linux's /proc/self/maps; none
    elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0":  # an inode: a file's pages
            low, high = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def release_file_pages(array: np.ndarray) -> None:
    """Take the whole pages of `array`, where it lies in a file mapping (a GGUF tensor read
    once and converted), out of the resident set; nothing for memory of any other kind."""
    address, size = array.ctypes.data, array.nbytes
    if _within(address, size, _file_mappings()):
        _drop_pages(address, size)


def _within(address: int, size: int, mappings: list[tuple[int, int]]) -> bool:
    """Whether [address, address + size) lies in one of `mappings` (`_file_mappings`)."""
    return any(low <= address and address + size <= high for low, high in mappings)


def _drop_pages(address: int, size: int) -> None:
    """Take the whole pages of [address, address + size), a file's mapped bytes the process no
    longer reads, out of its resident set (they are read from the file again if touched)."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    madvise = _libc("madvise", ctypes.c_int)
    first = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if advice is not None and madvise is not None and end > first:
        madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), advice)


def huge_page_tokens(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Tokens a block-major KV cache holds when each of its regions (a layer's K or V) would
    fill a 2 MiB page. Past it, each region committed on huge pages holds less than one page
    more than its tokens need."""
    return _HUGE_PAGE // (kv_heads * head_dim * dtype.itemsize)


def resident_bytes(tensors) -> tuple[int, int]:
    """(bytes, of them resident in memory) of the storages behind `tensors`, each counted once:
    resident pages are asked of the kernel (mincore), since a memory-mapped weight or a KV cache
    committed on first touch holds far less than its size. Where mincore is not available, all
    bytes count as resident."""
    storages, opaque = {}, 0
    for tensor in tensors:
        if tensor.layout != torch.strided:  # oneDNN's packed weights: no pages to ask about
            opaque += tensor.numel() * tensor.element_size()
        elif tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    total = sum(storages.values()) + opaque
    mincore = _libc("mincore", ctypes.c_void_p)
    if mincore is None:
        return total, total
    page = mmap.PAGESIZE
    resident = opaque
    for start, size in storages.items():
        first = start - start % page
        pages = -(-(start + size - first) // page)
        vec = (ctypes.c_ubyte * pages)()
        if size and mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), vec) == 0:
            in_memory = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
            resident += min(in_memory, size)
        else:
            resident += size
    return total, resident


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing):
    loading a model frees much of what it allocated (a tokenizer's JSON, a GGUF file's
    metadata, weight conversions), and glibc keeps freed pages below the heap's top resident:
    ~85 MB after loading a 262,144-token vocabulary, which every later peak then included."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


@functools.cache
def _libc(name: str, third: type):
    """libc's `name`(void *addr, size_t length, `third`), or None where there is none."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, third]
    return function
