"""What this CPU offers the kernels: its flags (less those above an `ATEN_CPU_CAPABILITY` cap) and
a description that goes next to every figure and kernel choice, since machines differ."""

from __future__ import annotations

import os
from pathlib import Path

# torch's own CPU kernels can be capped below what the CPU has (ATEN_CPU_CAPABILITY=avx2 or
# default), so that one machine stands in for an older one; ours follow the same cap.
CAPPED_ARCH = {"avx2": "x86-64-v3", "default": "x86-64-v2"}
CPU_CAP = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
_KERNEL_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpu_info(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """All of the CPU's flags, as /proc/cpuinfo lists them (part of the library's build key)."""
    return _cpu_info("flags")


def cpu_features() -> set[str]:
    """The CPU's flags the kernels use, less those above the ATEN_CPU_CAPABILITY cap."""
    flags = set(cpu_flags().split()) & set(_KERNEL_FEATURES)
    if CPU_CAP in CAPPED_ARCH:
        flags = flags & {"avx2"} if CPU_CAP == "avx2" else set()
    return flags


def cpu_description() -> str:
    """The CPU's model name and the features the kernels use, so that figures and kernel
    choices from different machines are never taken as equal."""
    features = ", ".join(f for f in _KERNEL_FEATURES if f in cpu_features()) or "no AVX2"
    capped = f", capped by ATEN_CPU_CAPABILITY={CPU_CAP}" if CPU_CAP in CAPPED_ARCH else ""
    return f"{_cpu_info('model name') or 'unknown CPU'} ({features}{capped})"
