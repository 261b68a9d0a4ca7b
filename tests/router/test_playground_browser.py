"""The playground page in a real browser: headless Chromium (Debian's chromium and
chromium-driver) loads ``/`` from a router in front of a real shard server, sends a
message, and the streamed answer appears with its time to first token and tokens/s;
with API keys configured, the page asks for one and then works.

Screenshots land in the test's tmp dir and in ``tests/artifacts/`` (``KUBESHARD_TEST_ARTIFACTS``
overrides; the folder is git-ignored)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.servers import start_router, start_shard
from tests.support.browser import Browser

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("KUBESHARD_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts"))
MAX_TOKENS = 24
KEY = "sk-playground-secret-4242"


@pytest.fixture(scope="module")
def shard(demo_model):
    proc = start_shard(demo_model("llama"))
    yield proc
    proc.stop()


@pytest.fixture
def browser():
    with Browser() as b:
        yield b


def save_screenshot(browser: Browser, tmp_path: Path, name: str) -> Path:
    shot = browser.screenshot(tmp_path / name)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)
    return shot


def models_listed(browser: Browser) -> list[str]:
    return browser.js("return [...document.querySelectorAll('#model option')].map(o => o.value);")


def answers_done(browser: Browser) -> int:
    """Assistant messages whose stream ended (with figures or an error), once none runs."""
    return browser.js("""
        if (!document.getElementById('stop').disabled) return 0;
        return [...document.querySelectorAll('.msg.assistant')]
            .filter(m => m.classList.contains('error') || m.querySelector('.figures').textContent).length;""")


def chat(browser: Browser, message: str, turn: int = 1) -> str:
    """Sets greedy decoding and MAX_TOKENS, sends ``message``, waits for the end of the
    stream, returns the assistant's text as the page shows it."""
    browser.type("#temperature", "0", clear=True)
    browser.type("#max-tokens", str(MAX_TOKENS), clear=True)
    browser.type("#prompt", message)
    browser.click("#send")
    browser.wait(f"answer {turn} to end", lambda: answers_done(browser) >= turn, timeout=120)
    return browser.js("const a = document.querySelectorAll('.msg.assistant .text'); return a[a.length - 1].textContent;")


def greedy_answer(router_url: str, message: str, headers: dict | None = None) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": message}], "temperature": 0,
            "max_tokens": MAX_TOKENS}
    r = httpx.post(router_url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_page_streams_an_answer_and_shows_ttft_and_tokens_per_second(shard, browser, tmp_path):
    router = start_router("--backend", f"tiny={shard.address}", "--no-redis")
    try:
        browser.get(router.url + "/")
        assert browser.wait("the model list", lambda: models_listed(browser)) == ["tiny"]
        assert browser.text("#status") == "1 model"

        answer = chat(browser, "Hello from a real browser")
        assert browser.text("#status") == "done", browser.console()
        # The streamed text is the whole greedy answer, exactly what the non-streaming API gives.
        assert answer and answer == greedy_answer(router.url, "Hello from a real browser")
        assert re.fullmatch(r"\d+ ms", browser.text("#ttft"))
        assert re.fullmatch(r"\d+\.\d tokens/s", browser.text("#tps"))
        assert float(browser.text("#tps").split()[0]) > 0
        assert browser.text("#tokens") == str(MAX_TOKENS)
        assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tokens/s · 24 tokens", browser.text(".msg.assistant .figures"))
        save_screenshot(browser, tmp_path, "playground.png")

        # A second turn carries the conversation (the first question and answer are sent again).
        second = chat(browser, "And a second question", turn=2)
        assert second and browser.text("#status") == "done"
        assert browser.js("return document.querySelectorAll('.msg.user').length;") == 2
        errors = [line for line in browser.console() if line.startswith("SEVERE")]
        assert errors == []
    finally:
        router.stop()
    assert "Traceback" not in router.output


def test_with_api_keys_the_page_asks_for_one_and_never_keeps_it(shard, browser, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - name: playground\n    key: {KEY}\n")
    router = start_router("--backend", f"tiny={shard.address}", "--no-redis", "--api-keys-file", str(keys),
                          "--log-level", "debug")
    try:
        browser.get(router.url + "/")  # the page itself needs no key
        browser.wait("the request for a key", lambda: "needs an API key" in (browser.text("#status") or ""))
        assert models_listed(browser) == []
        assert "wanted" in browser.js("return document.getElementById('api-key').className;")

        browser.type("#api-key", "sk-wrong")
        browser.click("#reload")
        browser.wait("the refusal", lambda: "needs an API key" in browser.text("#status"))
        browser.type("#api-key", KEY, clear=True)
        browser.click("#reload")
        assert browser.wait("the model list", lambda: models_listed(browser)) == ["tiny"]

        answer = chat(browser, "Hello with a key")
        assert browser.text("#status") == "done", browser.console()
        assert answer == greedy_answer(router.url, "Hello with a key", {"Authorization": f"Bearer {KEY}"})
        assert re.fullmatch(r"\d+ ms", browser.text("#ttft"))
        save_screenshot(browser, tmp_path, "playground-api-key.png")
        # Not in the URL, not in any browser storage.
        assert browser.js("return location.href;") == router.url + "/"
        assert browser.js("return localStorage.length + sessionStorage.length;") == 0
        assert KEY not in browser.js("return document.cookie;")
    finally:
        router.stop()
    assert KEY not in router.output and "sk-wrong" not in router.output  # never logged, even at debug
