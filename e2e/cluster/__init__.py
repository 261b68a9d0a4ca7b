"""A real Kubernetes control plane for tests, with a node that runs pods as processes.

    from e2e.cluster import LocalCluster
    cluster = LocalCluster().start()      # -> Cluster (kubeconfig, kubectl, helm, ...)
    ...
    LocalCluster().down()

`python -m e2e.cluster up|down|status` does the same from a shell (see README,
"Local Kubernetes control plane").
"""

from .handle import Cluster, CommandFailed
from .local import LocalCluster

__all__ = ["Cluster", "CommandFailed", "LocalCluster"]
