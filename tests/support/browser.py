"""A real headless Chromium for page tests, driven through chromedriver's W3C WebDriver
protocol (plain HTTP on loopback, so no client library and nothing that downloads a
browser of its own).

Debian's ``chromium`` and ``chromium-driver`` packages (``/usr/bin/chromium``,
``/usr/bin/chromedriver``) are installed by ``hack/ensure-system-deps.sh``. Chromium
runs headless with a fresh profile and without any of its background connections (this
machine reaches only loopback).
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from tests.support.ports import free_port

CHROMIUM = os.environ.get("KUBESHARD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("KUBESHARD_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,860"]


class BrowserError(AssertionError):
    pass


class Browser:
    """One chromedriver process and one Chromium session with its own profile folder."""

    def __init__(self, timeout: float = 60) -> None:
        for path in (CHROMIUM, CHROMEDRIVER):
            if not os.access(path, os.X_OK):
                raise FileNotFoundError(f"{path} is missing: run hack/ensure-system-deps.sh "
                                        "(Debian packages chromium and chromium-driver)")
        self.profile = tempfile.mkdtemp(prefix="kubeshard-chromium-")
        port = free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}", "--allowed-ips=127.0.0.1"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout)
        self.session = ""
        try:
            self._wait_driver(timeout)
            caps = {"browserName": "chrome", "goog:loggingPrefs": {"browser": "ALL"},
                    "goog:chromeOptions": {"binary": CHROMIUM, "args": [*FLAGS, f"--user-data-dir={self.profile}"]}}
            self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]
        except BaseException:
            self.close()
            raise

    def _wait_driver(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.driver.poll() is not None:
                raise BrowserError(f"chromedriver exited with {self.driver.returncode}")
            try:
                if self.http.get("/status").json()["value"]["ready"]:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise BrowserError(f"chromedriver did not answer within {timeout:.0f}s")

    def _call(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        r = self.http.request(method, path, json=body if body is not None else ({} if method == "POST" else None))
        value = r.json().get("value")
        if r.status_code != 200:
            message = value.get("message", "") if isinstance(value, dict) else value
            raise BrowserError(f"WebDriver {method} {path}: {r.status_code} {str(message)[:600]}")
        return value

    def _session(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        return self._call(method, f"/session/{self.session}{path}", body)

    # --- what tests use

    def get(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def element(self, css: str) -> str:
        found = self._session("POST", "/element", {"using": "css selector", "value": css})
        return next(iter(found.values()))  # the W3C element reference

    def click(self, css: str) -> None:
        self._session("POST", f"/element/{self.element(css)}/click")

    def type(self, css: str, text: str, clear: bool = False) -> None:
        element = self.element(css)
        if clear:
            self._session("POST", f"/element/{element}/clear")
        self._session("POST", f"/element/{element}/value", {"text": text})

    def js(self, script: str, *args: Any) -> Any:
        """Runs ``script`` (a function body; ``arguments`` holds ``args``) in the page."""
        return self._session("POST", "/execute/sync", {"script": script, "args": list(args)})

    def text(self, css: str) -> str:
        """The element's textContent (exact, unlike WebDriver's whitespace-folded text)."""
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(0.1)
        raise BrowserError(f"timed out after {timeout:.0f}s waiting for {what}; last saw {last!r}; "
                           f"console: {self.console()}")

    def console(self) -> list[str]:
        """The page's console messages so far (errors included)."""
        try:
            return [f"{e['level']}: {e['message']}" for e in self._session("POST", "/se/log", {"type": "browser"})]
        except BrowserError:
            return []

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self._session("GET", "/screenshot")))
        return path

    def close(self) -> None:
        if self.session:
            try:
                self._session("DELETE", "")
            except (BrowserError, httpx.HTTPError):
                pass
            self.session = ""
        if self.driver.poll() is None:
            self.driver.terminate()
            try:
                self.driver.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:  # chromedriver's session: a Chromium it left behind goes too
            os.killpg(self.driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.driver.wait()
        self.http.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
