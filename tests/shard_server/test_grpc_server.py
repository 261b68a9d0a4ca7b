"""The model server over gRPC, as a real `kubeshard serve-shard` process."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kubeshard_proto import pb, pb_grpc
from tests.support.engine import hf_greedy, random_prompts
from tests.support.shard_process import start_shard


@pytest.fixture(scope="module")
def server(demo_model):
    shard = start_shard(demo_model("llama"), "--max-total-tokens", "1024", "--max-input-tokens", "600",
                        "--kv-cache-memory", "32MiB", metrics=True)
    yield shard
    shard.stop()


def request(prompt=None, ids=None, n=16, **sampling):
    stopping = {k: sampling.pop(k) for k in ("stop_sequences", "ignore_eos") if k in sampling}
    extra = {k: sampling.pop(k) for k in ("top_n_tokens", "prefill_details", "truncate") if k in sampling}
    req = pb.GenerateRequest(request_id="t", sampling=pb.SamplingParameters(**sampling),
                             stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=stopping.get("ignore_eos", True),
                                                          stop_sequences=stopping.get("stop_sequences", [])),
                             **extra)
    if prompt is not None:
        req.inputs = prompt
    if ids is not None:
        req.input_ids.extend(ids)
    return req


def collect(stub, req, timeout=60):
    return list(stub.Generate(req, timeout=timeout))


def test_the_loaded_shard_freezes_its_startup_heap(server):
    """Once loaded, what the model server holds for good (modules, tables) is out of the
    garbage collector's walks (gc.freeze): its log says how much."""
    found = re.search(r"startup heap frozen: (\d+) objects", server.output)
    assert found, server.output[-2000:]
    assert int(found.group(1)) > 50_000  # torch, transformers and the model: ~250,000 with the default model


def test_streams_tokens_with_text_and_finish(server, demo_model):
    stub = server.stub()
    tokens = collect(stub, request("Hello world 日本 😀", n=20))
    assert len(tokens) == 20 and [t.index for t in tokens] == list(range(20))
    assert all(not t.HasField("finish") for t in tokens[:-1])
    fin = tokens[-1].finish
    assert fin.reason == pb.FINISH_REASON_LENGTH and fin.generated_tokens == 20 and fin.prompt_tokens > 3
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_model("llama") / "tokenizer.json"))
    assert "".join(t.text for t in tokens) == tok.decode([t.id for t in tokens])
    assert all(t.logprob <= 0 for t in tokens)


def test_sixteen_concurrent_requests_match_transformers(server, demo_model):
    stub = server.stub()
    prompts = random_prompts(16, 1000, (1, 250), seed=21)
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = [t.id for t in collect(stub, request(ids=prompts[i], n=12))]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(demo_model("llama"), prompt, 12), f"request {i}"


def test_info_health_and_metrics(server):
    info = server.stub().Info(pb.InfoRequest(), timeout=10)
    assert info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
    assert info.max_input_tokens == 600 and info.max_total_tokens == 1024 and info.block_size == 16
    assert json.loads(info.tokenizer_json)["model"]["type"] == "BPE"
    assert "chat_template" in json.loads(info.tokenizer_config_json)
    assert info.eos_token_ids
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kubeshard.v1.TextGeneration"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert server.stub().Health(pb.HealthRequest(), timeout=5).serving
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "kubeshard_engine_kv_blocks", "kubeshard_engine_step_seconds", "vllm:time_to_first_token_seconds"):
        assert name in body, name


def requests_by_outcome(server) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    counts = {}
    for line in body.splitlines():
        if line.startswith("kubeshard_engine_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def abandoning_stub(server) -> pb_grpc.TextGenerationStub:
    """A client whose HTTP/2 window holds only a few token messages: the server blocks
    sending once it is full, so a stream the client abandons cannot run to its end before
    the cancel lands. (With the default 64 KiB window the server wrote a whole 400-token
    stream into it, and on a loaded machine the stream finished before its cancel arrived
    and counted as finished.)"""
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    return pb_grpc.TextGenerationStub(grpc.insecure_channel(server.address, options=options))


def test_every_request_is_counted_once_by_its_outcome(server):
    """Requests read to the end count as finished, and one the client abandons mid-stream
    as cancelled, each exactly once."""
    stub = server.stub()
    before = requests_by_outcome(server)
    for i in range(5):
        assert len(collect(stub, request(ids=[10 + i, 11, 12], n=4))) == 4
    call = abandoning_stub(server).Generate(request(ids=list(range(10, 60)), n=500), timeout=60)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and requests_by_outcome(server).get("cancelled", 0) == before.get("cancelled", 0):
        time.sleep(0.05)
    after = requests_by_outcome(server)
    assert after.get("finished", 0) - before.get("finished", 0) == 5
    assert after.get("cancelled", 0) - before.get("cancelled", 0) == 1


def test_streams_abandoned_at_varied_points_each_count_once_as_cancelled(server):
    """grpc.aio ends an abandoned handler in one of two ways, by when the client leaves: it
    cancels the handler's task while that awaits the engine, or closes the handler's
    generator while grpc awaits sending a message. Both count, once, and free the stream's
    blocks."""
    stub = abandoning_stub(server)
    before = requests_by_outcome(server)
    for i in range(24):
        call = stub.Generate(request(ids=[20 + i, 21, 22], n=400), timeout=120)
        for _ in range(1 + i % 6):
            next(call)
        if i % 2:  # sometimes leave while the server keeps writing
            time.sleep(0.02 * (i % 5))
        call.cancel()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
            requests_by_outcome(server).get("cancelled", 0) - before.get("cancelled", 0) < 24):
        time.sleep(0.05)
    after = requests_by_outcome(server)
    assert after.get("cancelled", 0) - before.get("cancelled", 0) == 24
    assert after.get("finished", 0) == before.get("finished", 0)
    while time.monotonic() < deadline and server.stats().kv_blocks_used:
        time.sleep(0.05)
    assert server.stats().kv_blocks_used == 0


