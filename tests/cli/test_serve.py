"""`make run` and `kubeshard serve` end to end: a curl to /generate gets tokens back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def launch(argv: list[str], timeout: float = 600) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("kubeshard ready on http://"):
            return proc, lines
        if time.monotonic() > deadline:
            break
    stop(proc)
    raise AssertionError("never ready:\n" + "".join(lines)[-5000:])


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def curl_generate(port: int, prompt: str = "Hello", n: int = 12) -> dict:
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}})
    r = subprocess.run(["curl", "-sS", "--max-time", "120", "-X", "POST", f"http://127.0.0.1:{port}/generate",
                        "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_make_run_answers_a_curl_to_generate():
    port = free_port()
    proc, lines = launch(["make", "--no-print-directory", "run", f"ARGS=--port {port}"])
    try:
        assert f"kubeshard ready on http://127.0.0.1:{port}" in lines[-1]
        out = curl_generate(port)
        assert out["generated_text"] and out["details"]["generated_tokens"] == 12
        assert len(out["details"]["tokens"]) == 12 and all("id" in t for t in out["details"]["tokens"])
    finally:
        assert stop(proc) is not None
    # everything it started is gone: nothing listens on the port any more
    r = subprocess.run(["curl", "-s", "--max-time", "2", f"http://127.0.0.1:{port}/health"], capture_output=True)
    assert r.returncode != 0


def test_serve_sharded_groups_with_replicas(demo_model):
    port = free_port()
    proc, _ = launch([sys.executable, "-m", "kubeshard_shard.cli", "serve", "--model", str(demo_model("llama")),
                      "--port", str(port), "--no-redis", "--shards", "2", "--strategy", "zero3", "--replicas", "2",
                      "--kv-cache-memory", "16MiB"])
    try:
        texts = {curl_generate(port, f"prompt {i}", 6)["generated_text"] for i in range(4)}
        assert all(texts)
    finally:
        stop(proc)
