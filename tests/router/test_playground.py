"""``GET /`` serves the playground page: self-contained (no external asset, a strict CSP
that allows only its own inline script and style), while ``POST /`` stays TGI's route
and the OpenAPI docs keep working. The page in a real browser: test_playground_browser.py."""

from __future__ import annotations

import base64
import hashlib
import re

import httpx

from kubeshard_router.playground import page


def test_get_root_serves_the_page_and_post_root_stays_tgi(router):
    r = httpx.get(router.url + "/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>kubeshard playground</title>" in r.text
    for needed in ('"v1/models"', '"v1/chat/completions"', "stream: true", 'id="ttft"', 'id="tps"',
                   'id="model"', 'id="temperature"', 'id="max-tokens"', 'id="api-key"', '"Authorization"'):
        assert needed in r.text, needed

    tgi = httpx.post(router.url + "/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert tgi.status_code == 200 and isinstance(tgi.json(), list) and "generated_text" in tgi.json()[0]
    spec = httpx.get(router.url + "/openapi.json").json()
    assert {"get", "post"} <= set(spec["paths"]["/"])
    assert httpx.get(router.url + "/docs").status_code == 200


def test_the_page_loads_nothing_from_elsewhere():
    html = page()[0].decode()
    # No src/href but the empty data: favicon (nothing to fetch but the routes it calls), no absolute URL.
    assert re.findall(r"\b(?:src|href)\s*=\s*\"([^\"]*)\"", html, re.I) == ["data:,"]
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.I)
    assert "@import" not in html and "url(" not in html


def test_csp_allows_exactly_the_inline_script_and_style(router):
    r = httpx.get(router.url + "/")
    csp = dict(part.strip().split(" ", 1) for part in r.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    for tag in ("script", "style"):
        (block,) = re.findall(rf"<{tag}>(.*?)</{tag}>", r.text, flags=re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
        assert csp[f"{tag}-src"] == f"'sha256-{digest}'"
    assert r.headers["x-content-type-options"] == "nosniff"


def test_the_page_never_stores_the_api_key():
    html = page()[0].decode()
    assert "localStorage" not in html and "sessionStorage" not in html and "document.cookie" not in html
    assert "console." not in html  # nothing logged in the browser either
