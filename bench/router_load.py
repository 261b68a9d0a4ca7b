"""Load-generation helpers for the router benchmark: a minimal keep-alive HTTP/1.1 client
(so the client's own cost stays small next to the router's), a direct gRPC client for the
baseline, and latency summaries. Loopback only."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Optional

from grpc import aio

from bench.common import percentile
from kubeshard_proto import pb, pb_grpc


@dataclass
class Sample:
    ttft: float        # seconds to the first token event
    total: float       # seconds to the end of the stream
    events: int
    ok: bool
    status: int = 200


class RawHTTP:
    """One keep-alive connection; POSTs and reads (chunked) SSE or JSON responses."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except Exception:
                pass

    def _request(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body

    async def post(self, path: str, body: bytes, headers: Optional[dict[str, str]] = None) -> Sample:
        if self.writer is None:
            await self.connect()
        assert self.reader is not None and self.writer is not None
        start = time.perf_counter()
        self.writer.write(self._request(path, body, headers or {}))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        first: Optional[float] = None
        events = 0
        ok = status == 200
        if b"transfer-encoding: chunked" in lower:
            while True:
                size_line = await self.reader.readuntil(b"\r\n")
                size = int(size_line.strip(), 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                n = chunk.count(b"data:")
                if n and first is None:
                    first = time.perf_counter()
                events += n
                if b'"error' in chunk:
                    ok = False
        else:
            marker = b"content-length:"
            i = lower.index(marker) + len(marker)
            length = int(lower[i: lower.index(b"\r\n", i)])
            await self.reader.readexactly(length)
            first = time.perf_counter()
            events = 1
        end = time.perf_counter()
        if b"connection: close" in lower:
            await self.close()
            self.writer = None
        return Sample(ttft=(first or end) - start, total=end - start, events=events, ok=ok, status=status)


class DirectGRPC:
    """The baseline: the same stream straight from the backend over gRPC."""

    def __init__(self, address: str) -> None:
        self.channel = aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 28)])
        self.stub = pb_grpc.TextGenerationStub(self.channel)

    async def generate(self, input_ids: list[int], max_new_tokens: int) -> Sample:
        request = pb.GenerateRequest(request_id="bench", input_ids=input_ids,
                                     sampling=pb.SamplingParameters(do_sample=False),
                                     stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))
        start = time.perf_counter()
        first: Optional[float] = None
        events = 0
        ok = False
        call = self.stub.Generate(request, timeout=120)
        while True:
            token = await call.read()
            if token is aio.EOF:
                break
            if first is None:
                first = time.perf_counter()
            events += 1
            if token.HasField("finish"):
                ok = True
        end = time.perf_counter()
        return Sample(ttft=(first or end) - start, total=end - start, events=events, ok=ok)

    async def close(self) -> None:
        await self.channel.close()


def summary_ms(samples: list[Sample]) -> dict:
    ttft = [s.ttft for s in samples]
    total = [s.total for s in samples]
    return {"n": len(samples), "errors": sum(1 for s in samples if not s.ok),
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "total_p50_ms": percentile(total, 50) * 1e3, "total_p99_ms": percentile(total, 99) * 1e3,
            "total_mean_ms": sum(total) / max(1, len(total)) * 1e3}
