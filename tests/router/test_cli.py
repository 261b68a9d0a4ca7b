"""The ``kubeshard-router`` command: flags, the ready line, graceful drain on SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.ports import free_port
from tests.support.processes import Proc, start
from tests.support.servers import start_router
from tests.support.sse import sse_events
from tests.support.waiting import wait_for

STUB_READY = re.compile(r"stub backend on (?P<host>[^:\s]+):(?P<port>\d+)")


def start_stub(*flags: str) -> Proc:
    return start("stub backend", [sys.executable, "-m", "tests.support.stub_backend", *flags], STUB_READY,
                 timeout=60)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubeshard_router.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_help_lists_the_flags():
    out = run_cli("--help").stdout
    for flag in ("--backend", "--kubernetes", "--namespace", "--default-model", "--redis-url", "--no-redis",
                 "--api-keys-file", "--api-keys-secret", "--rate-limit-rpm", "--rate-limit-tpm",
                 "--max-queue-per-model", "--cache-ttl", "--request-timeout", "--log-level", "--balance"):
        assert flag in out, flag


@pytest.mark.parametrize("args, message", [
    ([], "give at least one --backend"),
    (["--backend", "demo"], "expected MODEL=HOST:PORT"),
    (["--backend", "demo=localhost"], "is not HOST:PORT"),
    (["--backend", "demo=h:1", "--default-model", "other"], "default_model 'other' is not one of the backends"),
    (["--backend", "de mo=h:1"], "invalid model name"),
    (["--backend", "demo=h:1", "--redis-url", "redis://x", "--no-redis"], "exclusive"),
    (["--backend", "demo=h:1", "--api-keys-secret", "just-a-name"], "NAMESPACE/NAME"),
    (["--backend", "demo=h:1", "--cache-ttl", "0"], "cache_ttl_s must be > 0"),
])
def test_bad_flags_exit_2_with_a_message(args, message):
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr


def test_ready_line_waits_for_every_static_backend():
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "kubeshard_router.cli", "--port", "0",
                               "--backend", f"demo=127.0.0.1:{port}", "--no-redis", "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(router.stdout), daemon=True).start()
    stub = None
    try:
        # The router process is up, but its backend is not: no ready line yet.
        time.sleep(1.0)
        assert lines == [] and router.poll() is None
        stub = start_stub("--port", str(port))
        assert wait_for(lambda: len(lines) == 1, timeout=30)
        assert re.fullmatch(r"kubeshard ready on http://127\.0\.0\.1:\d+\n", lines[0])
        url = lines[0].split(" on ")[1].strip()
        r = httpx.post(url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200
    finally:
        router.terminate()
        router.wait(30)
        if stub is not None:
            stub.stop()


def test_the_started_router_freezes_its_startup_heap():
    """Once started, what the router holds for good is out of the garbage collector's
    walks (gc.freeze): its log says how much."""
    stub = start_stub()
    router = None
    try:
        router = start_router("--backend", f"demo={stub.address}", "--no-redis", "--log-level", "info")
        frozen = re.compile(r"startup heap frozen: (\d+) objects")
        assert wait_for(lambda: frozen.search(router.output), timeout=30), router.output[-2000:]
        found = frozen.search(router.output)
        assert int(found.group(1)) > 20_000  # the router's imports alone are ~90,000
        r = httpx.post(router.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200  # and it serves as before
    finally:
        if router is not None:
            router.stop()
        stub.stop()


def test_sigterm_drains_in_flight_streams():
    stub = start_stub("--token-delay", "0.05")
    router = start_router("--backend", f"demo={stub.address}", "--no-redis", "--drain-timeout", "30")
    try:
        events: list = []
        started = threading.Event()

        def consume() -> None:
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", router.url + "/generate_stream",
                              json={"inputs": "hi", "parameters": {"max_new_tokens": 40}}) as r:
                    for event in sse_events(r.iter_lines()):
                        events.append(event)
                        started.set()

        t = threading.Thread(target=consume)
        t.start()
        assert started.wait(30)
        router.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: "draining" in router.output, timeout=10)

        def refused() -> bool:
            try:
                httpx.get(router.url + "/health", timeout=2)
                return False
            except httpx.TransportError:
                return True

        assert wait_for(refused, timeout=10)  # no new connections while draining
        assert t.is_alive() or len(events) == 40
        t.join(60)
        assert len(events) == 40 and events[-1]["generated_text"]  # the stream finished whole
        router.proc.wait(30)
        assert router.proc.returncode is not None
    finally:
        router.stop()
        stub.stop()
