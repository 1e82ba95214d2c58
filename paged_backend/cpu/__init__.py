"""Everything that runs in the C library on CPU: CPU feature detection (`features`), building,
caching and binding the library (`library`, its source in `csrc/`), the typed op wrappers
(`ops`), the bf16/fp16/int4 linears that use them (`linear`), the timed choice between the C GEMM
and oneDNN (`kernel_choice`) and the KV cache's huge-page memory (`memory`). A new CPU kernel goes
into `csrc/cpu_ops.c` with its wrapper in `ops.py`."""

from paged_backend.cpu.features import cpu_description, cpu_features
from paged_backend.cpu.library import available, has_bf16_kernels, load_library

__all__ = ["available", "cpu_description", "cpu_features", "has_bf16_kernels", "load_library"]
