"""Sharded groups (tensor and zero3) as real processes joined by torch.distributed (gloo)."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time

import grpc
import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kubeshard_proto import pb
from tests.support.engine import build_engine, greedy, hf_greedy, random_prompts, run_to_completion
from tests.support.shard_process import start_group, start_shard, wait_exit

pytestmark = pytest.mark.slow


def gen_request(ids, n):
    return pb.GenerateRequest(request_id="s", input_ids=ids, sampling=pb.SamplingParameters(),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def run_concurrently(stub, prompts, n) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = [t.id for t in stub.Generate(gen_request(prompts[i], n), timeout=180)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return [results[i] for i in range(len(prompts))]


def total_parameter_bytes(model_dir) -> int:
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                shape = h.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n * 4
    return total


def gqa_two_kv_heads(src, dst):
    """A valid variant of the tiny llama with 2 KV heads (fewer than 4 ranks)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    hd = 16
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name][: 2 * hd].contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["num_key_value_heads"] = 2
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
@pytest.mark.parametrize("shards,arch", [(2, "llama"), (2, "qwen2"), (4, "llama"), (4, "qwen2")])
def test_greedy_identity_and_resident_bytes(demo_model, strategy, shards, arch):
    model = demo_model(arch)
    prompts = random_prompts(16, 1000, (1, 150), seed=30 + shards)
    shared = random_prompts(1, 1000, (48, 48), seed=40)[0]
    prefixed = [shared + p[:10] for p in prompts[:4]]
    served = build_engine(model, kv="16MiB")
    unsharded = [[o.token_id for o in outs] for outs in run_to_completion(served.engine, [(p, greedy(10)) for p in prompts])]
    group = start_group(model, strategy, shards, "--kv-cache-memory", "16MiB", "--max-total-tokens", "512")
    try:
        stub = group.leader.stub()
        got = run_concurrently(stub, prompts, 10)
        for i, prompt in enumerate(prompts):
            assert got[i] == unsharded[i] == hf_greedy(model, prompt, 10), f"request {i} ({len(prompt)} tokens)"
        # cached prefixes: the first request fills the cache, the others (one at a time,
        # so a zero3 leader places them on the rank that holds the prefix) reuse it
        got = [run_concurrently(stub, [p], 8)[0] for p in prefixed]
        for prompt, tokens in zip(prefixed, got):
            assert tokens == hf_greedy(model, prompt, 8)
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        assert stats.prefix_cache_hits >= 3 * 3, stats
        info = stub.Info(pb.InfoRequest(), timeout=10)
        assert info.strategy == strategy and info.shards == shards
        assert len(info.rank_parameter_bytes) == shards
        limit = total_parameter_bytes(model) / shards * 1.10
        for rank, resident in enumerate(info.rank_parameter_bytes):
            assert 0 < resident <= limit, f"rank {rank} keeps {resident} bytes; limit {limit:.0f}"
        if strategy == "zero3":
            assert len(stats.ranks) == shards and sum(r.kv_blocks_total for r in stats.ranks) == stats.kv_blocks_total
    finally:
        group.stop()


def test_fewer_kv_heads_than_ranks_are_replicated(demo_model, tmp_path):
    model = gqa_two_kv_heads(demo_model("llama"), tmp_path / "gqa2")
    prompts = random_prompts(6, 1000, (3, 80), seed=50)
    group = start_group(model, "tensor", 4, "--kv-cache-memory", "8MiB", "--max-total-tokens", "256")
    try:
        got = run_concurrently(group.leader.stub(), prompts, 10)
        for prompt, tokens in zip(prompts, got):
            assert tokens == hf_greedy(model, prompt, 10)
    finally:
        group.stop()


