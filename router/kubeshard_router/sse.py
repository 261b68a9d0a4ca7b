"""Server-sent events: encoding, and a response that stops its producer when the client leaves.

``EventStreamResponse`` pulls the first chunk *before* sending headers, so an error that
happens before the first token (overloaded, no replica, backend failure) still gets its
proper status code and JSON body; after that, errors are the producer's to send as
events. A second task waits on ``receive()`` for ``http.disconnect`` and cancels the
streaming task, so a client that goes away while the backend is still thinking (no
chunk to fail on) cancels the backend call at once. Closing the iterator runs the
producer's ``finally`` blocks.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Mapping, Optional

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kubeshard_router.errors import RouterError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], *, render_error: Callable[[RouterError], Response],
                 headers: Optional[Mapping[str, str]] = None,
                 late_headers: Optional[Callable[[], Mapping[str, str]]] = None,
                 on_disconnect: Optional[Callable[[], None]] = None) -> None:
        # As StreamingResponse does: no body, so no Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.chunks = chunks
        self.late_headers = late_headers  # evaluated once the first chunk exists (cache status, ...)
        self.render_error = render_error
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        disconnected = False
        finished = False

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not finished:
                        disconnected = True
                        if task is not None:
                            task.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            try:
                first: Optional[bytes] = await self.chunks.__anext__()
            except StopAsyncIteration:
                first = None
            except RouterError as exc:
                finished = True
                await self.render_error(exc)(scope, receive, send)
                return
            headers = self.raw_headers
            if self.late_headers is not None:
                headers = headers + [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                     for k, v in self.late_headers().items()]
            await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected:
                raise
            if task is not None:
                task.uncancel()
            if self.on_disconnect is not None:
                self.on_disconnect()
        except OSError:
            if self.on_disconnect is not None:
                self.on_disconnect()
        finally:
            watcher.cancel()
            await self.chunks.aclose()  # type: ignore[attr-defined]
