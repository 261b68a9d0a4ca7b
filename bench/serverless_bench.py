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
import math
import re
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
from e2e.operator.conftest import CHART, CRDS, INSTALL_VALUES, RELEASE, inference_service
from e2e.waiting import wait_for
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from kubeshard_shard.paths import cache_root
from tests.support.sse import sse_data, sse_events

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
        c.helm("install", RELEASE, str(CHART), "-n", self.release_ns, *INSTALL_VALUES,
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
        """Until the InferenceService reaches ``phase``; raises at once, with its false
        conditions' messages (a crash's last line among them), should it fail instead."""
        def settled() -> Optional[dict]:
            status = self.isvc(name).get("status") or {}
            return status if status.get("phase") in (phase, "Failed") else None

        status = wait_for(settled, timeout, interval=0.5, what=f"{name} {phase}")
        if status["phase"] != phase:
            why = "; ".join(f"{c.get('type')}: {c.get('message')}" for c in status.get("conditions") or ()
                            if c.get("status") == "False" and c.get("type") not in ("ScaledToZero", "Available"))
            raise RuntimeError(f"{name} failed while waiting for {phase}: {why}")

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
        return {"runs": samples, "median": medians(samples)}

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
                                # no pid read yet (the node's lookup can miss for a moment): again
                                started = process_start(self.cluster.pod_pids(self.ns, pod_name))
                                if started is not None:
                                    seen["proc"] = started
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
                for _ in sse_events(r.iter_lines()):
                    first = first or time.time()
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
        """0 -> 1 -> N -> 1 -> 0 under an open-loop load that never pauses. The first phase
        runs until one group is left (the requests held at zero count as concurrency, so
        the HPA may ask for more groups while the first one loads); the step then sends
        long streams at a rate whose concurrency is above the HPA's target, and the
        second group counts as serving once the router has a request outstanding on it."""
        name = "elastic"
        self.apply(inference_service(name, self.ns, model_dir, engine={"maxTotalTokens": 512, "kvCacheMemory": "64Mi"},
                                     model={"source": f"file://{model_dir}", "dtype": dtype},
                                     autoscaling={"minReplicas": 0, "maxReplicas": 3, "target": SCALING_TARGET,
                                                  "idleSeconds": 15, "scaleDownStabilizationSeconds": 20}))
        self.wait_phase(name, "Ready")
        self.wait_phase(name, "ScaledToZero", timeout=300)
        wait_for(lambda: not self.core.list_namespaced_pod(
            self.ns, label_selector=f"kubeshard.io/inference-service={name}").items, 300, what="no pods")
        url, _ = self.router()
        replicas: list[tuple[float, int, int]] = []  # (time, spec.replicas, status.readyReplicas)
        one_group = lambda: bool(replicas) and replicas[-1][1:] == (1, 1)  # noqa: E731
        phases = [Phase("0 -> 1", 1.0, 60, SHORT, until=one_group, max_seconds=300),
                  Phase("1 -> N", STEP_RATE, 150, STEP, stream=True),
                  Phase("N -> 1", 1.0, 120, SHORT)]
        stop = threading.Event()
        step = StepWatch()

        def watch() -> None:
            while not stop.is_set():
                try:
                    obj = self.isvc(name)
                    replicas.append((time.time(), (obj.get("spec") or {}).get("replicas", 0),
                                     (obj.get("status") or {}).get("readyReplicas", 0)))
                except Exception:
                    pass
                time.sleep(0.5)

        def watch_step() -> None:
            """From the step on: the router's load and where its requests are outstanding."""
            while not stop.is_set() and step.started is None:
                time.sleep(0.05)
            serving_before = self._ready_leader_ips(name)  # the group(s) serving when the step began
            step.groups_at_step = len(serving_before)
            with httpx.Client(timeout=5) as client:
                while not stop.is_set() and time.time() < step.started + phases[1].seconds:
                    try:
                        text = client.get(f"{url}/metrics").text
                    except httpx.HTTPError:
                        time.sleep(0.25)
                        continue
                    now = time.time()
                    gauges = router_gauges(text, name)
                    step.concurrency.append(gauges["in_flight"] + gauges["queued"])
                    others = {r: v for r, v in gauges["outstanding"].items()
                              if v > 0 and r.rsplit(":", 1)[0] not in serving_before}
                    if others and step.second_serving is None:
                        step.second_serving, step.second_replica = now, sorted(others)[0]
                    time.sleep(0.25)

        threads = [threading.Thread(target=watch, daemon=True), threading.Thread(target=watch_step, daemon=True)]
        for t in threads:
            t.start()
        t0 = time.time()
        results, starts = asyncio.run(open_loop(url, name, phases, on_phase=lambda i, t: (
            setattr(step, "started", t) if i == 1 else None)))
        wait_for(lambda: (self.isvc(name).get("status") or {}).get("phase") == "ScaledToZero", 300,
                 interval=1, what="back to zero")
        end = time.time()
        stop.set()
        for t in threads:
            t.join(5)
        per_phase = []
        for phase, start, until in zip(phases, starts, starts[1:] + [float("inf")]):
            sent = [r for r in results if start <= r["sent"] < until]
            per_phase.append({"phase": phase.label, "rate_per_s": phase.rate, "seconds": round(min(until, end) - start, 1)
                              if until != float("inf") else phase.seconds, "max_new_tokens": phase.max_new_tokens,
                              "stream": phase.stream, "sent": len(sent),
                              "ok": sum(r["ok"] for r in sent), "lost": sum(not r["ok"] for r in sent),
                              "latency_p50_s": percentile([r["s"] for r in sent if r["ok"]], 50),
                              "latency_p99_s": percentile([r["s"] for r in sent if r["ok"]], 99)})
        return {"phases": per_phase, "target": SCALING_TARGET, "sent": len(results),
                "lost": sum(not r["ok"] for r in results),
                "errors": sorted({r.get("error", "")[:120] for r in results if not r["ok"]}),
                "max_replicas": max((spec for _, spec, _ in replicas), default=0),
                "groups_ready_at_step": step.groups_at_step,
                "step_concurrency_median": percentile(step.concurrency, 50) if step.concurrency else None,
                "load_step_to_second_group_serving_s": (step.second_serving - step.started)
                if step.second_serving and step.started else None,
                "second_group_replica": step.second_replica,
                "back_to_zero_after_load_s": end - (starts[-1] + phases[-1].seconds),
                "replicas_timeline": [(round(t - t0, 1), s, r) for t, s, r in replicas[::4]]}

    def _ready_leader_ips(self, name: str) -> set[str]:
        """Pod IPs of the ready group leaders (`<name>-g<i>-0`) of an InferenceService."""
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"kubeshard.io/inference-service={name}").items
        return {p.status.pod_ip for p in pods if re.fullmatch(rf"{name}-g\d+-0", p.metadata.name)
                and p.status.pod_ip and any(c.type == "Ready" and c.status == "True"
                                            for c in p.status.conditions or ())}


