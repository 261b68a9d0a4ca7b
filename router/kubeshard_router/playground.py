"""The playground: ``GET /`` serves a one-file chat page (``playground.html``, a package
resource: HTML, style and script inline, no external assets, no build step).

The page lists the models from ``/v1/models``, streams answers from
``/v1/chat/completions`` (SSE) and shows time to first token and output tokens per second;
an API key typed into it is sent as ``Authorization: Bearer`` and kept nowhere else.
``POST /`` stays TGI's compat route (``tgi_api``). The page is served with a strict
Content-Security-Policy: its own inline script and style (by hash) and requests to this
router only.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

PAGE = "playground.html"

router = APIRouter(tags=["Playground"])


def _hashes(html: str, tag: str) -> str:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'"
                    for b in blocks)


@functools.cache
def page() -> tuple[bytes, dict[str, str]]:
    """The page's bytes and its headers (read and hashed once per process)."""
    html = resources.files("kubeshard_router").joinpath(PAGE).read_text(encoding="utf-8")
    csp = (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    headers = {"content-security-policy": csp, "cache-control": "no-cache",
               "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}
    return html.encode("utf-8"), headers


@router.get("/", response_class=HTMLResponse,
            summary="The playground: a chat page that streams from /v1/chat/completions")
async def playground() -> Response:
    body, headers = page()
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)
