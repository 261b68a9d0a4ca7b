"""The node's own containerd: its config, its images, and removing its pods.

A containerd instance of the cluster's own (state under the cluster's state dir and
/run/kubeshard/<id>, its own socket), so it never meets Docker's containerd. Its CRI
plugin runs containers with runc through hack/runc-wrapper (this VM withholds
CAP_SYS_RESOURCE, which runc would otherwise try to grant) and with
`restrict_oom_score_adj` (without it the sandbox's OOM score adjustment fails and
runc reports "can't get final child's PID from pipe"). Images come from the tarballs
hack/images.sh saves; nothing is pulled.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from ..config import ClusterConfig

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
SANDBOX_IMAGE = "registry.k8s.io/pause:3.10"


def root_dir(c: ClusterConfig) -> Path:
    return c.state_dir / "containerd"


def socket(c: ClusterConfig) -> Path:
    return c.run_dir / "containerd.sock"


def endpoint(c: ClusterConfig) -> str:
    return f"unix://{socket(c)}"


def config_toml(c: ClusterConfig, runc_wrapper: Path, cni_conf_dir: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root_dir(c) / 'root'}"
state = "{c.run_dir / 'state'}"
# Docker's containerd owns the default paths; this one keeps to its own.
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{socket(c)}"

[ttrpc]
  address = "{c.run_dir / 'containerd.sock.ttrpc'}"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{root_dir(c) / 'opt'}"

[{cri}]
  sandbox_image = "{SANDBOX_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  max_container_log_line_size = 16384
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{runc_wrapper}"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf_dir}"
    max_conf_num = 1
"""


def argv(c: ClusterConfig, config_path: Path) -> list[str]:
    return ["containerd", "--config", str(config_path)]


def ctr(c: ClusterConfig, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "--address", str(socket(c)), "--namespace", NAMESPACE, *args],
                          capture_output=True, text=True, timeout=timeout)


def image_refs(c: ClusterConfig) -> set[str]:
    out = ctr(c, "images", "list", "--quiet")
    return set(out.stdout.split()) if out.returncode == 0 else set()


def image_group(tarball_name: str) -> str:
    """hack/images.sh names a tarball GROUP-HASH.tar: a new build of a group replaces the last."""
    return tarball_name.removesuffix(".refs").removesuffix(".tar").rsplit("-", 1)[0]


def import_images(c: ClusterConfig, tarballs: list[Path]) -> None:
    """Import every tarball whose images containerd does not hold yet (stamped by name),
    first removing the images an earlier build of the same group imported: a store kept
    between runs would otherwise hold every build's layers and snapshots (15 GB after a
    day of rebuilding the shard image)."""
    stamps = root_dir(c) / "imported"
    stamps.mkdir(parents=True, exist_ok=True)
    present = image_refs(c)
    for tarball in tarballs:
        stamp = stamps / (tarball.name + ".refs")
        earlier = [old for old in stamps.glob(image_group(tarball.name) + "-*.refs")
                   if old != stamp and image_group(old.name) == image_group(tarball.name)]
        if stamp.exists() and set(stamp.read_text().split()) <= present:
            for old in earlier:  # its names now point to this build's images
                old.unlink()
            continue
        for old in earlier:
            remove_images(c, old.read_text().split())
            old.unlink()
        proc = ctr(c, "images", "import", "--no-unpack=false", str(tarball))
        if proc.returncode != 0:
            raise RuntimeError(f"ctr images import {tarball} failed: {proc.stderr.strip()}")
        refs = [line.split()[1] for line in proc.stdout.splitlines()
                if line.startswith("unpacking ") and len(line.split()) > 1]
        stamp.write_text("\n".join(refs))


def image_digests(c: ClusterConfig) -> dict[str, str]:
    """Every image record and the manifest (or index) it points to. The CRI plugin keeps,
    besides an image's names, a record named by its ID (sha256:<config digest>)."""
    out = ctr(c, "images", "list")
    if out.returncode != 0:
        raise RuntimeError(f"ctr images list failed: {out.stderr.strip()}")
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    return {row[0]: row[2] for row in rows if len(row) > 2}


def remove_images(c: ClusterConfig, refs: list[str]) -> None:
    """Remove images and the ID records no name points to any more, then, synchronously,
    the layers and snapshots nothing else uses (an ID record alone keeps them all)."""
    listed = image_digests(c)
    named = {digest for ref, digest in listed.items() if not ref.startswith("sha256:") and ref not in refs}
    orphans = {ref for ref, digest in listed.items() if ref.startswith("sha256:") and digest not in named}
    doomed = sorted((set(refs) & listed.keys()) | orphans)
    if doomed:
        proc = ctr(c, "images", "rm", "--sync", *doomed)
        if proc.returncode != 0:
            raise RuntimeError(f"ctr images rm {' '.join(doomed)} failed: {proc.stderr.strip()}")


def crictl(c: ClusterConfig, crictl_bin: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(crictl_bin), "--runtime-endpoint", endpoint(c), "--image-endpoint",
                           endpoint(c), "--timeout", "30s", *args],
                          capture_output=True, text=True, timeout=timeout)


def remove_all_pods(c: ClusterConfig, crictl_bin: Path) -> None:
    """Stop and remove every pod sandbox (containers, network namespace, CNI address)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = crictl(c, crictl_bin, "pods", "-q")
        if listed.returncode != 0 or not listed.stdout.split():
            return
        crictl(c, crictl_bin, "rmp", "--force", *listed.stdout.split())
        time.sleep(0.5)


def pod_container_pids(c: ClusterConfig, crictl_bin: Path, namespace: str, pod: str) -> list[int]:
    """Host pids of a pod's running containers (not its sandbox)."""
    pods = crictl(c, crictl_bin, "pods", "--namespace", namespace, "--name", f"^{pod}$", "-q",
                  "--state", "ready")
    pids = []
    for sandbox in pods.stdout.split():
        listed = crictl(c, crictl_bin, "ps", "--pod", sandbox, "-q", "--state", "running")
        for container in listed.stdout.split():
            info = crictl(c, crictl_bin, "inspect", container)
            if info.returncode == 0:
                pid = json.loads(info.stdout).get("info", {}).get("pid")
                if pid:
                    pids.append(int(pid))
    return pids