SCALING_TARGET = 1  # concurrency per group, the HPA's AverageValue target
SHORT = 24          # new tokens of the steady requests
# The step: streams long enough, and often enough, that the router's concurrency stays
# above the target. 3/s of 192 tokens did until the engine got faster: on 2026-12-07 a
# stream took 0.24 s (p50), the concurrency's median was 1 and no second group was asked
# for; 384 tokens (of the model's 512) at 6/s: a median of 2, and three groups asked for.
STEP = 384          # new tokens of the step's streams
STEP_RATE = 6.0     # the step's requests a second


@dataclass
class Phase:
    label: str
    rate: float                 # requests per second, sent whatever the answers
    seconds: float              # at least this long
    max_new_tokens: int
    stream: bool = False        # /generate_stream (read to its last event) instead of /generate
    until: Optional[Any] = None  # then until this holds (checked before each request) ...
    max_seconds: float = 0.0    # ... for at most this long in all


@dataclass
class StepWatch:
    started: Optional[float] = None
    groups_at_step: Optional[int] = None
    concurrency: list[float] = field(default_factory=list)
    second_serving: Optional[float] = None
    second_replica: Optional[str] = None


def router_gauges(text: str, model: str) -> dict:
    """The router's in-flight and queued requests of ``model`` and its requests
    outstanding per replica address, from its /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"in_flight": 0.0, "queued": 0.0, "outstanding": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name == "kubeshard_router_in_flight":
                out["in_flight"] = sample.value
            elif sample.name == "kubeshard_router_queued":
                out["queued"] = sample.value
            elif sample.name == "kubeshard_router_replica_outstanding":
                out["outstanding"][sample.labels["replica"]] = sample.value
    return out


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


async def open_loop(url: str, model: str, phases: list[Phase],
                    on_phase: Optional[Any] = None) -> tuple[list[dict], list[float]]:
    """Sends requests at each phase's fixed rate whatever the answers (open loop); a
    request is lost unless it ends in 200 with its whole answer (a stream: a final event
    with ``generated_text``, no error event). Returns the results and each phase's start."""
    results: list[dict] = []
    starts: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        async def one(phase: Phase) -> None:
            body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": phase.max_new_tokens}}
            sent = time.time()
            try:
                if phase.stream:
                    ok, error = False, ""
                    async with client.stream("POST", f"{url}/models/{model}/generate_stream", json=body,
                                             headers=NO_CACHE) as r:
                        async for line in r.aiter_lines():
                            event = sse_data(line)
                            if event is None:
                                continue
                            if "error" in event:
                                error = str(event["error"])
                            elif event.get("generated_text") is not None:
                                ok = True
                        if r.status_code != 200:
                            error = (await r.aread()).decode(errors="replace")[:200]
                    ok = ok and r.status_code == 200 and not error
                    results.append({"sent": sent, "status": r.status_code, "ok": ok, "s": time.time() - sent,
                                    **({} if ok else {"error": error or "the stream ended without its answer"})})
                else:
                    r = await client.post(f"{url}/models/{model}/generate", json=body, headers=NO_CACHE)
                    results.append({"sent": sent, "status": r.status_code, "ok": r.status_code == 200,
                                    "s": time.time() - sent, **({} if r.status_code == 200 else {"error": r.text[:200]})})
            except Exception as e:
                results.append({"sent": sent, "status": 0, "ok": False, "s": time.time() - sent, "error": repr(e)})

        tasks = []
        for i, phase in enumerate(phases):
            start = time.monotonic()
            starts.append(time.time())
            if on_phase is not None:
                on_phase(i, starts[-1])
            sent = 0
            while True:
                elapsed = time.monotonic() - start
                if elapsed >= phase.seconds and (phase.until is None or phase.until()
                                                 or elapsed >= max(phase.max_seconds, phase.seconds)):
                    break
                due = start + sent / phase.rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                tasks.append(asyncio.create_task(one(phase)))
                sent += 1
        await asyncio.gather(*tasks)
    return results, starts


