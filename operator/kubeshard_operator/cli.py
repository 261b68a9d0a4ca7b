"""`kubeshard-operator`: parse flags once into an OperatorConfig, then run kopf.

`kubeshard-operator metrics-server ...` runs the custom metrics API instead
(metrics_server.py), from the same image.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from typing import Optional, Sequence

import kopf
from prometheus_client import start_http_server

from kubeshard_operator import __version__
from kubeshard_operator.config import (
    DEFAULT_LLAMACPP_IMAGE, DEFAULT_SHARD_IMAGE, DEFAULT_SHARD_IMAGE_CUDA, DEFAULT_VLLM_CPU_IMAGE,
    DEFAULT_VLLM_IMAGE, OperatorConfig,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kubeshard-operator",
        description="Reconciles kubeshard.io InferenceServices into sharded StatefulSet groups.")
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--peering", default="kubeshard", metavar="NAME",
                   help="kopf peering object that elects one acting operator pod (default: "
                        "%(default)s; the chart creates it)")
    p.add_argument("--standalone", action="store_true",
                   help="no peering: this operator pod always acts (run one only)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; the highest acts. Default: random, so two "
                        "operator pods never tie")
    p.add_argument("--redis-url", default=os.environ.get("KUBESHARD_REDIS_URL"),
                   help="Redis whose model keys the finalizer removes (default: "
                        "$KUBESHARD_REDIS_URL; unset: nothing to clean)")
    p.add_argument("--router-url", default=os.environ.get("KUBESHARD_ROUTER_URL"),
                   help="the router Service's base URL, shown in status.url")
    p.add_argument("--router-service", default=None, metavar="NAMESPACE/NAME",
                   help="the router Service, whose pods report their load directly when Redis "
                        "is away (scale-to-zero reads it)")
    p.add_argument("--load-token-file", default=None, metavar="PATH",
                   help="bearer token of the routers' GET /internal/load")
    p.add_argument("--shard-image", default=DEFAULT_SHARD_IMAGE)
    p.add_argument("--shard-image-cuda", default=DEFAULT_SHARD_IMAGE_CUDA,
                   help="image of shard pods that request GPUs")
    p.add_argument("--vllm-image", default=DEFAULT_VLLM_IMAGE,
                   help="image of spec.runtime.name vllm on GPU pods")
    p.add_argument("--vllm-cpu-image", default=DEFAULT_VLLM_CPU_IMAGE,
                   help="image of spec.runtime.name vllm on CPU pods")
    p.add_argument("--llamacpp-image", default=DEFAULT_LLAMACPP_IMAGE,
                   help="image of spec.runtime.name llamacpp (llama-cpp-python's server)")
    p.add_argument("--shard-cache-dir", default=None, metavar="PATH",
                   help="KUBESHARD_CACHE of shard pods: a writable folder where GGUF files are "
                        "converted (default: the pod's /tmp)")
    p.add_argument("--image-pull-policy", default="IfNotPresent",
                   choices=["Always", "IfNotPresent", "Never"])
    p.add_argument("--reconcile-interval", type=float, default=10.0,
                   help="seconds between reconciles of an unchanged InferenceService")
    p.add_argument("--health-port", type=int, default=8080,
                   help="liveness endpoint /healthz (0: off)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics (0: off)")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    if args.reconcile_interval <= 0:
        raise SystemExit("kubeshard-operator: --reconcile-interval must be positive")
    # Flags named after an OperatorConfig field set it; an empty one (an unset chart value)
    # leaves an optional field unset.
    fields = OperatorConfig.__dataclass_fields__
    return OperatorConfig(**{name: value if fields[name].default is not None else value or None
                             for name, value in vars(args).items() if name in fields})


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["metrics-server"]:
        from kubeshard_operator.metrics_server import main as metrics_server

        return metrics_server(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # kopf logs every watch-event handler call at INFO: keep its per-object chatter out.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    cfg = config_from_args(args)
    # Imported here so `--help` works without a cluster and handlers register once.
    from kubeshard_operator.handlers import registry

    if args.metrics_port:
        start_http_server(args.metrics_port)
    priority = args.priority if args.priority is not None else \
        random.SystemRandom().randint(1, 2**31 - 1)
    memo = kopf.Memo(config=cfg, priority=priority, peering_mandatory=not args.standalone)
    kopf.run(
        registry=registry,
        memo=memo,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=(f"http://0.0.0.0:{args.health_port}/healthz"
                           if args.health_port else None),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
