"""The kubelet of a real node: its configuration file and command line.

The settings that differ from a kubeadm node, and why:

* `failCgroupV1: false` and `cgroupDriver: cgroupfs`: the host has a cgroup v1 hierarchy
  and no systemd (Kubernetes >= 1.35 refuses cgroup v1 unless told otherwise);
* `cgroupRoot: /kubeshard-<i>`: pods' cgroups live under one folder of the cluster's
  own, removed on teardown;
* `resolvConf: ""`: pods get the cluster DNS only, no upstream (nothing may leave);
* every listener on the node's address or 127.0.0.1; the serving certificate is the
  cluster CA's, which the API server checks (`--kubelet-certificate-authority`);
* image garbage collection off: the images are imported from hack/images.sh's
  tarballs and cannot be pulled back.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..certs import Pki
from ..config import CLUSTER_DOMAIN, ClusterConfig, NodeSpec
from . import containerd


def cgroup_root(c: ClusterConfig) -> str:
    return f"/kubeshard-{c.instance}"


def root_dir(c: ClusterConfig) -> Path:
    return c.state_dir / "kubelet"


def pod_logs_dir(c: ClusterConfig) -> Path:
    return c.state_dir / "pod-logs"


def config(c: ClusterConfig, node: NodeSpec, pki: Pki) -> dict:
    serving = pki.kubelets[node.name]
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.gateway,
        "port": node.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": c.kubelet_healthz_port,
        "tlsCertFile": str(serving.cert),
        "tlsPrivateKeyFile": str(serving.key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.ca.cert)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [c.dns_service_ip],
        "resolvConf": "",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root(c),
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": containerd.endpoint(c),
        "podLogsDir": str(pod_logs_dir(c)),
        "podCIDR": node.pod_cidr,
        "maxPods": 110,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "876000h",
        # The disk is the machine's, shared with everything else on it: evict pods only
        # when it is really full, not when a neighbour's build fills it for a while.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "512Mi",
                         "imagefs.available": "512Mi", "nodefs.inodesFree": "1%"},
        "serializeImagePulls": False,
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "shutdownGracePeriod": "0s",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "staticPodPath": "",
        "enableServer": True,
    }


def write_config(c: ClusterConfig, node: NodeSpec, pki: Pki) -> Path:
    path = c.state_dir / "kubelet-config.yaml"
    path.write_text(yaml.safe_dump(config(c, node, pki), sort_keys=False))
    return path


def argv(c: ClusterConfig, node: NodeSpec, config_path: Path) -> list[str]:
    return [
        str(c.bin_dir / "kubelet"),
        f"--config={config_path}",
        f"--kubeconfig={c.component_kubeconfig(f'node-{node.name}')}",
        f"--root-dir={root_dir(c)}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.gateway}",
        "--v=1",
    ]