def medians(samples: list[dict]) -> dict[str, float]:
    """Each step's median over the runs that timed it (a run may miss a mark: NaN there)."""
    keys = [k for k in samples[0] if k.endswith("_s")]
    return {k: percentile([s[k] for s in samples if not math.isnan(s[k])], 50) for k in keys}


def write(results: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serverless.json").write_text(json.dumps(results, indent=2, default=str))
    lines = ["# Serverless benchmark", "",
             f"Machine: {results['machine']['cores']} CPUs, shared with other work. "
             "The local cluster of `e2e/cluster` (a real kubelet with containerd since 2026-12-04; the "
             "process-backed node before), the chart installed as the e2e "
             f"tests install it; shards in {results.get('dtype')}. Each section says when it ran, the load "
             "average before that run and the command that reproduces it.", ""]

    def ran(section: dict) -> list[str]:
        r = section.get("run")
        on = f" on {r['cpu']}" if "cpu" in r else ""  # stamps before 2026-12-03 18:00 name no flags
        return [f"Run {r['date']}{on}, load average {r['load_before']} before it: `{r['command']}`.", ""] if r else []
    for key, title in (("coldstart_tiny", "tiny demo model (llama, random weights)"),
                       ("coldstart_default", f"default model, SmolLM2-135M-Instruct ({results.get('dtype')}; "
                                             "`make run` serves it in float32 on a CPU)")):
        cs = results.get(key)
        if not cs:
            continue
        if "error" in cs:
            lines += [f"## Cold start from zero: {title}", "", *ran(cs), f"Not measured: `{cs['error'][:300]}`", ""]
            continue
        lines += [f"## Cold start from zero: {title}", "", *ran(cs),
                  f"A streaming request at zero replicas until its first token; median of "
                  f"{len(cs['runs'])} runs (each: idle 5 s, scaled to zero, then one request); -: a mark this "
                  "process did not see in that run (a step's median is over the runs that timed it).", "",
                  "| step | median s | " + " | ".join(f"run {i + 1}" for i in range(len(cs["runs"]))) + " |",
                  "|---|---:|" + "---:|" * len(cs["runs"])]
        for i, step in enumerate(cs["runs"][0]["steps"]):
            cells = [fmt(r["steps"][i]["seconds"]) for r in cs["runs"]]
            lines.append(f"| {step['step']} | {fmt(cs['median'][f'step{i}_s'])} | " + " | ".join(cells) + " |")
        cells = [fmt(r["total_s"]) for r in cs["runs"]]
        lines += [f"| **request to first token** | **{fmt(cs['median']['total_s'])}** | " + " | ".join(cells) + " |", ""]
    sc = results.get("scaling")
    if sc and "error" in sc:
        lines += ["## 0 -> 1 -> N -> 1 -> 0 under a steady open-loop load", "", *ran(sc),
                  f"Not measured: `{sc['error'][:300]}`", ""]
    elif sc and "load_step_to_second_group_serving_s" not in sc:  # recorded by the scenario's first version
        lines += ["## 0 -> 1 -> N -> 1 -> 0 under a steady open-loop load", "", *ran(sc),
                  "Non-streaming `/generate` (24 new tokens) at a fixed rate whatever the answers, through the "
                  "router; HPA on `concurrency` with target 1, min 0, max 3, scale-down window 20 s; idle 15 s "
                  "to zero.", "",
                  "| phase | rate/s | s | sent | ok | lost | p50 s | p99 s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for p in sc["phases"]:
            lines.append(f"| {p['phase']} | {p['rate_per_s']:g} | {p['seconds']} | {p['sent']} | {p['ok']} | "
                         f"**{p['lost']}** | {fmt(p['latency_p50_s'])} | {fmt(p['latency_p99_s'])} |")
        step_at, step_s = sc["phases"][0]["seconds"], sc["phases"][1]["seconds"]
        asked = next((t for t, spec, _ in sc["replicas_timeline"] if t >= step_at and spec >= 2), None)
        lines += ["", f"Requests lost in all: **{sc['lost']}** of {sc['sent']} (target 0). Most groups asked for: "
                  f"{sc['max_replicas']} (first right after the 0 -> 1 activation: requests held at zero count as "
                  f"queued). Back "
                  f"at zero {fmt(sc['back_to_zero_after_load_s'])} s after the load ended.", "",
                  f"No load-step figure from this run: {sc['phases'][1]['rate_per_s']:g} requests/s of 24 tokens "
                  f"(p50 {fmt(sc['phases'][1]['latency_p50_s'])} s each) is a concurrency under the target of 1, so "
                  f"the HPA asked for more groups only {fmt(asked - step_at if asked is not None else None)} s after "
                  f"the step, in a phase of {step_s} s (the replicas timeline in serverless.json), and the second "
                  f"group was ready {fmt(sc['load_step_to_second_group_ready_s'])} s after the step, when the load "
                  "was back to 1 request/s; readiness is not traffic either. The scenario now steps to long "
                  "streams well above the target and times the second group from the first request the router "
                  "has outstanding on it: rerun `python -m bench.serverless_bench scaling`.", ""]
    elif sc:
        step, steady = sc["phases"][1], sc["phases"][0]
        lines += ["## 0 -> 1 -> N -> 1 -> 0 under a steady open-loop load", "", *ran(sc),
                  f"Requests at a fixed rate whatever the answers, through the router: `/generate` with "
                  f"{steady['max_new_tokens']} new tokens, and in the step `/generate_stream` with "
                  f"{step['max_new_tokens']} (read to the final event). HPA on `concurrency` with target "
                  f"{sc['target']} per group, min 0, max 3, scale-down window 20 s; idle 15 s to zero. The first "
                  "phase runs at least 60 s and until one group is left; a request is lost unless it ends in 200 "
                  "with its whole answer.", "",
                  "| phase | rate/s | new tokens | s | sent | ok | lost | p50 s | p99 s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in sc["phases"]:
            lines.append(f"| {p['phase']} | {p['rate_per_s']:g} | {p['max_new_tokens']} | {p['seconds']} | {p['sent']} "
                         f"| {p['ok']} | **{p['lost']}** | {fmt(p['latency_p50_s'])} | {fmt(p['latency_p99_s'])} |")
        lines += ["", f"Requests lost in all: **{sc['lost']}** of {sc['sent']} (target 0). Most groups asked for: "
                  f"{sc['max_replicas']}. The step: {sc['groups_ready_at_step']} group(s) ready when it began; the "
                  f"router's concurrency (in flight + queued) had a median of {fmt(sc['step_concurrency_median'])} "
                  f"during it (target {sc['target']} per group). From the load step to the second group serving "
                  f"traffic (the router with a request outstanding on a replica not serving when the step began, "
                  f"`{sc['second_group_replica']}`): **{fmt(sc['load_step_to_second_group_serving_s'])} s**. Back "
                  f"at zero {fmt(sc['back_to_zero_after_load_s'])} s after the load ended.", ""]
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
        stamp = {"date": machine()["date"], "cpu": results["machine"]["cpu"], "command": results["command"],
                 "load_before": results["load_before"]}
        try:
            results[key] = run()
        except Exception as exc:  # the shared local cluster misbehaving: say so in the results
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{key} failed: {results[key]['error']}", file=sys.stderr, flush=True)
        results[key]["run"] = stamp  # scenarios of earlier runs keep their own
        write(results)

    try:
        bench.install()
        tiny = Path(cached_demo_model(cache_root() / "demo-models", arch="llama", size="tiny", seed=0))
        if args.what in ("coldstart", "all"):
            scenario("coldstart_tiny", lambda: bench.cold_start(
                "tiny", tiny, args.runs, {"maxTotalTokens": 256, "kvCacheMemory": "64Mi"},
                {"cpu": "1", "memory": "1Gi"}, args.dtype))
        if args.what in ("coldstart-default", "all"):
            model = local_checkpoint(default_model_file())  # SmolLM2-135M-Instruct, converted once
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
