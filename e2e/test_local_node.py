"""What the local node gives a pod: volumes, environment, probes, init containers, logs.

Kubernetes semantics, so they hold on the local cluster's real node and on kind alike:
the `python:3*` pods are Python alone (the standard library), and the gRPC check runs in
the project's shard-server image, which has grpcio.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from e2e.cluster import Cluster
from e2e.kube import apply, get, pod, project_image, run_to_completion
from e2e.waiting import wait_for

pytestmark = pytest.mark.e2e

INSPECT = textwrap.dedent("""
    import json, os
    def read(path):
        try:
            return open(path).read()
        except OSError as e:
            return f"ERROR {e}"
    out = {
        "env": {k: os.environ.get(k) for k in ("POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE_NAME",
                "MEM_MI", "FROM_CM", "FROM_SECRET", "CM_color", "EXPANDED", "KUBERNETES_SERVICE_HOST",
                "KUBERNETES_SERVICE_PORT", "PEER_SERVICE_HOST", "PEER_SERVICE_PORT")},
        "config": read("/etc/app/color"),
        "secret": read("/etc/secret/password"),
        "labels": read("/etc/podinfo/labels"),
        "token_parts": len(read("/var/run/secrets/kubernetes.io/serviceaccount/token").split(".")),
        "namespace_file": read("/var/run/secrets/kubernetes.io/serviceaccount/namespace"),
        "shm_is_tmpfs": any(l.split()[1] == "/scratch-mem" and l.split()[2] == "tmpfs"
                            for l in open("/proc/mounts")) or os.path.realpath("/scratch-mem"),
        "hostname": open("/etc/hostname").read().strip(),
    }
    with open("/scratch-mem/probe", "w") as f:
        f.write("memory")
    out["shm_write"] = read("/scratch-mem/probe")
    # who the API server says this pod is: its service-account token over the in-cluster
    # address and CA, with the standard library alone
    import ssl, urllib.request
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    url = (f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
           "/apis/authentication.k8s.io/v1/selfsubjectreviews")
    request = urllib.request.Request(url, method="POST", data=json.dumps(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(), headers={
        "Authorization": "Bearer " + read(f"{sa}/token"), "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=f"{sa}/ca.crt"),
                                    timeout=10) as reply:
            out["whoami"] = json.load(reply)["status"]["userInfo"]["username"]
    except Exception as e:
        out["whoami"] = f"ERROR {e!r}"
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_volumes_and_environment(cluster: Cluster, namespace: str):
    apply(cluster, namespace, """
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: app}
        data: {color: blue}
        ---
        apiVersion: v1
        kind: Secret
        metadata: {name: creds}
        stringData: {password: s3cret}
        ---
        apiVersion: v1
        kind: Service
        metadata: {name: peer}
        spec: {ports: [{port: 7000}]}
    """)
    wait_for(lambda: get(cluster, namespace, "service", "peer")["spec"].get("clusterIP"), timeout=30,
             what="service peer")
    apply(cluster, namespace, f"""
        apiVersion: v1
        kind: Pod
        metadata: {{name: inspect, labels: {{tier: e2e}}}}
        spec:
          restartPolicy: Never
          containers:
          - name: main
            image: python:3.11
            command: [python, -c, {json.dumps(INSPECT)}]
            resources: {{limits: {{memory: 256Mi}}}}
            env:
            - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
            - {{name: POD_NAMESPACE, valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}}}
            - {{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
            - {{name: NODE_NAME, valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}}}
            - name: MEM_MI
              valueFrom: {{resourceFieldRef: {{resource: limits.memory, divisor: 1Mi}}}}
            - {{name: FROM_CM, valueFrom: {{configMapKeyRef: {{name: app, key: color}}}}}}
            - {{name: FROM_SECRET, valueFrom: {{secretKeyRef: {{name: creds, key: password}}}}}}
            - {{name: EXPANDED, value: "$(POD_NAME)-$(FROM_CM)"}}
            envFrom: [{{prefix: CM_, configMapRef: {{name: app}}}}]
            volumeMounts:
            - {{name: config, mountPath: /etc/app}}
            - {{name: secret, mountPath: /etc/secret}}
            - {{name: podinfo, mountPath: /etc/podinfo}}
            - {{name: mem, mountPath: /scratch-mem}}
          volumes:
          - {{name: config, configMap: {{name: app}}}}
          - {{name: secret, secret: {{secretName: creds}}}}
          - name: podinfo
            downwardAPI: {{items: [{{path: labels, fieldRef: {{fieldPath: metadata.labels}}}}]}}
          - {{name: mem, emptyDir: {{medium: Memory}}}}
    """)
    logs = run_to_completion(cluster, namespace, "inspect")
    result = json.loads(next(line for line in logs.splitlines() if line.startswith("RESULT "))[7:])
    pod = get(cluster, namespace, "pod", "inspect")
    env = result["env"]
    assert env["POD_NAME"] == "inspect" and env["POD_NAMESPACE"] == namespace
    assert env["POD_IP"] == pod["status"]["podIP"]
    assert env["NODE_NAME"] == pod["spec"]["nodeName"]
    assert env["MEM_MI"] == "256"
    assert env["FROM_CM"] == env["CM_color"] == "blue"
    assert env["FROM_SECRET"] == "s3cret"
    assert env["EXPANDED"] == "inspect-blue"
    assert env["KUBERNETES_SERVICE_PORT"] == "443" and env["KUBERNETES_SERVICE_HOST"]
    assert env["PEER_SERVICE_PORT"] == "7000"
    assert env["PEER_SERVICE_HOST"] == get(cluster, namespace, "service", "peer")["spec"]["clusterIP"]
    assert result["config"] == "blue" and result["secret"] == "s3cret"
    assert 'tier="e2e"' in result["labels"]
    assert result["token_parts"] == 3, "the service-account token is not a JWT"
    assert result["namespace_file"] == namespace
    assert result["shm_write"] == "memory"
    assert result["shm_is_tmpfs"] is True, f"emptyDir medium Memory is not tmpfs: {result['shm_is_tmpfs']}"
    assert result["hostname"] == "inspect"
    assert result["whoami"] == f"system:serviceaccount:{namespace}:default"


def test_probes_drive_readiness_and_restarts(cluster: Cluster, namespace: str):
    apply(cluster, namespace, pod("probes", """
        containers:
        - name: never-ready
          image: busybox:1.36
          command: [sleep, "3600"]
          readinessProbe: {tcpSocket: {port: 9999}, periodSeconds: 1}
        - name: flaky
          image: busybox:1.36
          # Healthy for 3 s after each start, then the liveness probe's file goes away.
          command: [sh, -c, "touch /scratch/healthy; sleep 3; rm /scratch/healthy; sleep 3600"]
          volumeMounts: [{name: scratch, mountPath: /scratch}]
          startupProbe: {exec: {command: [test, -f, /scratch/healthy]}, periodSeconds: 1}
          livenessProbe: {exec: {command: [test, -f, /scratch/healthy]}, periodSeconds: 1, failureThreshold: 2}
        - name: web
          image: python:3.11
          command: [python, -m, http.server, "8080", --directory, /tmp]
          readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 1}
        volumes: [{name: scratch, emptyDir: {}}]
    """))

    def statuses() -> dict:
        return {s["name"]: s for s in get(cluster, namespace, "pod", "probes")["status"].get("containerStatuses") or []}

    wait_for(lambda: statuses().get("web", {}).get("ready"), timeout=60, what="container web to be ready")
    wait_for(lambda: statuses()["flaky"]["restartCount"] >= 1, timeout=60,
             what="the liveness probe to restart container flaky")
    s = statuses()
    assert s["never-ready"]["ready"] is False and "running" in s["never-ready"]["state"]
    assert s["never-ready"]["restartCount"] == 0
    conds = {c["type"]: c["status"] for c in get(cluster, namespace, "pod", "probes")["status"]["conditions"]}
    assert conds["Ready"] == "False" and conds["ContainersReady"] == "False"
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             "involvedObject.name=probes,reason=Unhealthy", "-o", "json").stdout
    assert "Liveness probe failed" in events


def test_grpc_probe(cluster: Cluster, namespace: str):
    # the shard-server image has grpcio and its health service (kind loads it too)
    image = project_image("shard-server")
    server = textwrap.dedent("""
        from concurrent import futures
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = health.HealthServicer()
        servicer.set("kubeshard", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port("[::]:50051")
        server.start()
        server.wait_for_termination()
    """)
    apply(cluster, namespace, pod("grpc", f"""
        containers:
        - name: server
          image: {image}
          command: [python, -c, {json.dumps(server)}]
          readinessProbe: {{grpc: {{port: 50051, service: kubeshard}}, periodSeconds: 1}}
        - name: wrong-service
          image: {image}
          command: [python, -c, {json.dumps(server.replace("50051", "50052"))}]
          readinessProbe: {{grpc: {{port: 50052, service: other}}, periodSeconds: 1}}
    """))

    def ready() -> dict:
        return {s["name"]: s["ready"] for s in
                get(cluster, namespace, "pod", "grpc")["status"].get("containerStatuses") or []}

    wait_for(lambda: ready().get("server"), timeout=60, what="the gRPC health probe to pass")
    assert ready()["wrong-service"] is False


def test_unknown_image_fails_like_a_pull_error(cluster: Cluster, namespace: str):
    apply(cluster, namespace, pod("nope", """
        containers: [{name: c, image: registry.invalid/nobody/nothing:1}]
    """))

    def waiting() -> dict | None:
        statuses = get(cluster, namespace, "pod", "nope")["status"].get("containerStatuses") or []
        state = statuses[0]["state"].get("waiting") if statuses else None
        return state if state and state.get("reason") in ("ErrImagePull", "ImagePullBackOff") else None

    state = wait_for(waiting, timeout=60, what="an image pull error")
    assert "registry.invalid/nobody/nothing:1" in state.get("message", ""), state
    assert get(cluster, namespace, "pod", "nope")["status"]["phase"] == "Pending"


def test_init_containers_run_first_and_kubectl_logs_works(cluster: Cluster, namespace: str):
    apply(cluster, namespace, pod("init", """
        restartPolicy: Never
        initContainers:
        - name: prepare
          image: busybox:1.36
          command: [sh, -c, "echo prepared > /shared/ready"]
          volumeMounts: [{name: shared, mountPath: /shared}]
        containers:
        - name: main
          image: busybox:1.36
          command: [sh, -c, "cat /shared/ready; echo main-done"]
          volumeMounts: [{name: shared, mountPath: /shared}]
        volumes: [{name: shared, emptyDir: {}}]
    """))
    logs = run_to_completion(cluster, namespace, "init")
    assert "prepared" in logs and "main-done" in logs
    via_api = cluster.kubectl("logs", "init", "-n", namespace, "-c", "main").stdout
    assert via_api == logs
    init_status = get(cluster, namespace, "pod", "init")["status"]["initContainerStatuses"][0]
    assert init_status["state"]["terminated"]["exitCode"] == 0