def test_cancelled_stream_frees_its_kv_blocks(server):
    stub = abandoning_stub(server)
    call = stub.Generate(request(ids=list(range(10, 300)), n=700), timeout=120)
    for _, _ in zip(range(3), call):
        pass
    assert server.stats().kv_blocks_used > 0
    call.cancel()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and server.stats().kv_blocks_used:
        time.sleep(0.05)
    stats = server.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


def test_stop_sequence_and_eos(server, demo_model, tmp_path):
    stub = server.stub()
    full = collect(stub, request("A stop test", n=24))
    text = "".join(t.text for t in full)
    stop = text[8:11]
    stopped = collect(stub, request("A stop test", n=24, stop_sequences=[stop]))
    got = "".join(t.text for t in stopped)
    assert stopped[-1].finish.reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert stop in got and len(stopped) < 24 and text.startswith(got)


def test_eos_ends_generation(demo_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(demo_model("llama"), model)
    prompt = random_prompts(1, 1000, (12, 12), seed=22)[0]
    expected = hf_greedy(demo_model("llama"), prompt, 10)
    eos = expected[4]
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model / name).read_text())
        data["eos_token_id"] = eos
        (model / name).write_text(json.dumps(data))
    shard = start_shard(model, "--max-total-tokens", "512")
    try:
        tokens = collect(shard.stub(), request(ids=prompt, n=10, ignore_eos=False))
        assert [t.id for t in tokens] == expected[: expected.index(eos) + 1]
        assert tokens[-1].finish.reason == pb.FINISH_REASON_EOS_TOKEN
    finally:
        shard.stop()


def test_top_tokens_and_prefill_details(server):
    tokens = collect(server.stub(), request(ids=[5, 6, 7, 8], n=3, top_n_tokens=3, prefill_details=True))
    assert [p.id for p in tokens[0].prefill] == [5, 6, 7, 8]
    assert not tokens[0].prefill[0].HasField("logprob") and all(p.logprob <= 0 for p in tokens[0].prefill[1:])
    assert all(len(t.top_tokens) == 3 for t in tokens)
    assert tokens[0].top_tokens[0].id == tokens[0].id  # greedy picks the most likely
    assert not tokens[1].prefill


@pytest.mark.parametrize("req,fragment", [
    (request(""), "prompt is empty"),
    (request(ids=list(range(5, 700))), "max_input_tokens (600)"),
    (request("hi", n=0), "max_new_tokens must be >= 1"),
    (request("hi", n=2000), "max_total_tokens (1024)"),
    (request("hi", do_sample=True, top_p=1.5), "top_p must be in (0, 1]"),
    (request("hi", do_sample=True, top_p=0.0), "top_p must be in (0, 1]"),
    (request("hi", do_sample=True, temperature=-1.0), "temperature must be >= 0"),
    (request("hi", do_sample=True, top_k=0), "top_k must be >= 1"),
    (request("hi", repetition_penalty=0.0), "repetition_penalty"),
    (request("hi", stop_sequences=[""]), "stop_sequences"),
    (request(ids=[5, 99999]), "outside the vocabulary"),
])
def test_bad_requests_are_refused_and_the_server_keeps_serving(server, req, fragment):
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    assert len(collect(stub, request("still fine", n=2))) == 2


def test_over_max_concurrent_requests_is_resource_exhausted(demo_model):
    shard = start_shard(demo_model("llama"), "--max-concurrent-requests", "2", "--max-total-tokens", "2048")
    try:
        stub = shard.stub()
        calls = [abandoning_stub(shard).Generate(request(ids=[5, 6, 7], n=1500), timeout=120) for _ in range(2)]
        for call in calls:
            next(call)
        with pytest.raises(grpc.RpcError) as info:
            collect(stub, request("one too many", n=2))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-requests (2)" in info.value.details()
        for call in calls:
            call.cancel()
    finally:
        shard.stop()
