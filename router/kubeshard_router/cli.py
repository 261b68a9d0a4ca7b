"""``kubeshard-router``: flags → one RouterConfig → the app on uvicorn.

Prints exactly ``kubeshard ready on http://HOST:PORT`` on stdout once the server listens
and every static backend has answered Info (the ``kubeshard serve`` launcher waits for
that line). SIGTERM drains: new connections are refused, ``/health`` and ``/readyz``
answer 503, and in-flight streams finish (up to ``--drain-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional, Sequence

from kubeshard_router.balancer import MODES
from kubeshard_router.config import RouterConfig, parse_backend_flag
from kubeshard_router.tool_formats import PARSERS as TOOL_CALL_PARSERS

log = logging.getLogger("kubeshard.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubeshard-router", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = RouterConfig.__dataclass_fields__
    g = p.add_argument_group("serving")
    g.add_argument("--host", default=d["host"].default, help="address to listen on")
    g.add_argument("--port", type=int, default=d["port"].default, help="port to listen on (0: any free)")
    g.add_argument("--drain-timeout", type=float, default=d["drain_timeout_s"].default,
                   help="seconds in-flight streams may take to finish on SIGTERM")
    g.add_argument("--log-level", default=d["log_level"].default,
                   choices=["debug", "info", "warning", "error", "critical"])
    g = p.add_argument_group("backends")
    g.add_argument("--backend", action="append", default=[], metavar="MODEL=HOST:PORT[,HOST:PORT...]",
                   help="static replica leaders of a model (repeatable)")
    g.add_argument("--kubernetes", action="store_true",
                   help="discover models from InferenceService objects and their leader EndpointSlices")
    g.add_argument("--namespace", default=None, help="with --kubernetes: watch only this namespace")
    g.add_argument("--default-model", default=None,
                   help="model for requests that name none (default: the only model, if one)")
    g.add_argument("--balance", default="prefix", choices=MODES,
                   help="replica choice: prefix affinity with bounded load, or a plain policy")
    g.add_argument("--affinity-blocks", type=int, default=d["affinity_blocks"].default,
                   help="leading full KV blocks hashed for prefix affinity")
    g.add_argument("--load-factor", type=float, default=d["load_factor"].default,
                   help="a replica above this multiple of the mean load is skipped")
    g = p.add_argument_group("redis")
    g.add_argument("--redis-url", default=None, help="redis://[user:password@]host:port/db")
    g.add_argument("--no-redis", action="store_true", help="no cache, no shared counters or limits")
    g.add_argument("--cache-ttl", type=int, default=d["cache_ttl_s"].default, help="cache entry TTL (s)")
    g.add_argument("--redis-timeout", type=float, default=d["redis_timeout_s"].default,
                   help="timeout of one Redis operation (s)")
    g.add_argument("--redis-retry", type=float, default=d["redis_retry_s"].default,
                   help="after a Redis failure, skip Redis for this long (s)")
    g = p.add_argument_group("auth and limits")
    g.add_argument("--api-keys-file", default=None, help="YAML or one-key-per-line file of API keys")
    g.add_argument("--api-keys-secret", default=None, metavar="NAMESPACE/NAME",
                   help="Kubernetes Secret holding API keys")
    g.add_argument("--allow-runtime-lora", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default; "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also turns it on); with API keys, only keys "
                        "marked admin may call them; needs --lora-root")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                   help="how models write tool calls (vLLM's flag): auto reads each model's chat template "
                        "(<tool_call>: hermes, <|python_tag|>: llama3_json, [TOOL_CALLS]: mistral; else hermes)")
    g.add_argument("--lora-root", default=None, metavar="DIR",
                   help="absolute folder, as the shard pods see it, under which every runtime lora_path must lie")
    g.add_argument("--rate-limit-rpm", type=int, default=0, help="requests per minute per key (0: none)")
    g.add_argument("--rate-limit-tpm", type=int, default=0,
                   help="tokens (prompt + max new) per minute per key (0: none)")
    g.add_argument("--max-queue-per-model", type=int, default=d["max_queue_per_model"].default,
                   help="requests that may wait per model before 429")
    g.add_argument("--queue-timeout", type=float, default=d["queue_timeout_s"].default,
                   help="seconds a request may wait for a slot before 429")
    g.add_argument("--activation-timeout", type=float, default=d["activation_timeout_s"].default,
                   help="seconds a request is held for a model with no ready replica before 503")
    g.add_argument("--max-top-n-tokens", type=int, default=d["max_top_n_tokens"].default)
    g.add_argument("--max-stop-sequences", type=int, default=d["max_stop_sequences"].default)
    g.add_argument("--max-body-bytes", type=int, default=d["max_body_bytes"].default)
    g = p.add_argument_group("timeouts and retries")
    g.add_argument("--connect-timeout", type=float, default=d["connect_timeout_s"].default,
                   help="timeout of Health probes (s)")
    g.add_argument("--info-timeout", type=float, default=d["info_timeout_s"].default,
                   help="timeout of Info calls (s)")
    g.add_argument("--request-timeout", type=float, default=d["request_timeout_s"].default,
                   help="deadline of one generation (s)")
    g.add_argument("--stall-timeout", type=float, default=d["stall_timeout_s"].default,
                   help="cancel a generation that produced nothing for this long (s)")
    g.add_argument("--health-interval", type=float, default=d["health_interval_s"].default,
                   help="seconds between Health probes of each replica")
    g.add_argument("--max-retries", type=int, default=d["max_retries"].default,
                   help="other replicas tried when one fails before its first token")
    g.add_argument("--router-id", default=None, help="name of this router instance in Redis counters")
    g.add_argument("--load-token-file", default=None, metavar="PATH",
                   help="bearer token of GET /internal/load (this router's load, for the metrics "
                        "server when Redis is away); unset: the route is off")
    return p


def build_config(args: argparse.Namespace) -> RouterConfig:
    backends: dict[str, tuple[str, ...]] = {}
    for flag in args.backend:
        model, addrs = parse_backend_flag(flag)
        backends[model] = backends.get(model, ()) + addrs
    if args.redis_url and args.no_redis:
        raise ValueError("--redis-url and --no-redis are exclusive")
    extra = {"router_id": args.router_id} if args.router_id else {}
    return RouterConfig(
        host=args.host, port=args.port, backends=backends, kubernetes=args.kubernetes,
        namespace=args.namespace, default_model=args.default_model,
        redis_url=None if args.no_redis else args.redis_url, redis_timeout_s=args.redis_timeout,
        redis_retry_s=args.redis_retry, cache_ttl_s=args.cache_ttl,
        api_keys_file=args.api_keys_file, api_keys_secret=args.api_keys_secret,
        allow_runtime_lora=args.allow_runtime_lora, lora_root=args.lora_root,
        tool_call_parser=args.tool_call_parser,
        rate_limit_rpm=args.rate_limit_rpm, rate_limit_tpm=args.rate_limit_tpm,
        max_queue_per_model=args.max_queue_per_model, queue_timeout_s=args.queue_timeout,
        activation_timeout_s=args.activation_timeout, connect_timeout_s=args.connect_timeout,
        info_timeout_s=args.info_timeout, request_timeout_s=args.request_timeout,
        stall_timeout_s=args.stall_timeout, health_interval_s=args.health_interval,
        max_retries=args.max_retries, max_top_n_tokens=args.max_top_n_tokens,
        max_stop_sequences=args.max_stop_sequences, max_body_bytes=args.max_body_bytes,
        affinity_blocks=args.affinity_blocks, load_factor=args.load_factor,
        drain_timeout_s=args.drain_timeout, log_level=args.log_level,
        load_token_file=args.load_token_file, **extra)


async def serve(config: RouterConfig, balance: str = "prefix") -> None:
    import uvicorn

    from kubeshard_router.app import create_app

    app = create_app(config, balance_mode=balance)
    state = app.state.kubeshard

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # type: ignore[override]
            if state.start_draining():
                log.info("signal %s: draining (no new connections; in-flight streams finish)", sig)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(
        app, host=config.host, port=config.port, http="httptools", lifespan="on",
        log_level=config.log_level, access_log=False, backlog=4096,
        timeout_keep_alive=30, timeout_graceful_shutdown=config.drain_timeout_s, log_config=None))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
            raise SystemExit("kubeshard-router: the server did not start")
        await asyncio.sleep(0.02)
    ready = asyncio.create_task(state.wait_static_ready())
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"kubeshard ready on http://{config.host}:{port}", flush=True)
    else:
        ready.cancel()
    await task


def raise_fd_limit() -> int:
    """Each client stream holds a socket: lift the soft open-files limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = build_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.debug("open files limit: %d", raise_fd_limit())
    try:
        import uvloop
        uvloop.run(serve(config, args.balance))
    except ImportError:
        asyncio.run(serve(config, args.balance))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
