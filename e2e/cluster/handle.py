"""`Cluster`: what tests hold — a kubeconfig plus kubectl, helm and client helpers.

The same object stands for the local cluster (a real kubelet with containerd) and for
any other cluster named by KUBESHARD_E2E_KUBECONFIG (kind), so tests are written once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import kubernetes.client

    from .config import ClusterConfig


class CommandFailed(AssertionError):
    """A kubectl/helm/exec call failed; the message carries its stdout and stderr."""


def _run(argv: list[str], *, input: str | None, check: bool, timeout: float,
         env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, input=input, text=True, capture_output=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise CommandFailed(
            f"`{shlex.join(argv)}` did not finish within {timeout:g} s\n"
            f"--- stdout ---\n{e.stdout or ''}\n--- stderr ---\n{e.stderr or ''}") from None
    if check and proc.returncode != 0:
        raise CommandFailed(
            f"`{shlex.join(argv)}` exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc


class Cluster:
    def __init__(self, kubeconfig: str, bin_dir: Path, *, is_local: bool,
                 local_config: "ClusterConfig | None" = None) -> None:
        self.kubeconfig = str(kubeconfig)
        self.bin_dir = Path(bin_dir)
        self.is_local = is_local
        self.local_config = local_config

    def __repr__(self) -> str:
        return f"Cluster(kubeconfig={self.kubeconfig!r}, is_local={self.is_local})"

    # ---- command-line tools ------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ, KUBECONFIG=self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '')}"
        if self.local_config is not None:
            # helm's repositories and cache stay with the cluster, not in $HOME.
            helm = self.local_config.state_dir / "helm"
            env.update(HELM_CACHE_HOME=str(helm / "cache"), HELM_CONFIG_HOME=str(helm / "config"),
                       HELM_DATA_HOME=str(helm / "data"))
        return env

    def _tool(self, name: str) -> str:
        path = self.bin_dir / name
        if path.exists():
            return str(path)
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} is neither in {self.bin_dir} nor on PATH")
        return found

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster (text mode, output captured)."""
        return _run([self._tool("kubectl"), *args], input=input, check=check, timeout=timeout, env=self._env())

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run helm against this cluster (text mode, output captured)."""
        return _run([self._tool("helm"), *args], input=None, check=check, timeout=timeout, env=self._env())

    @contextlib.contextmanager
    def port_forward(self, namespace: str, target: str, port: int, timeout: float = 30) -> Iterator[int]:
        """`kubectl port-forward` of target's port (e.g. "pod/x") to a free port on
        127.0.0.1, which it yields: how a test on this machine reaches a pod on any cluster
        (pod addresses are routed here only on the local node)."""
        proc = subprocess.Popen([self._tool("kubectl"), "-n", namespace, "port-forward", "--address", "127.0.0.1",
                                 target, f":{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self._env())
        try:
            ready: list[int] = []
            reader = threading.Thread(target=lambda: ready.extend(
                int(m.group(1)) for line in proc.stdout
                if (m := re.match(r"Forwarding from 127\.0\.0\.1:(\d+) ", line))), daemon=True)
            reader.start()
            deadline = time.monotonic() + timeout
            while not ready:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise CommandFailed(f"kubectl port-forward {target} :{port} did not start: "
                                        f"{proc.stderr.read()[-2000:]}")
                time.sleep(0.1)
            yield ready[0]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ---- API clients ---------------------------------------------------------------------
    def api_client(self) -> "kubernetes.client.ApiClient":
        """A kubernetes.client.ApiClient authenticated as the cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    # ---- pods ----------------------------------------------------------------------------
    def pod_logs(self, namespace: str, pod: str, container: str | None = None, *,
                 previous: bool = False) -> str:
        """The container's log (current run, or the previous one); "" if it has none yet."""
        args = ["logs", pod, "-n", namespace] + (["-c", container] if container else [])
        return self.kubectl(*args, *(["--previous"] if previous else []), check=False).stdout

    def exec(self, namespace: str, pod: str, *argv: str, container: str | None = None,
             check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run argv inside a running container with `kubectl exec` (output captured)."""
        args = ["exec", pod, "-n", namespace] + (["-c", container] if container else [])
        return self.kubectl(*args, "--", *argv, check=check, timeout=timeout)

    def pod_pids(self, namespace: str, pod: str) -> list[int]:
        """Local cluster only: pids of the pod's live container processes."""
        assert self.local_config is not None, "pod_pids needs the local cluster"
        from .kubelet import RealNode

        return RealNode(self.local_config).pod_pids(namespace, pod)

    def kill_pod(self, namespace: str, pod: str) -> int:
        """SIGKILL the pod's running container processes, as a crash or the kernel's OOM
        killer would (the API's delete is graceful: SIGTERM first, and a draining server
        finishes what it holds). The local node's through its CRI from here; a kind node's
        through its CRI inside the node's container (`docker exec`). Returns how many were
        killed; other clusters have no way to do it and raise."""
        if self.local_config is not None:
            killed = 0
            for pid in self.pod_pids(namespace, pod):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            return killed
        node = json.loads(self.kubectl("-n", namespace, "get", "pod", pod, "-o", "json").stdout)["spec"]["nodeName"]
        provider = json.loads(self.kubectl("get", "node", node, "-o", "json").stdout)["spec"].get("providerID", "")
        if not provider.startswith("kind://docker/"):
            raise CommandFailed(f"kill_pod needs the local cluster or a kind node; node {node} is {provider!r}")

        def in_node(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
            return _run(["docker", "exec", node, *argv], input=None, check=check, timeout=60,
                        env=dict(os.environ))

        killed = 0
        for sandbox in in_node("crictl", "pods", "--namespace", namespace, "--name", f"^{pod}$", "-q",
                               "--state", "ready").stdout.split():
            for container in in_node("crictl", "ps", "--pod", sandbox, "-q", "--state", "running").stdout.split():
                pid = json.loads(in_node("crictl", "inspect", container).stdout).get("info", {}).get("pid")
                if pid and in_node("kill", "-9", str(pid), check=False).returncode == 0:
                    killed += 1
        return killed
