"""`Cluster`: what tests hold — a kubeconfig plus kubectl, helm and client helpers.

The same object stands for the local process-backed cluster and for any other cluster
named by KUBESHARD_E2E_KUBECONFIG (kind), so tests are written once.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

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

    @property
    def _real_node(self) -> bool:
        """The local cluster's node is the real kubelet (logs and exec through the API)."""
        return self.local_config is not None and self.local_config.runtime == "containerd"

    @property
    def process_node(self) -> bool:
        """The local cluster's process-backed node: its ``python:3*`` pods run the
        repository's virtual environment (the kubernetes client, grpcio, kubeshard), where
        kind's and the real node's images are Python alone."""
        return self.is_local and not self._real_node

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

    # ---- API clients ---------------------------------------------------------------------
    def api_client(self) -> "kubernetes.client.ApiClient":
        """A kubernetes.client.ApiClient authenticated as the cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    # ---- pods ----------------------------------------------------------------------------
    def _default_container(self, namespace: str, pod: str) -> str:
        out = self.kubectl("get", "pod", pod, "-n", namespace, "-o",
                           "jsonpath={.metadata.annotations.kubectl\\.kubernetes\\.io/default-container}"
                           "|{.spec.containers[0].name}").stdout
        annotated, _, first = out.partition("|")
        return annotated or first

    def pod_logs(self, namespace: str, pod: str, container: str | None = None, *,
                 previous: bool = False) -> str:
        """The container's log (current run, or the previous one); "" if it has none yet."""
        if not self.is_local or self._real_node:
            args = ["logs", pod, "-n", namespace] + (["-c", container] if container else [])
            return self.kubectl(*args, *(["--previous"] if previous else []), check=False).stdout
        container = container or self._default_container(namespace, pod)
        assert self.local_config is not None
        dirs = sorted(self.local_config.pods_dir.glob(f"{namespace}_{pod}_*"), key=lambda d: d.stat().st_mtime)
        if not dirs:
            return ""
        logs = sorted((dirs[-1] / container).glob("*.log"), key=lambda p: int(p.stem))
        index = -2 if previous else -1
        if len(logs) < -index:
            return ""
        return logs[index].read_text(errors="replace")

    def exec(self, namespace: str, pod: str, *argv: str, container: str | None = None,
             check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run argv inside a running container, like `kubectl exec` (output captured).

        On the local cluster this enters the container's namespaces with nsenter and uses
        its environment (the process-backed node has no exec streaming API).
        """
        if not self.is_local or self._real_node:
            args = ["exec", pod, "-n", namespace] + (["-c", container] if container else [])
            return self.kubectl(*args, "--", *argv, check=check, timeout=timeout)
        from .node.agent import container_pid

        assert self.local_config is not None
        container = container or self._default_container(namespace, pod)
        pid = container_pid(self.local_config, namespace, pod, container)
        env = dict(_environ(pid))
        cwd = os.readlink(f"/proc/{pid}/cwd")
        return _run(["nsenter", "-t", str(pid), "-n", "-m", "-u", f"--wd={cwd}", "--", *argv],
                    input=None, check=check, timeout=timeout, env=env)

    def pod_pids(self, namespace: str, pod: str) -> list[int]:
        """Local cluster only: pids of the pod's live container processes."""
        assert self.local_config is not None, "pod_pids needs the local cluster"
        if self._real_node:
            from .kubelet import RealNode

            return RealNode(self.local_config).pod_pids(namespace, pod)
        pids = []
        for pid_file in self.local_config.pods_dir.glob(f"{namespace}_{pod}_*/*/pid"):
            pid = int(pid_file.read_text())
            if _alive(pid):
                pids.append(pid)
        return pids


def _environ(pid: int) -> list[tuple[str, str]]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    out = []
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, _, v = item.decode(errors="replace").partition("=")
            out.append((k, v))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
