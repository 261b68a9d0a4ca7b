"""The operator's LoadReader against real routers (the router's own app on loopback) and
a real Redis: the key layout the router writes is the one the reader reads, and with
Redis stopped the reader asks the router pods directly."""

from __future__ import annotations

import threading

import httpx

from e2e.waiting import wait_for
from kubeshard_operator.load import LoadReader
from tests.support.router_harness import RouterHarness


class Slices:
    """Stands in for the Kube helper's EndpointSlice list of the router Service."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def list(self, kind, namespace, selector):
        assert (kind, namespace, selector) == ("EndpointSlice", "ks",
                                               {"kubernetes.io/service-name": "router"})
        return [{"ports": [{"name": "http", "port": p}],
                 "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]}
                for p in self.ports]


def _stream(url: str, n: int) -> threading.Thread:
    def run() -> None:
        with httpx.Client(timeout=60) as c:
            c.post(url + "/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": n}})
    t = threading.Thread(target=run)
    t.start()
    return t


def test_reads_the_routers_load_from_redis_then_directly_when_redis_stops(redis_server, redis_url, tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken")
    routers = [RouterHarness(redis_url=redis_url, counters_interval_s=0.1, router_id=f"r{i}",
                             load_token_file=str(token), redis_retry_s=0.3).start() for i in range(2)]
    try:
        for h in routers:
            h.stub().behaviour.token_delay_s = 0.1
        reader = LoadReader(redis_url=redis_url, kube=Slices([h.port for h in routers]),
                            router_service=("ks", "router"), token_file=str(token), cache_s=0.0,
                            redis_retry_s=0.5)
        idle = wait_for(lambda: (load := reader.read("stub")) and load.routers == 2 and load, 10,
                        what="both routers in Redis")
        assert (idle.concurrency, idle.source) == (0, "redis")
        streams = [_stream(routers[0].url, 30), _stream(routers[1].url, 30), _stream(routers[1].url, 30)]
        busy = wait_for(lambda: (load := reader.read("stub")) and load.concurrency == 3 and load, 10,
                        what="three streams summed over both routers")
        assert 0 < busy.tokens_in_flight <= 3 * (30 + 8) and busy.last_request_at > 0
        for t in streams:
            t.join()
        assert wait_for(lambda: reader.read("stub").concurrency == 0, 10, what="the load to drain")

        redis_server.stop()
        streams = [_stream(routers[0].url, 30), _stream(routers[1].url, 30)]
        direct = wait_for(lambda: (load := reader.read("stub")) and load.concurrency == 2 and load, 10,
                          what="the load asked from the routers directly")
        assert direct.source == "routers" and direct.routers == 2
        for t in streams:
            t.join()
        # Neither source: no answer at all (not a zero).
        assert LoadReader(redis_url=redis_url, kube=Slices([]), router_service=("ks", "router"),
                          token_file=None).read("stub") is None
    finally:
        redis_server.start()
        for h in routers:
            h.close()
