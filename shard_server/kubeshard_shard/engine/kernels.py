"""The compiled CPU kernels (``csrc/``): decode attention over the paged KV cache, and
the GEMMs of decode-sized batches in float32, int8 and int4 (``csrc/gemm.cpp`` says why
they are ours and not a library's), and float32 GEMMs of many rows (``csrc/packed_gemm.cpp``).

Why our own kernel: without it, decode attention gathers every sequence's context into
a padded batch (a copy of the whole KV context per layer per step) and then runs a
masked attention over it — on two cores that was 40% of a 64-sequence decode step.
The kernel reads K and V straight from the cache blocks: one work item per (sequence,
KV head), whose grouped query heads share each K/V row (a context over 512 tokens is cut
into parts, each its own item, whose results are combined: batch 1 keeps every thread
busy); a K row and the V accumulators
live in SIMD registers (the head size is a template constant), and the next block of
the table is prefetched by hand, since blocks lie anywhere in the pool. Decode attention
is bound by memory, and this runs at a good fraction of the machine's DRAM bandwidth.
It is built with torch's C++ extension loader on first use (g++ and ninja), cached
outside the clone, and keyed by its source and the CPU's flags (a build folder no process
has used for two weeks is deleted); when it cannot be built,
or for a head size it does not handle, the torch fallback in ``attention.py`` serves
(slower, same results up to float rounding). A machine without a compiler (the shard
image) loads a module built ahead of time instead: ``prebuild`` compiles one per x86-64
level (v4: AVX-512, v3: AVX2 and FMA, each also with VNNI, and the baseline) with
setuptools and torch's ``BuildExtension`` (which compile without importing, so a build
machine need not run the AVX-512 one), and ``KUBESHARD_PREBUILT_KERNELS`` names their folder; the highest
level this CPU runs is loaded.

``module()`` is the whole extension (decode attention over every pool type, the GEMMs,
the fused layers, each step's argmax and log-sum-exp), or None when it cannot be built;
``compute.resolve_compute`` takes the engine's decode kernel (``paged_decode_scaled``) and
the GEMMs from it and hands them to the model runner and layers, and the sampler takes
``argmax_logsumexp`` and ``apply_bitmask_`` (a step's grammar masks). ``load()`` is the
float32-only ``paged_decode`` alone.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.paths import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_decode.cpp", "gemm.cpp", "packed_gemm.cpp", "fused.cpp", "fused_decode.cpp", "lora.cpp",
           "logits.cpp", "grammar_mask.cpp", "bindings.cpp")
HEADERS = ("simd.h", "kernels.h", "fused_decode.h", "lora.h", "parallel.h")


PREBUILT_ENV = "KUBESHARD_PREBUILT_KERNELS"
# x86-64 levels, highest first, with the CPU flags (as /proc/cpuinfo names them) each
# needs beyond the baseline: a module built for a level runs on any CPU that has them.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Each level's flags for the compiler; a level not named here is a -march of its own name.
# The "-vnni" levels add the integer dot product instructions (vpdpwssd: one instruction
# where a multiply-add and an add were) that most server CPUs of the last years have
# beyond their x86-64 level: AVX-512 VNNI (Xeon since Cascade Lake, Zen 4) and AVX-VNNI
# (Xeon 6 E-cores, Alder Lake and after). The int8 and int4 GEMMs use them: a pass over
# the default model's int4 layers at 4 and 8 rows of x took 1/1.09 and 1/1.08 of the plain
# v4 build's time, 1/1.11 and 1/1.10 of the plain v3's with AVX-VNNI (2026-12-07, Xeon,
# bench/results/quant-kernels-levels.md; at one row the differences were within noise).
LEVELS = (("x86-64-v4-vnni", _V4 | {"avx512_vnni"}), ("x86-64-v4", _V4),
          ("x86-64-v3-vnni", _V3 | {"avx_vnni"}), ("x86-64-v3", _V3), ("x86-64", frozenset()))
LEVEL_CFLAGS = {"x86-64-v4-vnni": ["-march=x86-64-v4", "-mavx512vnni"],
                "x86-64-v3-vnni": ["-march=x86-64-v3", "-mavxvnni"]}

CACHE_TYPES = {torch.float32: (torch.float32, torch.bfloat16, torch.float16, torch.int8),
               torch.bfloat16: (torch.bfloat16,), torch.float16: (torch.float16,)}


def supports(kernel: Callable | None, q: torch.Tensor, cache: torch.Tensor | None = None) -> bool:
    """Whether ``kernel`` serves decode queries like ``q`` ([B, Hq, D]): ``load``'s
    float32 kernel when no ``cache`` is given, else the engine's (``paged_decode_scaled``)
    over a pool like ``cache``."""
    if cache is None:
        ok = q.dtype == torch.float32
    else:
        ok = cache.dtype in CACHE_TYPES.get(q.dtype, ())
    return kernel is not None and ok and q.device.type == "cpu" and q.shape[-1] % 16 == 0 and q.shape[-1] <= 256


def _source_text() -> str:
    return "".join((CSRC / name).read_text() for name in SOURCES + HEADERS)


# a build folder no process has used for this long is deleted (every change to the sources,
# the flags or torch makes a new one, and a clone in a new place too)
UNUSED_BUILD_DAYS = 14


def _build_dir(flags: str) -> Path:
    # The folder of the sources counts too: torch's build also keys on the sources' paths,
    # so two checkouts of the same sources sharing one folder (a CI clone beside the working
    # tree) rebuilt it for each other in turn, each waiting on the other's build lock.
    key = hashlib.sha256((_source_text() + flags + torch.__version__ + str(CSRC.resolve())).encode()
                         ).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_{key}"
    path.mkdir(parents=True, exist_ok=True)
    os.utime(path)  # used now: its modification time is its last use
    prune_unused_builds(path.parent, keep=path)
    return path


def prune_unused_builds(folder: Path, keep: Path, days: float = UNUSED_BUILD_DAYS) -> list[Path]:
    """Deletes the build folders under ``folder`` (but ``keep``) that no process has used
    for ``days``; returns them. A process that loaded one keeps its module (mapped into
    memory); one building in it now has just written to it."""
    oldest = time.time() - days * 86400
    pruned = []
    for build in folder.glob("cpu_*"):
        try:
            unused = build != keep and build.is_dir() and build.stat().st_mtime < oldest
        except FileNotFoundError:  # another process pruned it first
            continue
        if unused:
            shutil.rmtree(build, ignore_errors=True)
            pruned.append(build)
    return pruned


def _cflags(march: str) -> list[str]:
    """The compiler's flags for ``march``: ``native``, an x86-64 level of ``LEVELS``, or
    any ``-march`` value."""
    return ["-O3", *LEVEL_CFLAGS.get(march, [f"-march={march}"]), "-fopenmp", "-fopenmp-simd"]


LDFLAGS = ["-fopenmp"]


def compile_extension(name: str, source_dir: Path, build_dir: Path, march: str = "native"):
    """Compiles ``SOURCES`` from ``source_dir`` into ``build_dir`` for ``-march=<march>``
    with the kernels' compiler flags, and loads the module as ``name`` (raises when the
    build fails)."""
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(
        name=name,
        sources=[str(source_dir / source) for source in SOURCES],
        extra_cflags=_cflags(march),
        extra_ldflags=LDFLAGS,
        build_directory=str(build_dir),
        verbose=False,
    )


def prebuilt_name(level: str) -> str:
    return "kubeshard_cpu_" + level.replace("-", "_")


def prebuild(out: Path, levels: tuple[str, ...] = tuple(level for level, _ in LEVELS)) -> list[Path]:
    """Compiles the module once per x86-64 level into ``out/<level>/`` (nothing is
    imported; symbols stripped, a third of the size); returns the modules' files."""
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    built = []
    for level in levels:
        name = prebuilt_name(level)
        ext = CppExtension(name, [str(CSRC / source) for source in SOURCES], extra_compile_args=_cflags(level),
                           extra_link_args=LDFLAGS + ["-s"])
        dist = Distribution({"name": name, "ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}})
        command = dist.get_command_obj("build_ext")
        with tempfile.TemporaryDirectory() as temp:
            command.build_lib, command.build_temp = str(out / level), temp
            command.ensure_finalized()
            command.run()
        built += sorted((out / level).glob(name + "*.so"))
    return built


def best_prebuilt(folder: Path, cpu: CpuFeatures) -> tuple[str, Path] | None:
    """The module under ``folder`` for the highest x86-64 level ``cpu`` runs, if any."""
    for level, needs in LEVELS:
        if needs <= cpu.flags:
            found = sorted((folder / level).glob(prebuilt_name(level) + "*.so"))
            if found:
                return level, found[0]
    return None


def _load_prebuilt(folder: Path, cpu: CpuFeatures):
    pick = best_prebuilt(folder, cpu)
    if pick is None:
        raise FileNotFoundError(f"{PREBUILT_ENV}={folder} holds no module this CPU runs")
    level, path = pick
    spec = importlib.util.spec_from_file_location(prebuilt_name(level), path)
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    log.info("CPU kernels: the %s build in %s", level, folder)
    return built


@functools.cache
def module(cpu_flags: str = "", march: str = "native"):
    """Builds (once per machine: the build is cached on disk, keyed by the sources and
    the CPU's flags) and loads the CPU kernels' module; None when it cannot be built
    (the torch paths serve). ``march``: the instruction set the compiler targets, this
    CPU's own unless a test builds a portable variant (``x86-64-v3``: AVX2 and FMA,
    ``x86-64``: the scalar paths) to check those paths on a machine with more. With
    ``KUBESHARD_PREBUILT_KERNELS`` set, this CPU's own build is the prebuilt module of
    its highest x86-64 level, loaded from that folder (nothing is compiled)."""
    folder = os.environ.get(PREBUILT_ENV)
    try:
        if folder and march == "native":
            return _load_prebuilt(Path(folder), CpuFeatures.parse("flags: " + cpu_flags) if cpu_flags
                                  else CpuFeatures.detect())
        build_dir = _build_dir((cpu_flags or CpuFeatures.detect().line) + ("" if march == "native" else march))
        return compile_extension(f"kubeshard_cpu_{build_dir.name.rsplit('_', 1)[-1]}", CSRC, build_dir, march)
    except Exception as exc:  # no compiler, no ninja, ...: serve with the torch fallback
        log.warning("CPU kernels unavailable, using the torch paths: %s", str(exc).splitlines()[0])
        return None


def load(cpu_flags: str = "") -> Callable | None:
    """The float32 paged decode kernel, ``kernel(out, q, k_cache, v_cache, block_tables,
    context_lens, block_size, scale)``, or None when the torch fallback serves."""
    built = module(cpu_flags)
    return None if built is None else built.paged_decode


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kubeshard_shard.engine.kernels",
                                     description="build the CPU kernels: this machine's (`make install` does, "
                                                 "ahead of the first server), or one per x86-64 level")
    parser.add_argument("--prebuild", metavar="DIR", help="build one module per x86-64 level into DIR (the shard "
                                                          "image's build stage); serve with "
                                                          f"{PREBUILT_ENV}=DIR")
    parser.add_argument("--require", action="store_true", help="fail when the kernels cannot be loaded")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.prebuild:
        for path in prebuild(Path(args.prebuild)):
            print("built", path)
        return
    ready = load() is not None
    print("paged decode kernel:", "ready" if ready else "unavailable (the torch fallback serves)")
    if args.require and not ready:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
