"""What this machine's CPU can do, read once from /proc/cpuinfo.

The CPU differs from one machine to the next (AVX2 only; AVX-512; AVX-512 with BF16;
AMX), and the fast library paths are not the same on each: oneDNN's bfloat16 GEMM, for
one, refuses to build a kernel on a CPU without AVX-512 BF16 or AMX. The compute plan
(``compute.py``) reads these flags instead of assuming an instruction set.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    line: str = ""  # the raw flags line (a cache key for compiled kernels)

    @classmethod
    def parse(cls, cpuinfo: str) -> "CpuFeatures":
        for line in cpuinfo.splitlines():
            if line.startswith(("flags", "Features")):  # x86, ARM
                return cls(frozenset(line.split(":", 1)[-1].split()), line)
        return cls(frozenset(), platform.processor())

    @classmethod
    @functools.cache
    def detect(cls) -> "CpuFeatures":
        try:
            return cls.parse(Path("/proc/cpuinfo").read_text())
        except OSError:
            return cls(frozenset(), platform.processor())

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware (AVX-512 BF16 or AMX)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def describe(self) -> str:
        simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in self.flags]
        return " ".join(simd) or "no AVX"
