"""Cluster DNS: answers Kubernetes' DNS names from Services and EndpointSlices.

A small stand-in for CoreDNS's kubernetes plugin (`python -m e2e.cluster.dns
CLUSTER.json`), serving UDP and TCP on 127.0.0.1; pods reach it at the `kube-dns`
Service IP, which the host's nft table DNATs here. It answers, per the Kubernetes DNS
specification:

  <svc>.<ns>.svc.cluster.local               A: the ClusterIP, or ready endpoint IPs (headless)
  <hostname>.<svc>.<ns>.svc.cluster.local    A: that endpoint (headless; StatefulSet pods)
  _<port>._<proto>.<svc>.<ns>.svc.cluster.local   SRV
  <a-b-c-d>.<ns>.pod.cluster.local           A
  ExternalName Services                      CNAME (not followed)

There is no upstream: every other name is NXDOMAIN, since nothing here may reach the
internet. TTLs are 5 s (CoreDNS: 30 s), so tests see changes quickly.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from dnslib import CNAME, QTYPE, RCODE, RR, SRV, A, DNSLabel, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from .config import CLUSTER_DOMAIN, ClusterConfig
from .api import Api, informer

TTL = 5
log = logging.getLogger("kubeshard.dns")


class ClusterIndex:
    """Services and EndpointSlices, kept current by two informers."""

    def __init__(self) -> None:
        self.services: dict[tuple[str, str], dict] = {}
        self.slices: dict[tuple[str, str], dict] = {}
        self.lock = threading.Lock()

    def _store(self, table: dict, etype: str, obj: Any) -> None:
        with self.lock:
            if etype == "SYNC":
                table.clear()
                for o in obj:
                    table[(o["metadata"]["namespace"], o["metadata"]["name"])] = o
            elif etype == "DELETED":
                table.pop((obj["metadata"]["namespace"], obj["metadata"]["name"]), None)
            else:
                table[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj

    def on_service(self, etype: str, obj: Any) -> None:
        self._store(self.services, etype, obj)

    def on_slice(self, etype: str, obj: Any) -> None:
        self._store(self.slices, etype, obj)

    def endpoints(self, ns: str, svc: dict) -> list[dict]:
        """Endpoints of a Service that DNS should publish (ready, or all if asked)."""
        name = svc["metadata"]["name"]
        all_ = bool(svc["spec"].get("publishNotReadyAddresses"))
        out = []
        with self.lock:
            slices = [s for (sns, _), s in self.slices.items() if sns == ns and
                      (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name") == name]
        seen = set()
        for s in slices:
            if s.get("addressType") != "IPv4":
                continue
            for ep in s.get("endpoints") or []:
                ready = (ep.get("conditions") or {}).get("ready") is not False
                if (ready or all_) and ep["addresses"][0] not in seen:
                    seen.add(ep["addresses"][0])
                    out.append({**ep, "ports": s.get("ports") or []})
        return out


class ClusterResolver(BaseResolver):
    def __init__(self, index: ClusterIndex) -> None:
        self.index = index
        self.zone = DNSLabel(CLUSTER_DOMAIN)

    def resolve(self, request: DNSRecord, handler) -> DNSRecord:
        reply = request.reply()
        qname = request.q.qname
        qtype = QTYPE[request.q.qtype]
        if not qname.matchSuffix(self.zone):
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        labels = [x.decode().lower() for x in qname.label[: -len(self.zone.label)]]
        records = self._lookup(labels, qname)
        if records is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for rr in records:  # a known name with no record of this type is NODATA, not NXDOMAIN
            if qtype == "ANY" or QTYPE[rr.rtype] == qtype or QTYPE[rr.rtype] == "CNAME":
                reply.add_answer(rr)
        return reply

    def _lookup(self, labels: list[str], qname) -> list[RR] | None:
        if len(labels) == 3 and labels[2] == "pod":  # a-b-c-d.<ns>.pod
            try:
                ip = ipaddress.IPv4Address(labels[0].replace("-", "."))
            except ValueError:
                return None
            return [RR(qname, QTYPE.A, ttl=TTL, rdata=A(str(ip)))]
        if len(labels) < 3 or labels[-1] != "svc":
            # The zone and namespace levels exist (NODATA); anything else does not.
            known = len(labels) == 0 or labels[-1] in ("svc", "pod") and len(labels) <= 2
            return [] if known else None
        ns, svc_name = labels[-2], labels[-3]
        with self.index.lock:
            svc = self.index.services.get((ns, svc_name))
        if svc is None:
            return None
        spec = svc["spec"]
        prefix = labels[:-3]
        if spec.get("type") == "ExternalName":
            return [RR(qname, QTYPE.CNAME, ttl=TTL, rdata=CNAME(spec["externalName"]))] if not prefix else None
        headless = spec.get("clusterIP") in (None, "", "None")
        base = f"{svc_name}.{ns}.svc.{CLUSTER_DOMAIN}"
        if not prefix:
            if headless:
                return [RR(qname, QTYPE.A, ttl=TTL, rdata=A(ep["addresses"][0]))
                        for ep in self.index.endpoints(ns, svc)]
            return [RR(qname, QTYPE.A, ttl=TTL, rdata=A(spec["clusterIP"]))]
        if len(prefix) == 1 and headless:  # <hostname>.<svc>.<ns>.svc
            hits = [ep for ep in self.index.endpoints(ns, svc) if ep.get("hostname") == prefix[0]
                    or ep["addresses"][0].replace(".", "-") == prefix[0]]
            return [RR(qname, QTYPE.A, ttl=TTL, rdata=A(ep["addresses"][0])) for ep in hits] or None
        if len(prefix) == 2 and prefix[0].startswith("_") and prefix[1].startswith("_"):
            port_name, proto = prefix[0][1:], prefix[1][1:].upper()
            ports = [p for p in spec.get("ports") or [] if p.get("name") == port_name
                     and p.get("protocol", "TCP") == proto]
            if not ports:
                return None
            if not headless:
                return [RR(qname, QTYPE.SRV, ttl=TTL, rdata=SRV(0, 100, ports[0]["port"], base))]
            out = []
            for ep in self.index.endpoints(ns, svc):
                host = ep.get("hostname") or ep["addresses"][0].replace(".", "-")
                port = next((p["port"] for p in ep["ports"] if p.get("name") == port_name), ports[0]["port"])
                out.append(RR(qname, QTYPE.SRV, ttl=TTL, rdata=SRV(0, 100, port, f"{host}.{base}")))
            return out
        return None


def serve(config: ClusterConfig, stop: threading.Event) -> None:
    api = Api(config.kubeconfig)
    index = ClusterIndex()
    for path, handler in (("/api/v1/services", index.on_service),
                          ("/apis/discovery.k8s.io/v1/endpointslices", index.on_slice)):
        threading.Thread(target=informer, args=(api, path, handler, stop.is_set), daemon=True,
                         name=f"watch{path}").start()
    resolver = ClusterResolver(index)
    quiet = DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data")
    # Pods reach it at the node's address (kube-dns's endpoint; the node's nft table
    # admits only pods and the host).
    address = "0.0.0.0"
    servers = [DNSServer(resolver, port=config.dns_port, address=address, tcp=tcp, logger=quiet)
               for tcp in (False, True)]
    for s in servers:
        s.start_thread()
    log.info("cluster DNS on %s:%d (service IP %s)", address, config.dns_port, config.dns_service_ip)
    stop.wait()
    for s in servers:
        s.stop()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ClusterConfig.load(Path(sys.argv[1]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    serve(config, stop)


if __name__ == "__main__":
    main()
