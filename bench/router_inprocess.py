"""The router's own cost, without any gRPC: the real app on uvicorn in a child process,
with a stand-in replica client that hands over 16 ready Token messages (named as such: it
isolates the router's HTTP/SSE, validation, balancing and bookkeeping from the grpcio
client library). Used by ``bench.router_bench inprocess``."""

from __future__ import annotations

import asyncio
import multiprocessing

import orjson
import psutil
from grpc import aio

from bench.router_load import RawHTTP, percentile
from kubeshard_proto import pb

TOKENS = 16


class _ReadyCall:
    def __init__(self, tokens: list) -> None:
        self.tokens, self.i = tokens, 0

    async def read(self):
        if self.i >= len(self.tokens):
            return aio.EOF
        self.i += 1
        return self.tokens[self.i - 1]

    def cancel(self) -> None:
        pass


class InstantReplicaClient:
    """Stand-in for ReplicaClient: Info from the StubBackend service, tokens ready at once."""

    def __init__(self, address: str) -> None:
        from tests.support.stub_backend import StubBehaviour, StubCounters, StubService
        self.address = address
        self.service = StubService(model_id="m", revision="r", max_input_tokens=200, max_total_tokens=256,
                                   max_concurrent_requests=4096, block_size=16, behaviour=StubBehaviour(),
                                   counters=StubCounters(), keep_requests=False)
        self.tokens = [pb.Token(id=5, text=" the", logprob=-0.3, index=i) for i in range(TOKENS)]
        self.tokens[-1].finish.CopyFrom(pb.FinishDetails(reason=pb.FINISH_REASON_LENGTH, generated_tokens=TOKENS))

    async def info(self):
        return await self.service.Info(None, None)

    async def health(self):
        return pb.HealthResponse(serving=True)

    def generate(self, request, timeout_s):
        return _ReadyCall(self.tokens)

    async def close(self) -> None:
        pass


def _serve(queue) -> None:
    import uvicorn
    import uvloop

    import kubeshard_router.state as state_module
    from kubeshard_router.app import create_app
    from kubeshard_router.backends.registry import Registry
    from kubeshard_router.config import RouterConfig

    class InstantRegistry(Registry):
        def __init__(self, config, **kwargs) -> None:
            super().__init__(config, client_factory=InstantReplicaClient)

    state_module.Registry = InstantRegistry
    app = create_app(RouterConfig(port=0, backends={"m": ("instant:1",)}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http="httptools",
                                           log_level="warning", access_log=False))

    async def go() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        await app.state.kubeshard.wait_static_ready()
        await asyncio.sleep(0.5)
        queue.put(server.servers[0].sockets[0].getsockname()[1])
        await task

    uvloop.run(go())


def bench_inprocess(requests: int = 3000) -> dict:
    queue: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=_serve, args=(queue,), daemon=True)
    proc.start()
    port = queue.get(timeout=60)
    body = orjson.dumps({"inputs": "hello world, this is the router benchmark prompt",
                         "parameters": {"max_new_tokens": TOKENS}})
    out = {"tokens_per_stream": TOKENS}
    try:
        for path in ("/generate_stream", "/generate"):
            async def run(n: int) -> list:
                c = RawHTTP("127.0.0.1", port)
                await c.connect()
                samples = [await c.post(path, body) for _ in range(n)]
                await c.close()
                return samples
            asyncio.run(run(300))
            p = psutil.Process(proc.pid)
            cpu0 = sum(p.cpu_times()[:2])
            samples = asyncio.run(run(requests))
            cpu = sum(p.cpu_times()[:2]) - cpu0
            out[path] = {"p50_ms": percentile([s.total for s in samples], 0.5) * 1e3,
                         "p99_ms": percentile([s.total for s in samples], 0.99) * 1e3,
                         "ttft_p50_ms": percentile([s.ttft for s in samples], 0.5) * 1e3,
                         "router_cpu_ms_per_request": cpu / requests * 1e3,
                         "errors": sum(1 for s in samples if not s.ok)}
    finally:
        proc.terminate()
    return out
