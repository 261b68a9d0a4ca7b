"""``kubeshard-router``: flags → one RouterConfig → the app on uvicorn.

Prints exactly ``kubeshard ready on http://HOST:PORT`` on stdout once the server listens
and every static backend has answered Info (the ``kubeshard serve`` launcher waits for
that line). SIGTERM drains: new connections are refused, ``/health`` and ``/readyz``
answer 503, and in-flight streams finish (up to ``--drain-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from typing import Optional, Sequence

from kubeshard_router.balancer import MODES
from kubeshard_router.config import RouterConfig, parse_backend_flag
from kubeshard_router.tool_formats import PARSERS as TOOL_CALL_PARSERS

log = logging.getLogger("kubeshard.router")


def build_parser() -> argparse.ArgumentParser:
    """The flags; each one that sets a RouterConfig field has that field as its ``dest``
    (``build_config`` passes those through), its default and, unless given, its type."""
    p = argparse.ArgumentParser(prog="kubeshard-router", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fields = RouterConfig.__dataclass_fields__

    def setting(group: argparse._ArgumentGroup, flag: str, field: str, help: Optional[str] = None,
                **kwargs) -> None:
        default = fields[field].default
        kwargs.setdefault("type", type(default))
        group.add_argument(flag, dest=field, default=default, help=help,
                           metavar=flag[2:].replace("-", "_").upper(), **kwargs)

    g = p.add_argument_group("serving")
    setting(g, "--host", "host", "address to listen on")
    setting(g, "--port", "port", "port to listen on (0: any free)")
    setting(g, "--drain-timeout", "drain_timeout_s", "seconds in-flight streams may take to finish on SIGTERM")
    g.add_argument("--log-level", default=fields["log_level"].default,
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
    setting(g, "--affinity-blocks", "affinity_blocks", "leading full KV blocks hashed for prefix affinity")
    setting(g, "--load-factor", "load_factor", "a replica above this multiple of the mean load is skipped")
    g = p.add_argument_group("redis")
    g.add_argument("--redis-url", default=None, help="redis://[user:password@]host:port/db")
    g.add_argument("--no-redis", action="store_true", help="no cache, no shared counters or limits")
    setting(g, "--cache-ttl", "cache_ttl_s", "cache entry TTL (s)")
    setting(g, "--redis-timeout", "redis_timeout_s", "timeout of one Redis operation (s)")
    setting(g, "--redis-retry", "redis_retry_s", "after a Redis failure, skip Redis for this long (s)")
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
    setting(g, "--rate-limit-rpm", "rate_limit_rpm", "requests per minute per key (0: none)")
    setting(g, "--rate-limit-tpm", "rate_limit_tpm", "tokens (prompt + max new) per minute per key (0: none)")
    setting(g, "--max-queue-per-model", "max_queue_per_model", "requests that may wait per model before 429")
    setting(g, "--queue-timeout", "queue_timeout_s", "seconds a request may wait for a slot before 429")
    setting(g, "--activation-timeout", "activation_timeout_s",
            "seconds a request is held for a model with no ready replica before 503")
    setting(g, "--max-top-n-tokens", "max_top_n_tokens")
    setting(g, "--max-stop-sequences", "max_stop_sequences")
    setting(g, "--max-body-bytes", "max_body_bytes")
    g = p.add_argument_group("timeouts and retries")
    setting(g, "--connect-timeout", "connect_timeout_s", "timeout of Health probes (s)")
    setting(g, "--info-timeout", "info_timeout_s", "timeout of Info calls (s)")
    setting(g, "--request-timeout", "request_timeout_s", "deadline of one generation (s)")
    setting(g, "--stall-timeout", "stall_timeout_s", "cancel a generation that produced nothing for this long (s)")
    setting(g, "--health-interval", "health_interval_s", "seconds between Health probes of each replica")
    setting(g, "--max-retries", "max_retries", "other replicas tried when one fails before its first token")
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
    settings = {name: value for name, value in vars(args).items()
                if name in RouterConfig.__dataclass_fields__}
    if not args.router_id:
        del settings["router_id"]  # the field's default: a fresh one
    settings.update(backends=backends, redis_url=None if args.no_redis else args.redis_url)
    return RouterConfig(**settings)


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
    freeze_startup_heap()
    await task


def freeze_startup_heap() -> None:
    """What the started router holds for as long as it runs (~90,000 objects, mostly its
    imports) is frozen out of the garbage collector's walks: each collection of the oldest
    generation walked them all (20-25 ms), a pause every stream through this router
    shared. As the shard server does once loaded (kubeshard_shard/server/heap.py)."""
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen: %d objects out of the garbage collector's walks", gc.get_freeze_count())


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
