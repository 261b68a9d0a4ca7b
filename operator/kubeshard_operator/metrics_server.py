"""`kubeshard-operator metrics-server`: the custom metrics API's process (its own
Deployment in the chart, registered by the APIService v1beta2.custom.metrics.k8s.io).

Flags → a TLS context (the serving certificate; client certificates verified against the
front-proxy CA of kube-system/extension-apiserver-authentication) → the aiohttp app of
metrics_api.py on `--secure-port`.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from typing import Optional, Sequence

from kubeshard_operator.delegated_auth import DelegatedAuth, load_front_proxy
from kubeshard_operator.kube import Kube
from kubeshard_operator.load import LoadReader

LOG = logging.getLogger("kubeshard_operator.metrics_server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kubeshard-operator metrics-server",
        description="Serves custom.metrics.k8s.io/v1beta2 for InferenceServices from the "
                    "routers' live load.")
    p.add_argument("--secure-port", type=int, default=6443, help="HTTPS port")
    p.add_argument("--bind-address", default="0.0.0.0")
    p.add_argument("--tls-cert-file", required=True, help="serving certificate (PEM)")
    p.add_argument("--tls-private-key-file", required=True, help="its key (PEM)")
    p.add_argument("--redis-url", default=os.environ.get("KUBESHARD_REDIS_URL"),
                   help="Redis the routers publish their load to (default: "
                        "$KUBESHARD_REDIS_URL; unset: ask the routers only)")
    p.add_argument("--router-service", default=None, metavar="NAMESPACE/NAME",
                   help="the router Service whose pods are asked directly when Redis is away")
    p.add_argument("--load-token-file", default=None, metavar="PATH",
                   help="bearer token of the routers' GET /internal/load")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def router_service(value: Optional[str]) -> Optional[tuple[str, str]]:
    if not value:
        return None
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name:
        raise SystemExit(f"--router-service must be NAMESPACE/NAME, not {value!r}")
    return namespace, name


def tls_context(cert: str, key: str, client_ca_pem: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca_pem:
        ctx.load_verify_locations(cadata=client_ca_pem)
        # Requested, verified when given: probes and token-bearing clients come without one.
        ctx.verify_mode = ssl.CERT_OPTIONAL
    else:
        LOG.warning("the cluster has no front-proxy CA (requestheader-client-ca-file); only "
                    "bearer tokens authenticate")
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from aiohttp import web
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    from kubeshard_operator.metrics_api import MetricsAPI

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config()
    else:
        k8s_config.load_kube_config()
    kube = Kube(k8s.ApiClient(), timeout=10.0)
    front_proxy = load_front_proxy(kube)
    reader = LoadReader(redis_url=args.redis_url or None, kube=kube,
                        router_service=router_service(args.router_service),
                        token_file=args.load_token_file)
    api = MetricsAPI(DelegatedAuth(kube, front_proxy), kube, reader)
    ctx = tls_context(args.tls_cert_file, args.tls_private_key_file, front_proxy.ca_pem)
    LOG.info("custom metrics API on https://%s:%d (redis %s, router service %s)",
             args.bind_address, args.secure_port, "on" if args.redis_url else "off",
             args.router_service or "-")
    web.run_app(api.app(), host=args.bind_address, port=args.secure_port, ssl_context=ctx,
                print=None, access_log=None)
    return 0
