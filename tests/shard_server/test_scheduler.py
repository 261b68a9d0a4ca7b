"""Continuous batching: token budget, chunked prefill that does not stall decodes, preemption."""

from __future__ import annotations

from kubeshard_shard.engine.block_manager import BlockManager
from kubeshard_shard.engine.scheduler import Scheduler
from kubeshard_shard.engine.sequence import SamplingParams, Sequence


def seq(n, rid):
    return Sequence(rid, list(range(100, 100 + n)), SamplingParams(max_new_tokens=8))


def complete(sched_out):
    """Pretends the step ran: advance computed tokens and sample one token where due."""
    for s in sched_out.decodes:
        s.num_computed_tokens += 1
        s.token_ids.append(1)
    for s, n in sched_out.prefills:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(1)


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sch = Scheduler(BlockManager(64, 16), max_batch_tokens=32, max_num_seqs=8)
    short = seq(4, "short")
    sch.add(short)
    complete(sch.schedule())                      # short's prefill; it samples a token
    long = seq(100, "long")
    sch.add(long)
    for step, chunk in enumerate([31, 31, 31, 7]):
        out = sch.schedule()
        assert out.num_tokens <= 32
        assert short in out.decodes, f"step {step}: the running decode was stalled"
        [(s, n)] = out.prefills
        assert s is long and n == chunk
        complete(out)
    assert long.num_computed_tokens == 100 and long.num_tokens == 101
    out = sch.schedule()
    assert out.decodes == [short, long] and not out.prefills


def test_requests_join_and_leave_between_steps():
    sch = Scheduler(BlockManager(64, 16), max_batch_tokens=256, max_num_seqs=8)
    a, b = seq(10, "a"), seq(10, "b")
    sch.add(a)
    complete(sch.schedule())
    sch.add(b)
    out = sch.schedule()
    assert out.decodes == [a] and out.prefills == [(b, 10)]
    complete(out)
    sch.remove(a)
    out = sch.schedule()
    assert out.decodes == [b] and not out.prefills


def test_preempts_latest_when_memory_runs_out_and_resumes():
    bm = BlockManager(4, 4)                       # 16 token slots
    sch = Scheduler(bm, max_batch_tokens=64, max_num_seqs=8)
    a, b = seq(7, "a"), seq(7, "b")
    sch.add(a)
    sch.add(b)
    complete(sch.schedule())                      # both prefilled: 2 blocks each, all 4 used
    complete(sch.schedule())                      # token 8 still fits in the second block
    out = sch.schedule()                          # token 9 needs a third block: b, the latest, goes
    complete(out)
    assert out.preempted == [b]
    assert b in sch.waiting and b.num_computed_tokens == 0 and b.preemptions == 1
    assert out.decodes == [a]
    sch.remove(a)
    out = sch.schedule()
    assert out.prefills and out.prefills[0][0] is b and out.prefills[0][1] == b.num_tokens


def test_max_num_seqs_caps_the_batch():
    sch = Scheduler(BlockManager(64, 16), max_batch_tokens=1000, max_num_seqs=2)
    for i in range(3):
        sch.add(seq(5, str(i)))
    out = sch.schedule()
    assert len(out.prefills) == 2 and len(sch.waiting) == 1
