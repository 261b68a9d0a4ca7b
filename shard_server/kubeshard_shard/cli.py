"""The ``kubeshard`` command: demo-model, serve-shard, generate, serve.

Flags are parsed and validated here, once, into typed configs; bad values exit with
status 2 and a message that names the flag. Heavy imports (torch) happen only in the
subcommands that need them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kubeshard_shard import __version__

log = logging.getLogger("kubeshard")


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype (auto: float32 on CPU, the checkpoint's on CUDA)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-input-tokens", type=positive_int, help="longest prompt accepted (default: total - 1)")
    g.add_argument("--max-total-tokens", type=positive_int,
                   help="prompt + generated tokens per request (default: min(model max positions, 4096))")
    g.add_argument("--max-batch-tokens", type=positive_int, default=2048,
                   help="token budget of one engine step (prefill chunks + decodes)")
    g.add_argument("--max-concurrent-requests", type=positive_int, default=512,
                   help="requests in flight before new ones get RESOURCE_EXHAUSTED")
    g.add_argument("--max-num-seqs", type=positive_int, default=256, help="largest running batch")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes (e.g. 2GiB) or a fraction of device memory (e.g. 0.2); "
                        "default 0.1 of RAM on CPU, 0.9 of free GPU memory on CUDA")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--num-threads", type=positive_int, help="CPU threads for torch (default: all available)")
    g.add_argument("--cpu-gemm", default="auto", choices=["auto", "onednn", "torch"],
                   help="CPU GEMM library (auto: oneDNN where it is faster and this CPU has the dtype's kernels)")
    g.add_argument("--no-cpu-kernels", action="store_true",
                   help="serve decode attention and GEMMs with torch instead of the compiled CPU kernels")
    g.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "gguf"],
                   help="weight-only quantization at load, CPU: int8 per channel, int4 per group, or gguf "
                        "(keep a GGUF file's Q8_0/Q4_0/Q4_1 weights quantized)")
    g.add_argument("--quantize-group-size", type=int, default=32, choices=[32, 64],
                   help="values per int4 group (one float16 scale and minimum each)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8"],
                   help="what the KV pool stores (auto: the model's dtype; int8: one scale per token and head, "
                        "about twice bfloat16's tokens in the same memory; fp8 needs FP8 hardware)")
    g.add_argument("--lora-adapter", action="append", metavar="NAME=FOLDER",
                   help="a PEFT LoRA adapter to serve as NAME (repeatable; requests pick it by name)")
    g.add_argument("--enable-lora", action="store_true",
                   help="apply LoRA adapters even with none given at start (runtime loads need --lora-root)")
    g.add_argument("--lora-root", default=None, metavar="DIR",
                   help="allow loading LoRA adapters at run time (LoadAdapter; the router's /v1/load_lora_adapter) "
                        "from folders under DIR only (symbolic links resolved); implies --enable-lora")
    g.add_argument("--max-loras", type=positive_int, default=8, help="LoRA adapters loaded at once")
    g.add_argument("--max-lora-rank", type=positive_int, default=64, help="largest LoRA rank accepted")



def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (propose tokens cheaply, verify them in one pass; requests may "
                             "turn it off)")
    g.add_argument("--speculative", default="none", choices=["none", "ngram", "draft"],
                   help="ngram: look proposals up in the sequence's own tokens; draft: a smaller model of the "
                        "same tokenizer proposes them")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                   help="the most tokens a sequence proposes per step (fewer after refused proposals, more again "
                        "while they are kept)")
    g.add_argument("--speculative-ngram-min", type=positive_int, default=2,
                   help="shortest suffix looked up (ngram)")
    g.add_argument("--speculative-ngram-max", type=positive_int, default=4,
                   help="longest suffix looked up (ngram)")
    g.add_argument("--speculative-draft-model", help="the draft model: a folder or .gguf file (draft)")
    g.add_argument("--speculative-draft-quantize", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the draft model (float32 on CPU); int4 makes the target's "
                        "own checkpoint a cheap draft of itself")
    g.add_argument("--speculative-disable-by-batch-size", type=non_negative_int, default=0, metavar="N",
                   help="no speculation in a step while N or more sequences run (0: at any batch size); "
                        "large batches gain little from it")


def add_activation_cache_flags(p: argparse.ArgumentParser, with_url: bool) -> None:
    g = p.add_argument_group("activation cache (KV blocks of shared prompt prefixes in Redis; on with a Redis URL)")
    if with_url:
        g.add_argument("--redis-url", default=os.environ.get("KUBESHARD_REDIS_URL") or None,
                       help="Redis (or a Redis Cluster node) for the activation cache (or KUBESHARD_REDIS_URL)")
        g.add_argument("--redis-key-model", help="the {model} part of its Redis keys (default: --model-id)")
    g.add_argument("--no-activation-cache", action="store_true", help="do not share KV blocks through Redis")
    g.add_argument("--activation-cache-min-hits", type=positive_int, default=2,
                   help="prompts that must have held a prefix block before it is written")
    g.add_argument("--activation-cache-ttl", type=positive_int, default=3600, help="entry lifetime (s)")
    g.add_argument("--activation-cache-max-bytes", default="1GiB",
                   help="Redis bytes per model before the oldest entries go (0: Redis's eviction only)")
    g.add_argument("--activation-cache-timeout", type=float, default=1.0,
                   help="longest a request waits for Redis before computing its prefix (s)")


def add_group_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shard group")
    g.add_argument("--strategy", default=None, choices=["tensor", "zero3"],
                   help="sharding strategy (default tensor)")
    g.add_argument("--shards", type=positive_int, default=None, help="processes in the group (WORLD_SIZE)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeshard", description="kubeshard model server and tools")
    parser.add_argument("--version", action="version", version=f"kubeshard {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("KUBESHARD_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo-model", help="write a deterministic demo checkpoint (random weights, no download)")
    p.add_argument("dir", help="output folder (created; must be empty)")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=non_negative_int, default=0)

    p = sub.add_parser("serve-shard", help="run one model-server process (one rank of a shard group)")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder or a .gguf file")
    p.add_argument("--model-id", help="served model name (default: the folder's or file's name)")
    p.add_argument("--revision", default="main", help="model revision, part of every cache key")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=port_number, default=50051, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--metrics-port", type=port_number, default=9400, help="Prometheus /metrics port (0: off)")
    p.add_argument("--drain-seconds", type=float, default=30.0, help="grace period for in-flight streams on SIGTERM")
    add_engine_flags(p)
    add_speculative_flags(p)
    add_activation_cache_flags(p, with_url=True)
    add_group_flags(p)
    g = p.add_argument_group("rendezvous (rank, world size and leader address)")
    g.add_argument("--rank", type=non_negative_int, help="this process's rank (or RANK, or the pod ordinal)")
    g.add_argument("--master-addr", help="leader (rank 0) address (or MASTER_ADDR)")
    g.add_argument("--master-port", type=port_number, help="rendezvous port (or MASTER_PORT; default 29500)")
    g.add_argument("--headless-service", help="in a StatefulSet: the group's headless Service; rank comes from "
                                              "POD_NAME's ordinal and the leader is <statefulset>-0.<service>")
    g.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds to wait for peers while the group forms and loads (a slow rank may "
                        "still be pulling its weights); serving-time collectives time out after 20 s")
    g.add_argument("--offload", choices=["cpu"], help="zero3 on CUDA: keep partitions in pinned host memory")

    p.add_argument("--runtime", default="kubeshard", choices=["kubeshard", "onnx"],
                   help="the engine: kubeshard's own, or ONNX Runtime GenAI in this process (onnx: the "
                        "checkpoint is exported once with its model builder, hack/engines.sh onnx)")

    p = sub.add_parser("engine-info", help="answer the router's Info/Health/Stats for a peer engine "
                                           "(vLLM, llama.cpp's server, or any OpenAI-compatible server "
                                           "as openai) that generates over HTTP")
    p.add_argument("--runtime", required=True, choices=["vllm", "llamacpp", "openai"],
                   help="the engine's dialect; openai: SGLang, TGI's own server, trtllm-serve, ...")
    p.add_argument("--model", required=True, help="the model's Hugging Face folder or .gguf file (tokenizer, "
                                                  "chat template, limits; no weights are read)")
    p.add_argument("--model-id", required=True, help="the engine's served model name")
    p.add_argument("--revision", default="main")
    p.add_argument("--engine-url", required=True, help="the engine's http://HOST:PORT, as this server reaches it")
    p.add_argument("--openai-port", type=port_number, required=True,
                   help="the engine's port on this host, where the router sends generations")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=port_number, default=50051, help="gRPC port")
    p.add_argument("--max-input-tokens", type=positive_int)
    p.add_argument("--max-total-tokens", type=positive_int, help="the engine's context length (default: "
                                                                 "min(model max positions, 4096))")
    p.add_argument("--max-concurrent-requests", type=positive_int,
                   help="requests the engine runs at once (default: vllm 256, llamacpp 1, openai 128)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block for prefix affinity")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])

    p = sub.add_parser("generate", help="send one request to a model server over gRPC and print the text")
    p.add_argument("prompt")
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a shard-group leader")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=non_negative_int)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)

    p = sub.add_parser("serve", help="serve a model locally: shard groups behind the HTTP router")
    p.add_argument("--model", help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct, "
                                   "served as smollm2-135m-instruct)")
    p.add_argument("--model-id", help="served model name (default: the folder's or file's name)")
    p.add_argument("--revision", default="main")
    p.add_argument("--host", default="127.0.0.1", help="router address")
    p.add_argument("--port", type=port_number, default=8080, help="router port")
    redis = p.add_mutually_exclusive_group()
    redis.add_argument("--redis-url", help="Redis for the router's cache, counters and rate limits")
    redis.add_argument("--no-redis", action="store_true", help="run the router without Redis")
    p.add_argument("--replicas", type=positive_int, default=1, help="shard groups (model replicas)")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for kubeshard-router (repeatable)")
    p.add_argument("--runtime", default="kubeshard", choices=["kubeshard", "onnx", "vllm", "llamacpp"],
                   help="the engine of every replica: kubeshard's own, ONNX Runtime GenAI (in-process), "
                        "vLLM or llama.cpp's server (built once by hack/engines.sh NAME)")
    add_engine_flags(p)
    add_speculative_flags(p)
    add_activation_cache_flags(p, with_url=False)
    add_group_flags(p)
    return parser


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_demo_model(args) -> int:
    from kubeshard_shard.demo_model import write_demo_model

    out = write_demo_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch} {args.size} demo checkpoint (seed {args.seed}) to {out}")
    return 0


def cmd_serve_shard(args) -> int:
    from kubeshard_shard.checkpoints import local_checkpoint, served_name
    from kubeshard_shard.config import EngineConfig, ListenConfig, Placement
    from kubeshard_shard.server.shard_main import run_shard

    source = Path(args.model).expanduser()
    config = EngineConfig.from_args(args, model_dir=local_checkpoint(source),
                                    model_id=args.model_id or served_name(source))
    if args.runtime == "onnx":
        from kubeshard_shard.runtimes.onnx_model import run_onnx_shard

        return run_onnx_shard(config, args.shards or 1, ListenConfig.from_args(args))
    return run_shard(config, Placement.from_args(args), ListenConfig.from_args(args))


def cmd_engine_info(args) -> int:
    import asyncio

    from kubeshard_shard.config import ListenConfig
    from kubeshard_shard.server.engine_info import EngineInfoConfig, serve

    config = EngineInfoConfig(
        runtime=args.runtime, model=Path(args.model).expanduser(), model_id=args.model_id,
        revision=args.revision, engine_url=args.engine_url, openai_port=args.openai_port,
        max_total_tokens=args.max_total_tokens, max_input_tokens=args.max_input_tokens,
        max_concurrent_requests=args.max_concurrent_requests, block_size=args.block_size,
        dtype=args.dtype, device=args.device)
    return asyncio.run(serve(config, ListenConfig(host=args.host, port=args.port, metrics_port=None)))


def cmd_generate(args) -> int:
    from kubeshard_shard.client import run_generate

    return run_generate(args)


def cmd_serve(args) -> int:
    from kubeshard_shard.local_launcher import run_launcher

    return run_launcher(args)


COMMANDS = {"demo-model": cmd_demo_model, "serve-shard": cmd_serve_shard, "generate": cmd_generate,
            "serve": cmd_serve, "engine-info": cmd_engine_info}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    from kubeshard_shard.models.config import CheckpointError

    try:
        return COMMANDS[args.command](args)
    except CheckpointError as exc:
        print(f"kubeshard: cannot load the model: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kubeshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
