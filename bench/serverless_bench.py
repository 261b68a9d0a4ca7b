"""Serverless on the local Kubernetes control plane: cold start from zero with its
breakdown, time from a load step to the second group serving, and requests lost across
0 -> 1 -> N -> 1 -> 0 under a steady open-loop load.

    python -m bench.serverless_bench [coldstart|coldstart-default|scaling|all]

Installs the chart (as the e2e tests do) into a fresh namespace of the local cluster
(started if none runs), runs the scenarios, uninstalls, and writes
bench/results/serverless.{json,md}. Requests go from this machine straight to the
router pod (the host reaches pod IPs on the local cluster).

Cold start breakdown: every step is timed from what this process sees, polling the API
every 50 ms (the InferenceService's replicas, its StatefulSet, the pod's scheduling and
readiness), the shard process's start time (/proc), the shard's and the router's own log
lines (millisecond timestamps), and the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import httpx
import yaml

from bench.common import RESULTS, machine, percentile
from e2e.operator.conftest import CHART, CRDS, INSTALL_VALUES, RELEASE, inference_service, node_values
from e2e.waiting import wait_for
from kubeshard_shard.paths import cache_root

NO_CACHE = {"Cache-Control": "no-cache, no-store"}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_time(line: str) -> Optional[float]:
    m = LOG_TIME.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Bench:
    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.release_ns = f"bench-ks-{uuid.uuid4().hex[:5]}"
        self.ns = f"bench-{uuid.uuid4().hex[:5]}"
        self.api = None

    # -- set-up ----------------------------------------------------------------------------

    def install(self) -> None:
        c = self.cluster
        c.kubectl("apply", "--server-side", "-f", str(CRDS))
        c.kubectl("create", "namespace", self.release_ns)
        c.kubectl("create", "namespace", self.ns)
        c.helm("install", RELEASE, str(CHART), "-n", self.release_ns, *INSTALL_VALUES, *node_values(c),
               "--wait", "--timeout", "5m", timeout=360)
        c.kubectl("wait", "--for=condition=Available", "apiservice/v1beta2.custom.metrics.k8s.io",
                  "--timeout=180s", timeout=190)
        from kubernetes import client
        self.api = client.CustomObjectsApi(c.api_client())
        self.core = client.CoreV1Api(c.api_client())
        self.apps = client.AppsV1Api(c.api_client())

    def uninstall(self) -> None:
        c = self.cluster
        c.kubectl("delete", "inferenceservices", "--all", "-n", self.ns, "--timeout=120s", check=False, timeout=150)
        c.helm("uninstall", RELEASE, "-n", self.release_ns, "--wait", check=False, timeout=180)
        for ns in (self.ns, self.release_ns):
            c.kubectl("delete", "namespace", ns, "--wait=false", check=False)

    def router(self) -> tuple[str, str]:
        pods = self.core.list_namespaced_pod(self.release_ns, label_selector="app.kubernetes.io/component=router")
        pod = next(p for p in pods.items if p.status.pod_ip and not p.metadata.deletion_timestamp)
        return f"http://{pod.status.pod_ip}:8080", pod.metadata.name

    def isvc(self, name: str) -> dict:
        return self.api.get_namespaced_custom_object("kubeshard.io", "v1alpha1", self.ns, "inferenceservices", name)

    def apply(self, body: dict) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

    def wait_phase(self, name: str, phase: str, timeout: float = 600) -> None:
        wait_for(lambda: (self.isvc(name).get("status") or {}).get("phase") == phase, timeout, interval=0.5,
                 what=f"{name} {phase}")

    # -- cold start ------------------------------------------------------------------------

    def cold_start(self, name: str, model_dir: Path, runs: int, engine: dict, resources: dict,
                   dtype: str) -> dict:
        self.apply(inference_service(name, self.ns, model_dir, engine=engine, resources=resources,
                                     model={"source": f"file://{model_dir}", "dtype": dtype},
                                     autoscaling={"minReplicas": 0, "maxReplicas": 1, "idleSeconds": 5}))
        self.wait_phase(name, "Ready")
        url, router_pod = self.router()
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
        samples = []
        for run in range(runs):
            self.wait_phase(name, "ScaledToZero")
            wait_for(lambda: not self.core.list_namespaced_pod(
                self.ns, label_selector=f"kubeshard.io/inference-service={name}").items, 300,
                what="the shard pods to go")
            time.sleep(1)
            samples.append(self._one_cold_start(name, url, router_pod, body))
            print(f"  {name} cold start {run + 1}/{runs}: {samples[-1]['total_s']:.2f} s to the first token",
                  flush=True)
        keys = [k for k in samples[0] if k.endswith("_s")]
        return {"runs": samples, "median": {k: percentile([s[k] for s in samples], 50) for k in keys}}

    def _one_cold_start(self, name: str, url: str, router_pod: str, body: dict) -> dict:
        seen: dict[str, float] = {}
        stop = threading.Event()
        pod_name = f"{name}-g0-0"

        def watch() -> None:
            while not stop.is_set():
                now = time.time()
                try:
                    if "scaled" not in seen and (self.isvc(name).get("spec") or {}).get("replicas", 0) >= 1:
                        seen["scaled"] = now
                    if "statefulset" not in seen and self.apps.list_namespaced_stateful_set(
                            self.ns, label_selector=f"kubeshard.io/inference-service={name}").items:
                        seen["statefulset"] = now
                    pods = self.core.list_namespaced_pod(self.ns, field_selector=f"metadata.name={pod_name}").items
                    if pods:
                        seen.setdefault("pod", now)
                        p = pods[0]
                        if p.spec.node_name:
                            seen.setdefault("scheduled", now)
                        if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ()):
                            seen.setdefault("ready", now)
                            if "proc" not in seen and self.cluster.is_local:
                                seen["proc"] = process_start(self.cluster.pod_pids(self.ns, pod_name))
                except Exception:
                    pass
                if "ready" in seen and "proc" in seen:
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        t0 = time.time()
        watcher.start()
        first = None
        with httpx.Client(timeout=300) as client:
            with client.stream("POST", f"{url}/models/{name}/generate_stream", json=body, headers=NO_CACHE) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data:") and first is None:
                        first = time.time()
        stop.set()
        watcher.join(5)
        shard_log = self.cluster.pod_logs(self.ns, pod_name)
        listen = next((log_time(l) for l in shard_log.splitlines() if "gRPC listening" in l), None)
        loaded = next((log_time(l) for l in shard_log.splitlines() if "factory: loaded" in l), None)
        router_log = self.cluster.pod_logs(self.release_ns, router_pod)
        routed = [log_time(l) for l in router_log.splitlines()
                  if f"model {name}: replica" in l and l.rstrip().endswith("ready")]
        routed_at = max((t for t in routed if t and t >= t0), default=None)
        marks = [("activation: the router scales 0 -> 1", t0, seen.get("scaled")),
                 ("operator: StatefulSet created", seen.get("scaled"), seen.get("statefulset")),
                 ("StatefulSet controller and scheduler: pod bound", seen.get("statefulset"), seen.get("scheduled")),
                 ("node: shard process started", seen.get("scheduled"), seen.get("proc")),
                 ("imports until gRPC listens", seen.get("proc"), listen),
                 ("model load (weights, KV pool, kernel)", listen, loaded),
                 ("startup/readiness probe until Ready", loaded, seen.get("ready")),
                 ("EndpointSlice to the router, its Info and Health", seen.get("ready"), routed_at),
                 ("router to the first token", routed_at, first)]
        out: dict[str, Any] = {"total_s": first - t0, "steps": []}
        for label, a, b in marks:
            value = (b - a) if a is not None and b is not None else None
            out["steps"].append({"step": label, "seconds": value})
        for i, step in enumerate(out["steps"]):
            out[f"step{i}_s"] = step["seconds"] if step["seconds"] is not None else float("nan")
        return out

    # -- scaling under an open-loop load ------------------------------------------------------

    def scaling(self, model_dir: Path, dtype: str) -> dict:
        name = "elastic"
        self.apply(inference_service(name, self.ns, model_dir, engine={"maxTotalTokens": 512, "kvCacheMemory": "64Mi"},
                                     model={"source": f"file://{model_dir}", "dtype": dtype},
                                     autoscaling={"minReplicas": 0, "maxReplicas": 3, "target": 1,
                                                  "idleSeconds": 15, "scaleDownStabilizationSeconds": 20}))
        self.wait_phase(name, "Ready")
        self.wait_phase(name, "ScaledToZero", timeout=300)
        wait_for(lambda: not self.core.list_namespaced_pod(
            self.ns, label_selector=f"kubeshard.io/inference-service={name}").items, 300, what="no pods")
        url, _ = self.router()
        phases = [("0 -> 1", 1.0, 60), ("1 -> N", 6.0, 150), ("N -> 1", 1.0, 120)]
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 24}}
        replicas: list[tuple[float, int, int]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    obj = self.isvc(name)
                    replicas.append((time.time(), (obj.get("spec") or {}).get("replicas", 0),
                                     (obj.get("status") or {}).get("readyReplicas", 0)))
                except Exception:
                    pass
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.time()
        results = asyncio.run(open_loop(f"{url}/models/{name}/generate", body, phases))
        wait_for(lambda: (self.isvc(name).get("status") or {}).get("phase") == "ScaledToZero", 300,
                 interval=1, what="back to zero")
        end = time.time()
        stop.set()
        watcher.join(5)
        step_at = t0 + phases[0][2]
        second_ready = next((t for t, _, ready in replicas if t >= step_at and ready >= 2), None)
        per_phase = []
        start = t0
        for label, rate, seconds in phases:
            sent = [r for r in results if start <= r["sent"] < start + seconds]
            per_phase.append({"phase": label, "rate_per_s": rate, "seconds": seconds, "sent": len(sent),
                              "ok": sum(r["status"] == 200 for r in sent),
                              "lost": sum(r["status"] != 200 for r in sent),
                              "latency_p50_s": percentile([r["s"] for r in sent if r["status"] == 200], 50),
                              "latency_p99_s": percentile([r["s"] for r in sent if r["status"] == 200], 99)})
            start += seconds
        return {"phases": per_phase, "sent": len(results), "lost": sum(r["status"] != 200 for r in results),
                "errors": sorted({r.get("error", "")[:120] for r in results if r["status"] != 200}),
                "max_replicas": max((spec for _, spec, _ in replicas), default=0),
                "load_step_to_second_group_ready_s": (second_ready - step_at) if second_ready else None,
                "back_to_zero_after_load_s": end - (t0 + sum(p[2] for p in phases)),
                "replicas_timeline": [(round(t - t0, 1), s, r) for t, s, r in replicas[::4]]}


def process_start(pids: list[int]) -> Optional[float]:
    """Wall-clock start of the earliest of `pids` (from /proc: boot time + start ticks)."""
    import os
    ticks = os.sysconf("SC_CLK_TCK")
    boot = next(float(l.split()[1]) for l in Path("/proc/stat").read_text().splitlines() if l.startswith("btime"))
    starts = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            starts.append(boot + int(fields[19]) / ticks)
        except (OSError, IndexError, ValueError):
            pass
    return min(starts) if starts else None


async def open_loop(url: str, body: dict, phases: list[tuple[str, float, float]]) -> list[dict]:
    """Sends requests at a fixed rate per phase whatever the answers (open loop)."""
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        async def one() -> None:
            sent = time.time()
            try:
                r = await client.post(url, json=body, headers=NO_CACHE)
                results.append({"sent": sent, "status": r.status_code, "s": time.time() - sent,
                                **({} if r.status_code == 200 else {"error": r.text[:200]})})
            except Exception as e:
                results.append({"sent": sent, "status": 0, "s": time.time() - sent, "error": repr(e)})

        tasks = []
        start = time.monotonic()
        offset = 0.0
        for _, rate, seconds in phases:
            n = int(rate * seconds)
            for i in range(n):
                due = start + offset + i / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                tasks.append(asyncio.create_task(one()))
            offset += seconds
        await asyncio.gather(*tasks)
    return results


def default_model_dir() -> Optional[Path]:
    """The converted folder of SmolLM2-135M-Instruct (`make run` writes it)."""
    models = cache_root() / "models"
    for d in sorted(models.glob("*"), key=lambda p: p.stat().st_mtime, reverse=True) if models.is_dir() else []:
        if (d / "config.json").is_file() and "smollm2" in d.name.lower() and "135m" in d.name.lower():
            return d
    return None


def write(results: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serverless.json").write_text(json.dumps(results, indent=2, default=str))
    lines = ["# Serverless benchmark", "",
             f"Machine: {results['machine']['cores']} CPUs ({results['machine']['cpu']}), run "
             f"{results['machine']['date']}; load average {results['load_before']} before the run (the "
             "machine is shared with other work). The local control plane of `e2e/cluster` (process-backed "
             f"node), the chart installed as the e2e tests install it; shards in {results.get('dtype')}. "
             f"Reproduce: `{results['command']}`.", ""]
    for key, title in (("coldstart_tiny", "tiny demo model (llama, random weights)"),
                       ("coldstart_default", "default model, SmolLM2-135M-Instruct (float32)")):
        cs = results.get(key)
        if not cs:
            continue
        if "error" in cs:
            lines += [f"## Cold start from zero: {title}", "", f"Not measured in this run: `{cs['error'][:300]}`", ""]
            continue
        lines += [f"## Cold start from zero: {title}", "",
                  f"A streaming request at zero replicas until its first token; median of "
                  f"{len(cs['runs'])} runs (each: idle 5 s, scaled to zero, then one request).", "",
                  "| step | median s | " + " | ".join(f"run {i + 1}" for i in range(len(cs["runs"]))) + " |",
                  "|---|---:|" + "---:|" * len(cs["runs"])]
        for i, step in enumerate(cs["runs"][0]["steps"]):
            cells = [fmt(r["steps"][i]["seconds"]) for r in cs["runs"]]
            lines.append(f"| {step['step']} | {fmt(cs['median'][f'step{i}_s'])} | " + " | ".join(cells) + " |")
        cells = [fmt(r["total_s"]) for r in cs["runs"]]
        lines += [f"| **request to first token** | **{fmt(cs['median']['total_s'])}** | " + " | ".join(cells) + " |", ""]
    sc = results.get("scaling")
    if sc and "error" in sc:
        lines += ["## 0 -> 1 -> N -> 1 -> 0 under a steady open-loop load", "",
                  f"Not measured in this run: `{sc['error'][:300]}`", ""]
    elif sc:
        lines += ["## 0 -> 1 -> N -> 1 -> 0 under a steady open-loop load", "",
                  "Non-streaming `/generate` (24 new tokens) at a fixed rate whatever the answers, through the "
                  "router; HPA on `concurrency` with target 1, min 0, max 3, scale-down window 20 s; idle 15 s "
                  "to zero.", "",
                  "| phase | rate/s | s | sent | ok | lost | p50 s | p99 s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for p in sc["phases"]:
            lines.append(f"| {p['phase']} | {p['rate_per_s']:g} | {p['seconds']} | {p['sent']} | {p['ok']} | "
                         f"**{p['lost']}** | {fmt(p['latency_p50_s'])} | {fmt(p['latency_p99_s'])} |")
        lines += ["", f"Requests lost in all: **{sc['lost']}** of {sc['sent']} (target 0). Most groups asked for: "
                  f"{sc['max_replicas']}. From the load step (1 -> 6 requests/s) to the second group ready and "
                  f"serving: **{fmt(sc['load_step_to_second_group_ready_s'])} s**. Back at zero "
                  f"{fmt(sc['back_to_zero_after_load_s'])} s after the load ended.", ""]
        if sc["errors"]:
            lines += ["Errors: " + "; ".join(f"`{e}`" for e in sc["errors"]), ""]
    (RESULTS / "serverless.md").write_text("\n".join(lines) + "\n")


def fmt(v: Optional[float]) -> str:
    if v is None or v != v:
        return "-"
    return f"{v:.2f}"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", default="all", choices=["coldstart", "coldstart-default", "scaling", "all"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16",
                   help="shard dtype; float32 on CPU uses the compiled decode kernel, which a pod "
                        "compiles when the node has none built for the current kernel source")
    args = p.parse_args(argv)
    from e2e.cluster.sharing import acquire, release
    from kubeshard_shard.demo_model import cached_demo_model

    previous = json.loads((RESULTS / "serverless.json").read_text()) if (RESULTS / "serverless.json").is_file() else {}
    results = {**previous, "machine": machine(), "dtype": args.dtype,
               "command": f"python -m bench.serverless_bench {args.what} --dtype {args.dtype}",
               "load_before": round(__import__("os").getloadavg()[0], 2)}
    local, cluster = acquire(nodes=1, node_gpus=0)
    bench = Bench(cluster)

    def scenario(key: str, run) -> None:
        """Runs one scenario; its result (or the error that stopped it) is written at once."""
        try:
            results[key] = run()
        except Exception as exc:  # the shared local cluster misbehaving: say so in the results
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{key} failed: {results[key]['error']}", file=sys.stderr, flush=True)
        write(results)

    try:
        bench.install()
        tiny = Path(cached_demo_model(cache_root() / "demo-models", arch="llama", size="tiny", seed=0))
        if args.what in ("coldstart", "all"):
            scenario("coldstart_tiny", lambda: bench.cold_start(
                "tiny", tiny, args.runs, {"maxTotalTokens": 256, "kvCacheMemory": "64Mi"},
                {"cpu": "1", "memory": "1Gi"}, args.dtype))
        if args.what in ("coldstart-default", "all"):
            model = default_model_dir()
            if model is None:
                print("no converted SmolLM2-135M-Instruct folder under the cache: run `make run` once", file=sys.stderr)
            else:
                scenario("coldstart_default", lambda: bench.cold_start(
                    "smollm2", model, args.runs, {"maxTotalTokens": 2048, "kvCacheMemory": "256Mi"},
                    {"cpu": "1", "memory": "3Gi"}, args.dtype))
        if args.what in ("scaling", "all"):
            scenario("scaling", lambda: bench.scaling(tiny, args.dtype))
    finally:
        bench.uninstall()
        release(local)
    print((RESULTS / "serverless.md").read_text())


if __name__ == "__main__":
    main()
