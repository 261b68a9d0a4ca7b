"""Run the node agents of one local cluster: `python -m e2e.cluster.node CLUSTER.json`.

Started (detached) by the harness after the control plane is up; SIGTERM stops every
pod's processes and sandboxes, then exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

from ..config import ClusterConfig
from .agent import NodeAgent
from .volumes import Mountpoints


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s")
    config = ClusterConfig.load(Path(sys.argv[1]))
    mountpoints = Mountpoints(config.state_dir / "mountpoints.txt")
    agents = [NodeAgent(config, node, mountpoints) for node in config.node_specs]
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    for agent in agents:
        agent.start()
        logging.info("node %s registered (pod CIDR %s)", agent.node.name, agent.node.pod_cidr)
    done.wait()
    logging.info("stopping node agents")
    for agent in agents:
        agent.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
