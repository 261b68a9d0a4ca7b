"""The per-model admission queue alone: limits, FIFO order, 429s, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kubeshard_router.admission import Admission
from kubeshard_router.errors import Overloaded


async def test_admits_up_to_capacity_then_queues_in_fifo_order():
    a = Admission("m", max_queue=10, queue_timeout_s=5)
    a.set_capacity(2)
    assert await a.acquire() == 0.0
    assert await a.acquire() == 0.0
    assert a.in_flight == 2
    order: list[int] = []

    async def wait(i: int) -> None:
        await a.acquire()
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert a.queued == 3 and order == []
    a.release()
    await asyncio.sleep(0.01)
    assert order == [0] and a.in_flight == 2
    a.release()
    a.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and a.in_flight == 2 and a.queued == 0


async def test_try_acquire_takes_only_a_free_slot_nobody_queues_for():
    a = Admission("m", max_queue=10, queue_timeout_s=5)
    a.set_capacity(1)
    assert a.try_acquire() and a.in_flight == 1
    assert not a.try_acquire() and a.in_flight == 1  # full: the caller queues with acquire()
    waiter = asyncio.create_task(a.acquire())
    await asyncio.sleep(0.01)
    a.set_capacity(3)  # the queued request takes the first freed slot...
    await waiter
    assert a.try_acquire() and a.in_flight == 3  # ...and a free slot with nobody queued is taken at once
    assert not a.try_acquire() and a.queued == 0


async def one_slot_taken_and_one_waiter(max_queue: int = 5) -> tuple[Admission, asyncio.Task]:
    """Model ``m`` with one slot, held, and a second request queued for it."""
    a = Admission("m", max_queue=max_queue, queue_timeout_s=5)
    a.set_capacity(1)
    await a.acquire()
    waiter = asyncio.create_task(a.acquire())
    await asyncio.sleep(0.01)
    return a, waiter


async def test_full_queue_answers_429_with_retry_after():
    a, waiter = await one_slot_taken_and_one_waiter(max_queue=1)
    with pytest.raises(Overloaded) as err:
        await a.acquire()
    assert err.value.status == 429
    assert "queued" in err.value.message and "`m`" in err.value.message
    assert int(err.value.headers["Retry-After"]) >= 1
    a.release()
    await waiter


async def test_queue_timeout_answers_429():
    a = Admission("m", max_queue=5, queue_timeout_s=0.05)
    a.set_capacity(1)
    await a.acquire()
    with pytest.raises(Overloaded, match="no slot freed"):
        await a.acquire()
    assert a.queued == 0 and a.in_flight == 1


async def test_cancelled_waiter_leaves_the_queue_and_leaks_no_slot():
    a, waiter = await one_slot_taken_and_one_waiter()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.queued == 0
    a.release()
    assert a.in_flight == 0
    assert await a.acquire() == 0.0


async def test_slot_handed_over_while_being_cancelled_is_returned():
    a, waiter = await one_slot_taken_and_one_waiter()
    a.release()       # hands the slot to the waiter...
    waiter.cancel()   # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.in_flight == 0 and a.queued == 0


async def test_more_capacity_wakes_waiters_and_less_capacity_drains():
    a = Admission("m", max_queue=5, queue_timeout_s=5)
    a.set_capacity(0)  # no ready replica yet
    waiters = [asyncio.create_task(a.acquire()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert a.queued == 3
    a.set_capacity(2)
    await asyncio.sleep(0.01)
    assert a.in_flight == 2 and a.queued == 1
    a.set_capacity(1)  # a replica went away: the running ones finish, nobody new starts
    a.release()
    await asyncio.sleep(0.01)
    assert a.in_flight == 1 and a.queued == 1
    a.release()
    await asyncio.gather(*waiters)
    assert a.in_flight == 1 and a.queued == 0
