"""The part of the kubelet's HTTPS API that `kubectl logs` needs: /containerLogs.

The API server connects to the node's InternalIP (its gateway on the bridge) on the
kubelet port, presenting its kubelet-client certificate; this server presents the
node's serving certificate, signed by the cluster CA, and accepts only clients that the
cluster CA signed. exec, attach and port-forward are not implemented (they need SPDY
streams): the harness offers `cluster.exec(...)` for tests instead.
"""

from __future__ import annotations

import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse

# (namespace, pod, container, previous) -> (log file, is the container still running?)
LogLookup = Callable[[str, str, str, bool], "tuple[Path, Callable[[], bool]] | None"]


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts = parts[:-1]
        return b"\n".join(parts[-lines:]) + b"\n"
    return b"\n".join(parts[-lines:])


class _Handler(BaseHTTPRequestHandler):
    server: "KubeletServer"

    def log_message(self, fmt, *args):  # keep the agent's log for the agent
        pass

    def _reply(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self._unsupported()

    def _unsupported(self) -> None:
        self._reply(501, "exec, attach and port-forward are not supported by the kubeshard local "
                         "node (pods are local processes): reach pods by IP from the host, and "
                         "in tests use cluster.exec(namespace, pod, *argv) from e2e/conftest.py")

    def do_GET(self) -> None:
        url = urlparse(self.path)
        parts = [p for p in url.path.split("/") if p]
        if parts == ["healthz"]:
            return self._reply(200, "ok")
        if parts and parts[0] in ("exec", "attach", "portForward", "run"):
            return self._unsupported()
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._reply(404, f"{url.path}: not supported by the kubeshard local node "
                                    "(only /containerLogs and /healthz)")
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        previous = q.get("previous") == "true"
        found = self.server.lookup(parts[1], parts[2], parts[3], previous)
        if found is None:
            return self._reply(404, f"no logs for container {parts[3]} of pod {parts[1]}/{parts[2]}"
                                    + (" (previous)" if previous else ""))
        path, running = found
        data = path.read_bytes() if path.exists() else b""
        if "tailLines" in q:
            data = _tail(data, int(q["tailLines"]))
        if "limitBytes" in q:
            data = data[: int(q["limitBytes"])]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(data)
        if q.get("follow") != "true" or previous:
            return
        offset = path.stat().st_size if path.exists() else 0
        try:
            while True:
                alive = running()
                size = path.stat().st_size if path.exists() else 0
                if size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read(size - offset)
                    offset = size
                    self.wfile.write(chunk)
                    self.wfile.flush()
                elif not alive:
                    return
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            return


class KubeletServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], cert: Path, key: Path, ca: Path,
                 lookup: LogLookup) -> None:
        super().__init__(address, _Handler)
        self.lookup = lookup
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.socket = ctx.wrap_socket(self.socket, server_side=True)

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, daemon=True, name="kubelet-api").start()
