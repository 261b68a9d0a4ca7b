"""`Cluster`: what tests hold — a kubeconfig plus kubectl, helm and client helpers.

The same object stands for the local cluster (a real kubelet with containerd) and for
any other cluster named by KUBESHARD_E2E_KUBECONFIG (kind), so tests are written once.
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
