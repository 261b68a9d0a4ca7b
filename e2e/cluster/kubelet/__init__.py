"""A real node: the kubelet (built from the pinned k8s.io/kubernetes), containerd, runc
through hack/runc-wrapper, and the CNI ptp plugin; kube-proxy runs beside it (local.py).

    node = RealNode(config)
    node.prepare()                 # build or reuse crictl, the wrapper and the images
    node.start(pki, api, spawn)    # network, containerd (+ images), kubelet; Node Ready
    node.stop()                    # pods, containerd, mounts, cgroups, network: all gone

One node per cluster (one kubelet per machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from kubeshard_shard.paths import cache_root

from .. import processes
from ..certs import Pki
from ..config import REPO_ROOT, ClusterConfig
from . import containerd, kubelet, netpol, network

ADDONS = ("containerd", "kubelet", "network-policy")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class NodeError(RuntimeError):
    pass


def _hack(script: str, *args: str, timeout: float = 3600) -> list[str]:
    proc = subprocess.run([str(REPO_ROOT / "hack" / script), *args], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise NodeError(f"hack/{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.split()


class RealNode:
    def __init__(self, config: ClusterConfig) -> None:
        if config.nodes != 1:
            raise NodeError("the containerd runtime runs one node (one kubelet per machine); "
                            f"asked for {config.nodes}")
        self.c = config
        self.node = config.node_specs[0]
        bin_dir = cache_root() / "node" / "bin"  # hack/node-tools.sh's
        self.crictl = bin_dir / "crictl"
        self.runc_wrapper = bin_dir / "runc-wrapper"
        self.kube_router = bin_dir / "kube-router"
        self.tarballs: list[Path] = []

    # ---- build --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Tools and images, built or reused (hack/node-tools.sh, hack/images.sh)."""
        missing = [t for t in ("containerd", "ctr", "runc") if shutil.which(t) is None]
        if missing or not Path("/usr/lib/cni/ptp").exists():
            _hack("ensure-system-deps.sh", "--containers")
        tools = _hack("node-tools.sh", "runc-wrapper", "crictl", "kube-router")
        self.runc_wrapper, self.crictl, self.kube_router = (Path(t) for t in tools)
        # KUBESHARD_NODE_IMAGES (image groups of hack/images.sh) narrows it while debugging.
        groups = os.environ.get("KUBESHARD_NODE_IMAGES", "").split()
        self.tarballs = [Path(p) for p in _hack("images.sh", *groups)]

    # ---- start --------------------------------------------------------------------------
    def network_setup(self) -> None:
        """Before the control plane: the node's address, routes and nft table."""
        for stale in (self.c.state_dir / "cni", kubelet.pod_logs_dir(self.c)):
            shutil.rmtree(stale, ignore_errors=True)
        network.setup(self.c)

    def start(self, pki: Pki, spawn: Callable[[str, list[str]], None], timeout: float) -> None:
        from ..controlplane import wait_healthy

        c = self.c
        self._make_cgroups()
        c.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = c.state_dir / "containerd.toml"
        config_path.write_text(containerd.config_toml(c, self.runc_wrapper, c.state_dir / "cni" / "net.d"))
        spawn("containerd", containerd.argv(c, config_path))
        wait_healthy("containerd", lambda: (containerd.ctr(c, "version", timeout=10).returncode == 0,
                                            "containerd not answering yet"), c, timeout)
        containerd.import_images(c, self.tarballs)
        kubelet.root_dir(c).mkdir(parents=True, exist_ok=True)
        spawn("kubelet", kubelet.argv(c, self.node, kubelet.write_config(c, self.node, pki)))

    def start_network_policy(self, api, spawn: Callable[[str, list[str]], None], timeout: float) -> None:
        """kube-router's firewall, once the Node (and its podCIDR) exists."""
        from ..controlplane import _http_get, wait_healthy
        from ..api import ApiError

        for path, obj in netpol.rbac_objects():
            try:
                api.create(path, obj)
            except ApiError as e:
                if e.status != 409:
                    raise
        spawn("network-policy", netpol.argv(self.c, self.kube_router))
        wait_healthy("network-policy",
                     lambda: (lambda r: (r[0] == 200, r[1]))(_http_get(self.c.netpol_healthz_port, "/healthz")),
                     self.c, timeout)

    def advertise_gpus(self, api) -> None:
        """Fake `nvidia.com/gpu` capacity, the way extended resources are advertised."""
        if not self.node.gpus:
            return
        api.patch(f"/api/v1/nodes/{self.node.name}/status",
                  {"status": {"capacity": {"nvidia.com/gpu": str(self.node.gpus)}}}, kind="merge-patch")

    def _cgroup_dirs(self) -> list[Path]:
        root = kubelet.cgroup_root(self.c).lstrip("/")
        return [d / root for d in sorted(CGROUP_ROOT.iterdir())
                if d.is_dir() and not d.is_symlink() and (d / "cgroup.procs").exists()]

    def _make_cgroups(self) -> None:
        for d in self._cgroup_dirs():
            d.mkdir(exist_ok=True)
            if d.parent.name == "cpuset":  # a child cpuset has no CPUs until given some
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((d.parent / f).read_text())

    # ---- stop ---------------------------------------------------------------------------
    def stop(self) -> None:
        c = self.c
        processes.stop("network-policy", c.pid_dir, timeout=10.0)
        netpol.cleanup()
        processes.stop("kubelet", c.pid_dir, timeout=15.0)
        if processes.running("containerd", c.pid_dir) is not None and self.crictl.exists():
            containerd.remove_all_pods(c, self.crictl)
        processes.stop("containerd", c.pid_dir, timeout=15.0)
        for pid in self._shims():
            processes.terminate(pid, timeout=5.0)
        self._unmount_all()
        self._remove_cgroups()
        network.teardown(c)
        shutil.rmtree(c.run_dir, ignore_errors=True)

    def _shims(self) -> list[int]:
        """containerd-shim processes of this containerd (they name its socket)."""
        marker = str(containerd.socket(self.c)).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and any(marker in a for a in argv):
                found.append(int(entry.name))
        return found

    def _mounts(self) -> list[str]:
        roots = (str(self.c.state_dir) + "/", str(self.c.run_dir) + "/")
        points = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(roots):
                points.append(point)
        return points

    def _unmount_all(self) -> None:
        for point in sorted(self._mounts(), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)

    def _remove_cgroups(self) -> None:
        for top in self._cgroup_dirs():
            if not top.exists():
                continue
            # Deepest first; a cgroup with live processes cannot go (they are killed above).
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                            reverse=True) + [top]:
                for _ in range(20):
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        for pid in (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else ():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except (ProcessLookupError, ValueError):
                                pass
                        time.sleep(0.1)

    def leftovers(self) -> list[str]:
        found = network.leftovers(self.c)
        found += [f"iptables chain {x}" for x in netpol.chains()]
        found += [f"ipset {x}" for x in netpol.ipsets()]
        found += [f"containerd-shim process {p}" for p in self._shims()]
        found += [f"mount {m}" for m in self._mounts()]
        found += [f"cgroup {d}" for d in self._cgroup_dirs() if d.exists()]
        return found

    # ---- tests' helpers -----------------------------------------------------------------
    def pod_pids(self, namespace: str, pod: str) -> list[int]:
        return containerd.pod_container_pids(self.c, self.crictl, namespace, pod)
