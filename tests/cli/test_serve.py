"""`make run` and `kubeshard serve` end to end: a curl to /generate gets tokens back, and
the README's own curl examples against the default model (SmolLM2-135M-Instruct) give
real text, each within seconds; the playground page is served."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.ports import free_port
from tests.support.processes import Proc, start
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"^kubeshard ready on http://(?P<host>[^:\s]+):(?P<port>\d+)$")


def launch(argv: list[str], timeout: float = 600) -> Proc:
    return start(argv[0], argv, READY, timeout=timeout, cwd=str(ROOT))


def stop(p: Proc) -> int | None:
    """Ctrl-C to the whole session, as a user at a terminal would."""
    if p.proc.poll() is None:
        os.killpg(p.proc.pid, signal.SIGINT)
        try:
            p.proc.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
    return p.proc.returncode


def curl_generate(port: int, prompt: str = "Hello", n: int = 12) -> dict:
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}})
    r = subprocess.run(["curl", "-sS", "--max-time", "120", "-X", "POST", f"http://127.0.0.1:{port}/generate",
                        "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def readme_examples() -> list[str]:
    """The curl commands of the README's first example block (after `make run`), each one
    shell command with its continuation lines."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"Then open the playground.*?```\n(.*?)```", text, re.DOTALL).group(1)
    return re.findall(r"^curl .*?(?<!\\)$", block, re.MULTILINE | re.DOTALL)


def run_example(command: str, port: int) -> tuple[str, float]:
    """Runs a README example as pasted, against ``port``; (stdout, seconds). curl's
    --max-time is a hang guard, not a benchmark (bench/results/default-model.md has those)."""
    pasted = command.replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace("curl ", "curl -sS --max-time 30 ", 1)
    started = time.monotonic()
    r = subprocess.run(["bash", "-c", pasted], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, (pasted, r.stderr)
    return r.stdout, time.monotonic() - started


def test_make_run_answers_a_curl_to_generate():
    port = free_port()
    proc = launch(["make", "--no-print-directory", "run", f"ARGS=--port {port}"])
    try:
        assert proc.match["port"] == str(port)
        out = curl_generate(port)
        assert out["generated_text"] and out["details"]["generated_tokens"] == 12
        assert len(out["details"]["tokens"]) == 12 and all("id" in t for t in out["details"]["tokens"])

        # The README's examples, pasted: the default model answers, in seconds.
        stream_example, chat_example = readme_examples()
        assert "/generate_stream" in stream_example and "/v1/chat/completions" in chat_example
        out, _ = run_example(stream_example, port)
        events = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("data:")]
        assert len(events) == 20 and events[-1]["generated_text"].strip()
        assert sum(c.isalpha() for c in events[-1]["generated_text"]) >= 20  # words, not stray tokens
        out, seconds = run_example(chat_example, port)
        answer = json.loads(out)
        assert answer["model"] == "smollm2-135m-instruct"
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] <= 30
        print(f"README chat example: {seconds:.1f} s: {answer['choices'][0]['message']['content']!r}")

        page = subprocess.run(["curl", "-sS", "--max-time", "30", f"http://127.0.0.1:{port}/"],
                              capture_output=True, text=True)
        assert "<title>kubeshard playground</title>" in page.stdout
    finally:
        assert stop(proc) is not None
    # everything it started is gone: nothing listens on the port any more
    r = subprocess.run(["curl", "-s", "--max-time", "2", f"http://127.0.0.1:{port}/health"], capture_output=True)
    assert r.returncode != 0


def test_serve_sharded_groups_with_replicas(demo_model):
    port = free_port()
    proc = launch([sys.executable, "-m", "kubeshard_shard.cli", "serve", "--model", str(demo_model("llama")),
                      "--port", str(port), "--no-redis", "--shards", "2", "--strategy", "zero3", "--replicas", "2",
                      "--kv-cache-memory", "16MiB"])
    try:
        texts = {curl_generate(port, f"prompt {i}", 6)["generated_text"] for i in range(4)}
        assert all(texts)
    finally:
        stop(proc)


def _serve_shards(launcher: Proc) -> list[psutil.Process]:
    """The launcher's serve-shard children, oldest first."""
    procs = [p for p in psutil.Process(launcher.proc.pid).children(recursive=True)
             if "serve-shard" in " ".join(p.cmdline())]
    return sorted(procs, key=lambda p: p.create_time())


def _ready_replicas(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()["ready_replicas"]


def test_a_killed_shard_restarts_its_group_while_the_other_serves(demo_model):
    """kubeshard serve supervises like the operator: SIGKILL one replica's shard under
    load, and every request still succeeds (the router retries it on the other replica,
    or restarts a non-streaming answer there), the launcher says it restarts that group,
    and the group comes back."""
    port = free_port()
    proc = launch([sys.executable, "-m", "kubeshard_shard.cli", "serve", "--model", str(demo_model("llama")),
                   "--port", str(port), "--no-redis", "--replicas", "2", "--kv-cache-memory", "16MiB"])
    results: list[int] = []
    stop_load = threading.Event()

    def load(worker: int) -> None:
        with httpx.Client(timeout=120) as client:
            i = 0
            while not stop_load.is_set():
                r = client.post(f"http://127.0.0.1:{port}/generate", json={
                    "inputs": f"worker {worker} request {i}", "parameters": {"max_new_tokens": 16}})
                results.append(r.status_code)
                i += 1

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    try:
        assert _ready_replicas(port) == 2
        for w in workers:
            w.start()
        time.sleep(2)
        victim = _serve_shards(proc)[-1]
        victim.kill()
        assert wait_for(lambda: "restarting group" in proc.output, timeout=30), proc.output[-3000:]
        assert wait_for(lambda: "is serving again" in proc.output, timeout=180), proc.output[-3000:]
        assert wait_for(lambda: _ready_replicas(port) == 2, timeout=60)
        time.sleep(1)
    finally:
        stop_load.set()
        for w in workers:
            w.join(timeout=150)
        stop(proc)
    assert len(results) > 20 and set(results) == {200}, sorted(set(results))
    assert proc.proc.returncode is not None
