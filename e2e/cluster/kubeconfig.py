"""Kubeconfig files: one per identity, all pointing at the local API server."""

from __future__ import annotations

from pathlib import Path

import yaml

from .certs import KeyPair


def write_kubeconfig(path: Path, server: str, ca: Path, client: KeyPair, user: str,
                     context: str = "kubeshard-local") -> Path:
    """Write a kubeconfig that embeds file paths (not data) so it stays small and readable."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{
            "name": user,
            "user": {"client-certificate": str(client.cert), "client-key": str(client.key)},
        }],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
