"""`python -m e2e.cluster up|down|status` — the local cluster from a shell.

up      start it in the background (or keep the running one); prints the kubeconfig path
down    stop it and remove every process, namespace, bridge, nft table and mountpoint
status  print what runs, as JSON
Options of `up`: --nodes N, --gpus N (fake nvidia.com/gpu per node), --state-dir DIR.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .local import LocalCluster, acquire, dumps, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "up":
        start = time.monotonic()
        cluster, handle = acquire(args.state_dir, persistent=True, nodes=args.nodes, node_gpus=args.gpus)
        print(f"local cluster up in {time.monotonic() - start:.1f} s; kubeconfig:", file=sys.stderr)
        print(handle.kubeconfig)
        return 0
    cluster = LocalCluster(args.state_dir)
    if args.command == "down":
        left = cluster.down()
        if left:
            print("could not remove: " + ", ".join(left), file=sys.stderr)
            return 1
        return 0
    print(dumps(summary(cluster)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
