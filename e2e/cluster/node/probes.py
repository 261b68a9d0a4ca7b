"""Readiness, liveness and startup probes: httpGet, tcpSocket, grpc and exec.

Network probes connect from the host to the pod IP, as a kubelet does; exec probes run
inside the container's namespaces (nsenter into its pid) with its environment and
working directory. One thread per probe and container instance applies the probe's
timing and thresholds and reports transitions to the pod worker.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import signal
import socket
import ssl
import subprocess
import threading
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Target:
    pod_ip: str
    ports: dict[str, int]  # named container ports
    pid: int  # the container's process, for exec probes
    env: dict[str, str]
    cwd: str


def _port(value: Any, target: Target) -> int:
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    if value in target.ports:
        return target.ports[value]
    raise ValueError(f"probe names port {value!r}, which no container port declares")


def _http(spec: dict, target: Target, timeout: float) -> tuple[bool, str]:
    host = spec.get("host") or target.pod_ip
    port = _port(spec["port"], target)
    if spec.get("scheme", "HTTP").upper() == "HTTPS":
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the kubelet does not verify probe certificates
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"User-Agent": "kube-probe/1.37", "Accept": "*/*"}
    headers.update({h["name"]: h["value"] for h in spec.get("httpHeaders") or []})
    try:
        conn.request("GET", spec.get("path") or "/", headers=headers)
        resp = conn.getresponse()
        body = resp.read(1024).decode(errors="replace")
        ok = 200 <= resp.status < 400
        return ok, f"HTTP probe failed with statuscode: {resp.status} {body[:200]}" if not ok else ""
    finally:
        conn.close()


def _tcp(spec: dict, target: Target, timeout: float) -> tuple[bool, str]:
    with socket.create_connection((spec.get("host") or target.pod_ip, _port(spec["port"], target)),
                                  timeout=timeout):
        return True, ""


def _grpc(spec: dict, target: Target, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{target.pod_ip}:{int(spec['port'])}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=spec.get("service") or ""),
                              timeout=timeout)
        except grpc.RpcError as e:
            return False, f"gRPC probe failed: {e.code().name} {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return status == "SERVING", f"service unhealthy (responded with {status})"


def exec_in(target: Target, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run argv inside the container (its net, mount and UTS namespaces)."""
    proc = subprocess.Popen(
        ["nsenter", "-t", str(target.pid), "-n", "-m", "-u", f"--wd={target.cwd}", "--", *argv],
        env=target.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _exec(spec: dict, target: Target, timeout: float) -> tuple[bool, str]:
    result = exec_in(target, list(spec["command"]), timeout)
    return result.returncode == 0, f"exit code {result.returncode}: {result.stdout[-300:]}"


def run_probe(probe: dict, target: Target) -> tuple[bool, str]:
    """One probe attempt: (success, message on failure)."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    handlers: dict[str, Callable] = {"httpGet": _http, "tcpSocket": _tcp, "grpc": _grpc, "exec": _exec}
    for kind, fn in handlers.items():
        if kind in probe:
            try:
                return fn(probe[kind], target, timeout)
            except subprocess.TimeoutExpired:
                return False, f"command timed out after {timeout:g}s"
            except (OSError, http.client.HTTPException, ValueError) as e:
                return False, f"{kind} probe failed: {e}"
    return False, "probe has no handler (httpGet, tcpSocket, grpc or exec)"


class Prober(threading.Thread):
    """Runs one probe for one container instance; calls on_change(kind, ok, message)
    when the probe's outcome flips (after success/failure thresholds)."""

    def __init__(self, kind: str, probe: dict, target: Target,
                 on_change: Callable[[str, bool, str], None]) -> None:
        super().__init__(daemon=True, name=f"probe-{kind}-{target.pid}")
        self.kind, self.probe, self.target, self.on_change = kind, probe, target, on_change
        self._stop = threading.Event()
        self.state: bool | None = None

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        p = self.probe
        period = float(p.get("periodSeconds") or 10)
        success_needed = int(p.get("successThreshold") or 1)
        failure_needed = int(p.get("failureThreshold") or 3)
        if self._stop.wait(float(p.get("initialDelaySeconds") or 0)):
            return
        successes = failures = 0
        while not self._stop.is_set():
            ok, message = run_probe(p, self.target)
            if self._stop.is_set():
                return
            if ok:
                successes, failures = successes + 1, 0
                if successes >= success_needed and self.state is not True:
                    self.state = True
                    self.on_change(self.kind, True, "")
                    if self.kind == "startup":
                        return  # a startup probe stops once it succeeded
            else:
                successes, failures = 0, failures + 1
                if failures >= failure_needed and self.state is not False:
                    self.state = False
                    self.on_change(self.kind, False, message)
                    if self.kind in ("liveness", "startup"):
                        return  # the container is killed; a new instance gets new probers
            self._stop.wait(period)