@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
def test_preemption_keeps_outputs_exact(demo_model, strategy):
    model = demo_model("llama")
    # 24 blocks of 16 tokens per pool, too few for 12 sequences of up to ~110 tokens
    kv_bytes = str(24 * (2 * 2 * 16 * 4 * 16 * 4 // (2 if strategy == "tensor" else 1)))
    prompts = random_prompts(12, 1000, (20, 90), seed=60)
    group = start_group(model, strategy, 2, "--kv-cache-memory", kv_bytes, "--max-total-tokens", "256",
                        "--max-batch-tokens", "128")
    try:
        stub = group.leader.stub()
        got = run_concurrently(stub, prompts, 20)
        for prompt, tokens in zip(prompts, got):
            assert tokens == hf_greedy(model, prompt, 20)
        assert stub.Stats(pb.StatsRequest(), timeout=10).preemptions_total > 0
    finally:
        group.stop()


@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
def test_killing_a_rank_ends_streams_and_the_group_then_a_restart_serves(demo_model, strategy):
    model = demo_model("llama")
    group = start_group(model, strategy, 2, "--kv-cache-memory", "16MiB", "--max-total-tokens", "4096")
    port = int(group.leader.address.rsplit(":", 1)[1])
    stub = group.leader.stub()
    call = stub.Generate(gen_request([5, 6, 7, 8], 3000), timeout=120)
    next(call)
    group.followers[0].proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    assert time.monotonic() - started < 30
    code = wait_exit(group.leader.proc, 30)
    assert code != 0, "the leader must exit non-zero when its group breaks"
    group2 = start_group(model, strategy, 2, "--kv-cache-memory", "16MiB", port=port)
    try:
        tokens = list(group2.leader.stub().Generate(gen_request([5, 6, 7, 8], 5), timeout=60))
        assert len(tokens) == 5
    finally:
        group2.stop()


def test_leader_is_not_serving_until_every_rank_has_loaded(demo_model):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.support.ports import free_port

    master, port = free_port(), free_port()
    common = ["--strategy", "tensor", "--shards", "2", "--master-port", str(master), "--kv-cache-memory", "16MiB"]
    leader = start_shard(demo_model("llama"), *common, "--rank", "0", port=port, wait=False)
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                break
            except grpc.RpcError:
                time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # rank 1 has not joined yet
        time.sleep(2)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        follower = start_shard(demo_model("llama"), *common, "--rank", "1", wait=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the group never became SERVING")
        follower.stop()
    finally:
        leader.stop()


def test_killing_the_leader_ends_its_followers(demo_model):
    group = start_group(demo_model("llama"), "tensor", 2, "--kv-cache-memory", "16MiB")
    group.leader.proc.send_signal(signal.SIGKILL)
    assert wait_exit(group.followers[0].proc, 30) != 0


def test_sizes_that_do_not_divide_fail_with_the_numbers(demo_model):
    shard = start_shard(demo_model("llama"), "--strategy", "tensor", "--shards", "3", "--rank", "0",
                        "--master-port", "29999", wait=False)
    code = wait_exit(shard.proc, 60)
    out = shard.output
    assert code == 2, out
    assert "num_attention_heads (8) is not divisible by 3" in out and "vocab_size (1024)" in out


def test_a_rank_that_cannot_reach_its_leader_names_the_address(demo_model):
    shard = start_shard(demo_model("llama"), "--strategy", "tensor", "--shards", "2", "--rank", "1",
                        "--master-addr", "127.0.0.1", "--master-port", "29998", "--dist-timeout", "3", wait=False)
    assert wait_exit(shard.proc, 60) == 1
    assert "could not reach the leader at 127.0.0.1:29998" in shard.output


def test_ranks_with_different_strategies_refuse_to_serve(demo_model):
    model = demo_model("llama")
    with pytest.raises(AssertionError) as info:
        start_group(model, "tensor", 2, "--kv-cache-memory", "16MiB", timeout=60,
                    follower_flags={1: ["--strategy", "zero3"]})
    assert "rank 1 runs --strategy zero3 but the leader runs tensor" in str(info.value)


def test_ranks_with_different_kv_cache_dtypes_refuse_to_serve(demo_model):
    with pytest.raises(AssertionError) as info:
        start_group(demo_model("llama"), "tensor", 2, "--kv-cache-memory", "16MiB", timeout=60,
                    follower_flags={1: ["--kv-cache-dtype", "bfloat16"]})
    assert "rank 1 has different engine settings from the leader" in str(info.value)
    assert "--kv-cache-dtype" in str(info.value)
