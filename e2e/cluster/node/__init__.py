"""The process-backed node: a kubelet stand-in that runs each container as a local process."""
