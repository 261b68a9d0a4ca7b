"""`python -m e2e.cluster up|down|status` — the local cluster from a shell.

up      start it in the background (or keep the running one); prints the kubeconfig path
down    stop it and remove every process, pod, interface, nft table, iptables chain,
        mount and cgroup
status  print what runs, as JSON
prune   unless it runs: remove the node's image store (the image tarballs under
        $KUBESHARD_CACHE/images stay; the next `up` imports them again)
measure start a cluster, report its start time and idle memory (markdown), stop it
Options of `up`: --gpus N (fake nvidia.com/gpu on the node), --state-dir DIR.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .local import LocalCluster, dumps, summary
from .sharing import acquire


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status", "measure", "prune"])
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--gpus", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "up":
        start = time.monotonic()
        cluster, handle = acquire(args.state_dir, persistent=True, node_gpus=args.gpus)
        print(f"local cluster up in {time.monotonic() - start:.1f} s; kubeconfig:", file=sys.stderr)
        print(handle.kubeconfig)
        return 0
    cluster = LocalCluster(args.state_dir)
    if args.command == "measure":
        print(measure(cluster))
        return 0
    if args.command == "down":
        left = cluster.down()
        if left:
            print("could not remove: " + ", ".join(left), file=sys.stderr)
            return 1
        return 0
    if args.command == "prune":
        if cluster.is_running():  # e.g. `make cluster` before `make test`: it stays as it is
            print("local cluster: running, so its image store stays", file=sys.stderr)
            return 0
        try:
            freed = cluster.prune_images()
        except RuntimeError as e:
            print(f"prune: {e}", file=sys.stderr)
            return 1
        print(f"local cluster: removed the node's image store ({freed / 2**30:.1f} GiB)", file=sys.stderr)
        return 0
    print(dumps(summary(cluster)))
    return 0


def measure(cluster: LocalCluster, idle_s: float = 60.0) -> str:
    """Warm start time and idle resident memory of every control-plane process."""
    from . import controlplane, processes
    from .local import ADDONS

    if cluster.is_running():
        raise SystemExit("a cluster is running in this state dir: `down` it first")
    start = time.monotonic()
    cluster.start()
    started = time.monotonic() - start
    time.sleep(idle_s)
    rows, total = [], 0
    assert cluster.config is not None
    for name in controlplane.COMPONENTS + ADDONS:
        pid = processes.running(name, cluster.config.pid_dir)
        # Resident set of the process alone (the pods are not the node).
        rss_kib = int(next(line.split()[1] for line in open(f"/proc/{pid}/status")
                           if line.startswith("VmRSS:")))
        total += rss_kib
        rows.append(f"| {name} | {rss_kib / 1024:.0f} |")
    cluster.down()
    return "\n".join([
        f"warm start (binaries built, fresh etcd): {started:.1f} s",
        f"idle after {idle_s:.0f} s, no pods:", "",
        "| process | RSS MiB |", "|---|---|", *rows, f"| **total** | **{total / 1024:.0f}** |"])


if __name__ == "__main__":
    sys.exit(main())
