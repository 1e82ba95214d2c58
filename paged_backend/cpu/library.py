"""The C library (every `csrc/*.c`, one file per family of kernels): built at first use with the
system C compiler (`CC`, else `cc`/`gcc`) into the cache directory, keyed by source, flags and
CPU, and loaded once. Without a compiler the engine keeps torch ops.

Its functions are called by keyword only. The names and C types of each function's parameters
are read from its definition in the source, so a call names every parameter, the arguments go
to C in the source's order whatever order the call lists them in, and a missing, misspelt or
extra name raises: with ~30 arguments a call, positional groups stayed right only while they
matched the C order by hand.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from paged_backend.cpu.features import CAPPED_ARCH, CPU_CAP, cpu_flags
from paged_backend.file_cache import cache_dir, locked, notice

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).with_name("csrc").glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).with_name("csrc").glob("*.h")))  # in the build's key
FLAGS = ["-O3", f"-march={CAPPED_ARCH.get(CPU_CAP, 'native')}", "-shared", "-fPIC"]
# Where torch runs on OpenMP (libgomp on Linux), the kernels build with it too: the loader then
# reuses torch's already-loaded libgomp.so.1, so their parallel loops run on torch's thread pool,
# whose threads are still spinning from the last torch op, instead of a second pool fighting it.
OPENMP_FLAGS = ["-fopenmp"] if torch.backends.openmp.is_available() else []
_C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
# An exported definition: at the start of a line, `void` or `int`, then its parameter list.
_DEFINITION = re.compile(r"^(void|int) (\w+)\(([^)]*)\)\s*\{", re.M)


def prototypes(source: str) -> dict[str, tuple[type | None, tuple[tuple[str, type], ...]]]:
    """Each exported function of the C source: (its ctypes return type, or None for void, and
    its parameters' names and ctypes types). Any pointer is a `c_void_p`."""
    found = {}
    for result, name, params in _DEFINITION.findall(source):
        typed = []
        for param in params.split(",") if params.strip() != "void" else ():
            words = param.replace("*", " * ").split()
            ctype = ctypes.c_void_p if "*" in words else _C_TYPES[words[-2]]
            typed.append((words[-1], ctype))
        found[name] = (_C_TYPES.get(result), tuple(typed))
    return found


class CLibrary:
    """The loaded library; `lib.name(param=value, ...)` calls C function `name` with every
    parameter named (see the module docstring). `has(name)` says whether this build has it
    (the AVX512-BF16 kernels exist only where the compiler targets them)."""

    def __init__(self, dll: ctypes.CDLL, source: str) -> None:
        self._dll = dll
        self.path = dll._name
        self._calls: dict[str, Callable] = {}
        for name, (result, params) in prototypes(source).items():
            if hasattr(dll, name):
                self._calls[name] = self._bind(getattr(dll, name), name, result, params)

    @staticmethod
    def _bind(fn, name: str, result, params: tuple[tuple[str, type], ...]) -> Callable:
        fn.argtypes = [ctype for _, ctype in params]
        fn.restype = result
        names = tuple(n for n, _ in params)

        def call(**kwargs):
            if len(kwargs) != len(names) or not kwargs.keys() <= set(names):
                missing = sorted(set(names) - kwargs.keys())
                extra = sorted(kwargs.keys() - set(names))
                raise TypeError(f"{name}: missing arguments {missing}, unknown {extra}")
            return fn(*[kwargs[n] for n in names])

        return call

    def has(self, name: str) -> bool:
        return name in self._calls

    def __getattr__(self, name: str) -> Callable:
        try:
            return self._calls[name]
        except KeyError:
            raise AttributeError(f"the C library has no function {name!r}") from None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load_library() -> CLibrary | None:
    """The compiled ops, built on first use; None (and a warning) where that fails."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU ops stay in torch")
        return None
    source = "\n".join(path.read_text() for path in SOURCES)
    dll = _build(compiler, FLAGS + OPENMP_FLAGS) or (OPENMP_FLAGS and _build(compiler, FLAGS))
    return CLibrary(dll, source) if dll else None


def available() -> bool:
    return load_library() is not None


def has_bf16_kernels() -> bool:
    """Whether the library built the AVX512-BF16 kernels (GEMM, prefix and prefill attention,
    the fused decode step)."""
    lib = load_library()
    return lib is not None and bool(lib.has_bf16_kernels())


def _build(compiler: str, flags: list[str]) -> ctypes.CDLL | None:
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([compiler, *flags, cpu_flags()]).encode()).hexdigest()
    try:
        path = cache_dir() / f"cpu_ops-{key[:16]}.so"
        if not path.exists():
            with locked(path.name):
                if not path.exists():  # not built by another process while we waited
                    _compile(compiler, flags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("building %s with %s failed: %s %s", SOURCES, flags, exc, detail)
        return None


def _compile(compiler: str, flags: list[str], path: Path) -> None:
    notice(f"building the C kernels once into {path} (a few seconds)")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        command = [compiler, *flags, "-o", str(built), *map(str, SOURCES), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(built, path)  # atomic: a reader never loads half a library
