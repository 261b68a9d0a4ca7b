"""run_in_fresh_thread: torch work off the event loop leaves no thread (nor OpenMP team) behind."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from kubeshard_shard.server.fresh_thread import run_in_fresh_thread


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def settled_os_threads() -> int:
    """The OS thread count once it holds still: a thread that has ended for Python (an
    earlier test's, or an OpenMP team's) may still be leaving the kernel's list."""
    last = os_threads()
    for _ in range(100):
        await asyncio.sleep(0.02)
        now = os_threads()
        if now == last:
            return now
        last = now
    return last


def parallel_torch_op() -> str:
    a = torch.randn(4_000_000)
    torch.empty_like(a).copy_(a)  # large enough for ATen to open a parallel region
    return threading.current_thread().name


async def test_returns_the_value_from_a_thread_that_has_ended():
    name = await run_in_fresh_thread(parallel_torch_op, "fresh-test")
    assert name == "fresh-test"
    assert "fresh-test" not in [t.name for t in threading.enumerate()]


async def test_leaves_no_os_thread_behind_where_to_thread_does():
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here: no OpenMP team to leave behind")
    await asyncio.to_thread(lambda: None)  # the default pool's first thread, for a fair baseline below
    before = await settled_os_threads()
    await run_in_fresh_thread(parallel_torch_op, "fresh-test")
    for _ in range(100):  # the thread has settled the future; let it finish exiting
        if os_threads() == before:
            break
        await asyncio.sleep(0.01)
    assert os_threads() == before
    # the contrast that motivates it: a pool thread that ran a parallel op keeps an OpenMP team
    await asyncio.to_thread(parallel_torch_op)
    assert os_threads() > before


async def test_raises_what_the_function_raised():
    def fail() -> None:
        raise ValueError("checkpoint is broken")

    with pytest.raises(ValueError, match="checkpoint is broken"):
        await run_in_fresh_thread(fail, "fresh-test")


async def test_a_cancelled_wait_leaves_the_thread_to_finish_quietly():
    release = threading.Event()
    done = threading.Event()

    def slow() -> int:
        release.wait(5)
        done.set()
        return 1

    task = asyncio.ensure_future(run_in_fresh_thread(slow, "fresh-test"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(done.wait, 5)
    await asyncio.sleep(0.05)  # the settle callback runs on this loop and must not raise
