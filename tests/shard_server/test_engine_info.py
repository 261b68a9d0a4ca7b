"""``kubeshard engine-info`` without an engine: its Info is built from the model's own
files (a GGUF file's metadata, no weights; or a Hugging Face folder) and names the peer
engine and its port; its health says why it is not serving while the engine does not
answer. With real engines: tests/router/test_peer_engines.py."""

from __future__ import annotations

import asyncio

from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from kubeshard_shard.models.config import load_model_config
from kubeshard_shard.server.engine_info import EngineInfoConfig, EngineInfoService, engine_load, model_meta
from kubeshard_shard.tokenizer import load_tokenizer
from tests.support.ports import free_port


def test_info_comes_from_the_gguf_metadata_and_names_the_engine():
    gguf = default_model_file()
    meta = model_meta(gguf)
    folder = local_checkpoint(gguf)
    converted = load_tokenizer(folder, load_model_config(folder))
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert meta.tokenizer.encode(text, add_special_tokens=False) == converted.encode(text, add_special_tokens=False)
    assert meta.architecture == "LlamaForCausalLM" and meta.vocab_size == 49152
    service = EngineInfoService(EngineInfoConfig("llamacpp", gguf, "smol", "main", "http://127.0.0.1:1", 8123,
                                                 max_total_tokens=512), meta)
    info = service.info()
    assert (info.runtime, info.openai_port, info.model_id) == ("llamacpp", 8123, "smol")
    assert (info.max_input_tokens, info.max_total_tokens, info.max_concurrent_requests) == (511, 512, 1)
    assert b"chat_template" in info.tokenizer_config_json and list(info.eos_token_ids) == sorted(meta.tokenizer.eos_ids)


def test_not_serving_until_the_engine_answers_and_the_reason_names_it():
    folder = local_checkpoint(default_model_file())
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    service = EngineInfoService(EngineInfoConfig("vllm", folder, "smol", "main", url, 8000), model_meta(folder))
    assert asyncio.run(service.check()) is False
    assert url in service.reason and "vllm" in service.reason
    assert service.info().max_concurrent_requests == 256 and service.info().max_total_tokens == 4096


def test_the_engines_waiting_and_running_gauges_become_stats():
    vllm = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    assert engine_load(vllm) == (4, 5)  # summed over the engine's data-parallel ranks
    sglang = 'sglang:num_running_reqs{model_name="m"} 7.0\nsglang:num_queue_reqs{model_name="m"} 1.0\n'
    assert engine_load(sglang) == (1, 7)
    tgi = "tgi_batch_current_size 6\ntgi_queue_size 2\ntgi_queue_size_bucket{le=\"1\"} 9\n"
    assert engine_load(tgi) == (2, 6)
    assert engine_load('{"iterationStats": []}') == (0, 0)  # trtllm-serve's JSON: none of them


def test_a_generic_openai_engine_is_a_peer_engine():
    folder = local_checkpoint(default_model_file())
    service = EngineInfoService(EngineInfoConfig("openai", folder, "smol", "main", "http://127.0.0.1:1", 30000),
                                model_meta(folder))
    info = service.info()
    assert (info.runtime, info.openai_port, info.max_concurrent_requests) == ("openai", 30000, 128)
    assert service.engine.health_path == "/health"
