"""The CPU kernels built ahead of time, one per x86-64 level (the shard image has no compiler),
and the cache of the builds made on a machine."""

from __future__ import annotations

import os
import time

import pytest

from kubeshard_shard.engine import kernels
from kubeshard_shard.hardware import CpuFeatures
from tests.support.cpu_kernels import F32_SHAPES, check_float32_kernel

AVX2 = CpuFeatures.parse("flags : fpu sse2 cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma "
                         "abm movbe xsave")
AVX512 = CpuFeatures(AVX2.flags | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
AVX512_VNNI = CpuFeatures(AVX512.flags | {"avx512_vnni"})
AVX2_VNNI = CpuFeatures(AVX2.flags | {"avx_vnni"})
BASELINE = CpuFeatures.parse("flags : fpu sse sse2")
ALL = tuple(level for level, _ in kernels.LEVELS)


def fake_modules(folder, levels):
    for level in levels:
        (folder / level).mkdir(parents=True)
        (folder / level / (kernels.prebuilt_name(level) + ".cpython-311-x86_64-linux-gnu.so")).touch()


@pytest.mark.parametrize("cpu, present, want", [
    (AVX512_VNNI, ALL, "x86-64-v4-vnni"),
    (AVX512, ALL, "x86-64-v4"),
    (AVX2_VNNI, ALL, "x86-64-v3-vnni"),
    (AVX2, ALL, "x86-64-v3"),
    (BASELINE, ALL, "x86-64"),
    (AVX512_VNNI, ("x86-64-v4", "x86-64-v3", "x86-64"), "x86-64-v4"),  # an image built before the VNNI levels
    (AVX512, ("x86-64-v3", "x86-64"), "x86-64-v3"),   # an image built without the v4 module
    (AVX2, ("x86-64-v4-vnni", "x86-64-v4", "x86-64-v3-vnni"), None),  # nothing this CPU runs
])
def test_the_highest_level_the_cpu_runs_is_chosen(tmp_path, cpu, present, want):
    fake_modules(tmp_path, present)
    pick = kernels.best_prebuilt(tmp_path, cpu)
    assert (pick[0] if pick else None) == want
    if pick:
        assert pick[1].parent.name == want


def test_a_prebuilt_module_is_loaded_and_computes_without_compiling(tmp_path, monkeypatch):
    """The baseline level (it runs on any x86-64) built with --prebuild's code, then loaded
    the way a shard pod does: KUBESHARD_PREBUILT_KERNELS set, nothing compiled."""
    built = kernels.prebuild(tmp_path, ("x86-64",))
    assert [p.parent.name for p in built] == ["x86-64"]
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "compile_extension", lambda *a, **k: pytest.fail("compiled instead of loading"))
    module = kernels.module.__wrapped__(BASELINE.line)
    assert module is not None and module.__file__ == str(built[0])
    for m, n, kdim in F32_SHAPES:
        check_float32_kernel(module, m, n, kdim)
    assert callable(module.paged_decode_scaled)


def test_a_folder_without_a_module_for_this_cpu_leaves_the_torch_paths(tmp_path, monkeypatch):
    fake_modules(tmp_path, ("x86-64-v4",))
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(tmp_path))
    assert kernels.module.__wrapped__(AVX2.line) is None


def test_build_folders_unused_for_two_weeks_are_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBESHARD_CACHE", str(tmp_path))
    builds = tmp_path / "kernels"
    old, recent, other = builds / "cpu_0ld", builds / "cpu_recent", builds / "prebuilt"
    weeks_ago = time.time() - (kernels.UNUSED_BUILD_DAYS + 1) * 86400
    for folder in (old, recent, other):
        folder.mkdir(parents=True)
        (folder / "module.so").write_bytes(b"")
    for folder in (old, other):
        os.utime(folder, (weeks_ago, weeks_ago))
    used = kernels._build_dir("flags of a CPU")  # a build folder in use: its own, kept and marked used
    assert not old.exists() and recent.exists() and other.exists()  # only build folders go
    assert used.is_dir() and time.time() - used.stat().st_mtime < 60
    os.utime(used, (weeks_ago, weeks_ago))
    assert kernels.prune_unused_builds(builds, keep=used) == [] and used.exists()  # the one in use stays
    os.utime(recent, (weeks_ago, weeks_ago))
    assert kernels.prune_unused_builds(builds, keep=used) == [recent]
