"""The cluster itself: a real API server, real controllers, pods that really run.

These tests run unchanged on the local cluster (a real kubelet with containerd) and on
kind (KUBESHARD_E2E_KUBECONFIG); the few checks only a local node can make are marked so.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import urllib.request
import uuid

import pytest

from e2e.cluster import Cluster
from e2e.kube import apply, deployment, get, is_ready, pod, pods, run_to_completion
from e2e.waiting import wait_for

pytestmark = pytest.mark.e2e

# A tiny HTTP server that answers with the pod's hostname (stdlib only, so it runs on the
# real python image too).
HOSTNAME_SERVER = textwrap.dedent("""
    import http.server, socket
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = socket.gethostname().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.ThreadingHTTPServer(("", 8080), H).serve_forever()
""")


def test_crd_schema_accepts_valid_and_refuses_invalid_objects(cluster: Cluster, namespace: str):
    group = f"t{uuid.uuid4().hex[:8]}.e2e.kubeshard.io"
    crd = f"widgets.{group}"
    apply(cluster, None, f"""
        apiVersion: apiextensions.k8s.io/v1
        kind: CustomResourceDefinition
        metadata: {{name: {crd}}}
        spec:
          group: {group}
          scope: Namespaced
          names: {{plural: widgets, singular: widget, kind: Widget}}
          versions:
          - name: v1
            served: true
            storage: true
            schema:
              openAPIV3Schema:
                type: object
                properties:
                  spec:
                    type: object
                    required: [size]
                    properties:
                      size: {{type: integer, minimum: 1, maximum: 10}}
                      color: {{type: string, enum: [red, blue]}}
    """)
    try:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s", timeout=70)
        widget = f"""
            apiVersion: {group}/v1
            kind: Widget
            metadata: {{name: %s}}
            spec: {{size: %s, color: %s}}
        """
        apply(cluster, namespace, widget % ("good", 3, "red"))
        assert get(cluster, namespace, "widget", "good")["spec"] == {"size": 3, "color": "red"}

        bad = apply(cluster, namespace, widget % ("bad", 42, "green"), check=False)
        assert bad.returncode != 0, f"an invalid widget was accepted:\n{bad.stdout}"
        assert "spec.size: Invalid value: 42" in bad.stderr, bad.stderr
        assert "should be less than or equal to 10" in bad.stderr, bad.stderr
        assert 'Unsupported value: "green"' in bad.stderr, bad.stderr
        missing = cluster.kubectl("get", "widget", "bad", "-n", namespace, check=False)
        assert missing.returncode != 0 and "NotFound" in missing.stderr
    finally:
        cluster.kubectl("delete", "crd", crd, "--wait=false", check=False)


def test_deployment_service_endpointslice_and_dns(cluster: Cluster, namespace: str):
    apply(cluster, namespace, deployment("web", 2, """
        containers:
        - name: http
          image: python:3.11
          command: [python, -m, http.server, "8080", --directory, /tmp]
          ports: [{name: http, containerPort: 8080}]
          readinessProbe: {httpGet: {path: /, port: http}, periodSeconds: 1}
    """), """
        apiVersion: v1
        kind: Service
        metadata: {name: web}
        spec:
          selector: {app: web}
          ports: [{name: http, port: 80, targetPort: http}]
    """)
    cluster.kubectl("wait", "--for=condition=Available", "deployment/web", "-n", namespace,
                    "--timeout=120s", timeout=130)
    web = wait_for(lambda: [p for p in pods(cluster, namespace, "app=web") if is_ready(p)]
                   if len([p for p in pods(cluster, namespace, "app=web") if is_ready(p)]) == 2 else None,
                   timeout=60, what="two Running and Ready web pods")
    ips = {p["status"]["podIP"] for p in web}
    assert len(ips) == 2, f"pods share an IP: {ips}"

    def slice_addresses():
        slices = get(cluster, namespace, "endpointslices", "-l", "kubernetes.io/service-name=web")["items"]
        return {a for s in slices for e in s.get("endpoints") or []
                if (e.get("conditions") or {}).get("ready") for a in e["addresses"]}

    wait_for(lambda: slice_addresses() == ips, timeout=30,
             what=f"the web EndpointSlice to list exactly {sorted(ips)}")

    if cluster.is_local:  # the host reaches pod IPs directly, as a node does
        for ip in ips:
            assert urllib.request.urlopen(f"http://{ip}:8080/", timeout=5).status == 200

    apply(cluster, namespace, pod("client", f"""
        restartPolicy: Never
        containers:
        - name: client
          image: python:3.11
          command: [python, -c]
          args:
          - |
            import urllib.request
            for url in ("http://web/", "http://web.{namespace}.svc.cluster.local:80/"):
                print(url, urllib.request.urlopen(url, timeout=10).status, flush=True)
    """))
    logs = run_to_completion(cluster, namespace, "client")
    assert "http://web/ 200" in logs, logs
    assert f"http://web.{namespace}.svc.cluster.local:80/ 200" in logs, logs


def test_statefulset_pods_reach_each_other_by_stable_dns_names(cluster: Cluster, namespace: str):
    apply(cluster, namespace, f"""
        apiVersion: v1
        kind: Service
        metadata: {{name: web}}
        spec:
          clusterIP: None
          selector: {{app: sts-web}}
          ports: [{{name: http, port: 8080}}]
        ---
        apiVersion: apps/v1
        kind: StatefulSet
        metadata: {{name: web}}
        spec:
          serviceName: web
          replicas: 2
          selector: {{matchLabels: {{app: sts-web}}}}
          template:
            metadata: {{labels: {{app: sts-web}}}}
            spec:
              containers:
              - name: http
                image: python:3.11
                command: [python, -c, {json.dumps(HOSTNAME_SERVER)}]
                ports: [{{name: http, containerPort: 8080}}]
                readinessProbe: {{tcpSocket: {{port: 8080}}, periodSeconds: 1}}
    """)
    wait_for(lambda: get(cluster, namespace, "statefulset", "web")["status"].get("readyReplicas") == 2,
             timeout=120, what="StatefulSet web to have 2 ready replicas")
    url = f"http://web-0.web.{namespace}.svc.cluster.local:8080/"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    # DNS publishes a pod once its endpoint is ready; allow the EndpointSlice a moment.
    out = wait_for(lambda: cluster.exec(namespace, "web-1", "python", "-c", code, timeout=30).stdout.strip(),
                   timeout=30, what=f"web-1 to fetch {url}")
    assert out == "web-0", f"web-0's stable name reached {out!r}"


def test_service_account_rbac_is_enforced_inside_pods(cluster: Cluster, namespace: str):
    # Standard library only: the same script runs in the real python image on kind.
    script = textwrap.dedent("""
        import json, os, ssl, urllib.error, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        token = open(f"{sa}/token").read()
        ns = open(f"{sa}/namespace").read()
        ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
        base = "https://%s:%s" % (os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
        def get(path):
            req = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + token})
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                    return r.status, json.load(r)
            except urllib.error.HTTPError as e:
                return e.code, json.load(e)
        status, pod = get(f"/api/v1/namespaces/{ns}/pods/{os.environ['POD_NAME']}")
        print("GET pod", status, pod.get("metadata", {}).get("name"))
        status, body = get(f"/api/v1/namespaces/{ns}/secrets")
        print("LIST secrets", status, body.get("message"))
    """)
    apply(cluster, namespace, f"""
        apiVersion: v1
        kind: ServiceAccount
        metadata: {{name: reader}}
        ---
        apiVersion: rbac.authorization.k8s.io/v1
        kind: Role
        metadata: {{name: pod-getter}}
        rules: [{{apiGroups: [""], resources: [pods], verbs: [get]}}]
        ---
        apiVersion: rbac.authorization.k8s.io/v1
        kind: RoleBinding
        metadata: {{name: reader-gets-pods}}
        roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-getter}}
        subjects: [{{kind: ServiceAccount, name: reader, namespace: {namespace}}}]
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: rbac-check}}
        spec:
          serviceAccountName: reader
          restartPolicy: Never
          containers:
          - name: check
            image: python:3.11
            command: [python, -c, {json.dumps(script)}]
            env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
    """)
    logs = run_to_completion(cluster, namespace, "rbac-check")
    assert "GET pod 200 rbac-check" in logs, logs
    assert "LIST secrets 403" in logs, logs
    assert f'User "system:serviceaccount:{namespace}:reader" cannot list resource "secrets"' in logs, logs


def test_crashing_container_restarts_with_growing_restart_count(cluster: Cluster, namespace: str):
    apply(cluster, namespace, pod("crasher", """
        containers:
        - name: crash
          image: busybox:1.36
          command: [sh, -c, "echo crashing; exit 3"]
    """))

    def restarts() -> int:
        statuses = get(cluster, namespace, "pod", "crasher")["status"].get("containerStatuses") or []
        return statuses[0]["restartCount"] if statuses else 0

    first = wait_for(lambda: restarts() >= 1 and restarts(), timeout=90, what="a first restart")
    later = wait_for(lambda: restarts() > first and restarts(), timeout=120,
                     what=f"restartCount to grow beyond {first}")
    assert later > first
    status = get(cluster, namespace, "pod", "crasher")["status"]
    container = status["containerStatuses"][0]
    assert container["lastState"]["terminated"]["exitCode"] == 3, container
    assert status["phase"] == "Running", status["phase"]
    # The last dead run's log is kept: the kubelet keeps one dead container per container
    # (it removes the one before when the next dies). While the pod waits out its back-off
    # that run is the "previous" one; between its exit and the back-off's start (kind's
    # kubelet reports it for a while) it is still the current one. A fetch racing a
    # restart can miss it; the next one finds the newer run.
    def last_run_log() -> str:
        state = get(cluster, namespace, "pod", "crasher")["status"]["containerStatuses"][0]["state"]
        if "running" in state:
            return ""
        return cluster.pod_logs(namespace, "crasher", previous="waiting" in state)

    wait_for(lambda: "crashing" in last_run_log(), timeout=30, what="the last run's log")


def test_deleting_a_deployment_removes_its_pods_and_processes(cluster: Cluster, namespace: str):
    apply(cluster, namespace, deployment("sleeper", 2, """
        terminationGracePeriodSeconds: 5
        containers:
        - name: sleep
          image: busybox:1.36
          command: [sleep, "3600"]
    """))
    cluster.kubectl("wait", "--for=condition=Available", "deployment/sleeper", "-n", namespace,
                    "--timeout=120s", timeout=130)
    names = [p["metadata"]["name"] for p in pods(cluster, namespace, "app=sleeper")]
    assert len(names) == 2
    pids = [pid for n in names for pid in cluster.pod_pids(namespace, n)] if cluster.is_local else []
    if cluster.is_local:
        assert len(pids) == 2, f"expected one process per pod, found {pids}"

    cluster.kubectl("delete", "deployment", "sleeper", "-n", namespace, "--wait=false")
    wait_for(lambda: not pods(cluster, namespace, "app=sleeper"), timeout=60,
             what="the garbage collector to delete the sleeper pods")
    assert not get(cluster, namespace, "replicasets", "-l", "app=sleeper")["items"]
    if cluster.is_local:
        def gone(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except OSError:
                return True

        wait_for(lambda: all(gone(p) for p in pids), timeout=30, what=f"processes {pids} to exit")


APISERVICE_BACKEND = textwrap.dedent("""
    import http.server, json, ssl
    GROUP = "%s"
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            peer = self.connection.getpeercert() or {}
            cn = [v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]
            body = json.dumps({
                "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP + "/v1",
                "resources": [{"name": "whoami-" + (self.headers.get("X-Remote-User") or "nobody")
                               .replace(":", "."), "singularName": "", "namespaced": False,
                               "kind": "CN-" + (cn[0] if cn else "none"), "verbs": ["get"]}],
            }).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain("/tls/tls.crt", "/tls/tls.key")
    ctx.load_verify_locations("/tls/front-proxy-ca.crt")
    ctx.verify_mode = ssl.CERT_OPTIONAL  # discovery probes come without a client certificate
    server = http.server.ThreadingHTTPServer(("", 8443), H)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.serve_forever()
""")


def _self_signed(cn: str) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode())


def test_aggregation_layer_proxies_to_an_apiservice_backend(cluster: Cluster, namespace: str):
    group = f"t{uuid.uuid4().hex[:8]}.e2e.kubeshard.io"
    # The backend authenticates the aggregator with the front-proxy CA, as a real
    # extension API server does (it reads it from this ConfigMap).
    auth = json.loads(cluster.kubectl("get", "configmap", "extension-apiserver-authentication", "-n",
                                      "kube-system", "-o", "json").stdout)["data"]
    cert, key = _self_signed(f"backend.{namespace}.svc")
    cluster.kubectl("create", "secret", "generic", "tls", "-n", namespace,
                    "--from-literal=tls.crt=" + cert, "--from-literal=tls.key=" + key,
                    "--from-literal=front-proxy-ca.crt=" + auth["requestheader-client-ca-file"])
    apply(cluster, namespace, f"""
        apiVersion: v1
        kind: Pod
        metadata: {{name: backend, labels: {{app: backend}}}}
        spec:
          containers:
          - name: api
            image: python:3.11
            command: [python, -c, {json.dumps(APISERVICE_BACKEND % group)}]
            ports: [{{containerPort: 8443}}]
            readinessProbe: {{tcpSocket: {{port: 8443}}, periodSeconds: 1}}
            volumeMounts: [{{name: tls, mountPath: /tls}}]
          volumes: [{{name: tls, secret: {{secretName: tls}}}}]
        ---
        apiVersion: v1
        kind: Service
        metadata: {{name: backend}}
        spec:
          selector: {{app: backend}}
          ports: [{{port: 443, targetPort: 8443}}]
    """)
    apply(cluster, None, f"""
        apiVersion: apiregistration.k8s.io/v1
        kind: APIService
        metadata: {{name: v1.{group}}}
        spec:
          group: {group}
          version: v1
          service: {{namespace: {namespace}, name: backend, port: 443}}
          insecureSkipTLSVerify: true
          groupPriorityMinimum: 1000
          versionPriority: 15
    """)
    try:
        cluster.kubectl("wait", "--for=condition=Available", f"apiservice/v1.{group}", "--timeout=90s",
                        timeout=100)
        # Available comes from the aggregator's availability check; its proxy for the group
        # is installed by another controller and may answer 503 for a moment after that
        listing = json.loads(wait_for(lambda: cluster.kubectl("get", "--raw", f"/apis/{group}/v1").stdout, 30,
                                      what=f"the aggregator to proxy /apis/{group}/v1"))
        resource = listing["resources"][0]
        assert listing["groupVersion"] == f"{group}/v1"
        assert resource["name"] == "whoami-kubernetes-admin", resource  # X-Remote-User from the aggregator
        assert resource["kind"] == "CN-front-proxy-client", resource  # its proxy client certificate
    finally:
        cluster.kubectl("delete", "apiservice", f"v1.{group}", "--wait=false", check=False)


def oci_image_tarball(path, ref: str, payload: bytes) -> str:
    """Writes a one-layer OCI image archive named `ref` (as `ctr images import` reads it);
    returns its layer's digest."""
    import hashlib
    import io
    import tarfile

    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("payload")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer_desc = blob(layer.getvalue(), "application/vnd.oci.image.layer.v1.tar")
    config = {"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/payload"]},
              "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
                "layers": [layer_desc]}
    manifest_desc = blob(json.dumps(manifest).encode(), manifest["mediaType"])
    manifest_desc["annotations"] = {"io.containerd.image.name": ref}
    files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
             "index.json": json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}).encode()}
    files.update({f"blobs/sha256/{d.split(':')[1]}": data for d, data in blobs.items()})
    with tarfile.open(path, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return layer_desc["digest"]


def test_a_rebuilt_image_replaces_the_earlier_build_in_the_nodes_store(cluster: Cluster, tmp_path):
    """A new tarball of an image group (hack/images.sh's GROUP-HASH.tar) removes what the
    group's earlier tarball imported, its layers, snapshots and CRI ID record included,
    before it is imported: the node's store does not grow with every rebuild."""
    if not cluster.is_local:
        pytest.skip("kind loads its images itself")
    from e2e.cluster.kubelet import containerd
    from e2e.cluster.local import LocalCluster

    c = LocalCluster().config
    assert c is not None
    builds = []
    for n in (1, 2):
        ref, tarball = f"kubeshard.test/rebuilt:{n}", tmp_path / f"e2erebuilt-{n}{n}{n}.tar"
        builds.append((ref, tarball, oci_image_tarball(tarball, ref, f"build {n}\n".encode())))

    def layers() -> str:
        return containerd.ctr(c, "content", "ls", "--quiet").stdout

    stamps = containerd.root_dir(c) / "imported"
    others = {r: d for r, d in containerd.image_digests(c).items() if not r.startswith("sha256:")}
    try:
        containerd.import_images(c, [builds[0][1]])
        assert builds[0][0] in containerd.image_refs(c) and builds[0][2] in layers()
        containerd.import_images(c, [builds[1][1]])
        listed = containerd.image_digests(c)
        assert builds[1][0] in listed and builds[0][0] not in listed
        assert builds[0][2] not in layers() and builds[1][2] in layers()
        ids = {d for r, d in listed.items() if r.startswith("sha256:")}
        assert ids <= set(listed[r] for r in listed if not r.startswith("sha256:")), "an ID record without a name"
        assert {r: listed.get(r) for r in others} == others  # the other images are untouched
        assert [s.name for s in stamps.glob("e2erebuilt-*")] == [builds[1][1].name + ".refs"]
    finally:
        containerd.remove_images(c, [ref for ref, _, _ in builds])
        for stamp in stamps.glob("e2erebuilt-*"):
            stamp.unlink()


@pytest.mark.slow
@pytest.mark.cluster_lifecycle
def test_make_cluster_then_cluster_down_leaves_nothing_behind(cluster: Cluster):
    """Runs last (see conftest): it stops the session's cluster to start its own."""
    if not cluster.is_local:
        pytest.skip("only the local cluster is started by `make cluster`")
    from e2e.cluster.local import LocalCluster
    from e2e.cluster.sharing import _live_sessions

    local = LocalCluster()
    owner = (local.state_dir / "owner").read_text().strip() if (local.state_dir / "owner").exists() else ""
    others = [s for s in _live_sessions(local.state_dir) if s.name != str(os.getpid())]
    if owner != "pytest" or others:
        pytest.skip(f"the cluster in {local.state_dir} is shared (owner {owner!r}, other sessions "
                    f"{[s.name for s in others]}); not stopping it under someone else")
    local.down()
    assert not local.leftovers(), "the session cluster's teardown left things behind"

    up = make("cluster")
    try:  # a failed check must not leave this cluster running
        kubeconfig = up.stdout.strip().splitlines()[-1]
        assert kubeconfig.endswith(".cache/cluster/kubeconfig"), up.stdout
        nodes = cluster.kubectl("--kubeconfig", kubeconfig, "get", "nodes", "-o", "name").stdout
        assert "node/kubeshard-node-0" in nodes
        apply(cluster, "default", """
            apiVersion: v1
            kind: Pod
            metadata: {name: lifecycle-probe}
            spec:
              containers:
              - name: sleep
                image: busybox:1.36
                command: [sleep, "3600"]
                volumeMounts: [{name: scratch, mountPath: /kubeshard-e2e-scratch}]
              volumes: [{name: scratch, emptyDir: {medium: Memory}}]
        """)
        wait_for(lambda: is_ready(get(cluster, "default", "pod", "lifecycle-probe")), timeout=60,
                 what="a pod running before cluster-down")
        config = LocalCluster().config
        assert config is not None
        expected = ("kube-apiserver process", "containerd process", "kubelet process",
                    "containerd-shim process", f"interface ksnode{config.instance}",
                    f"table ip kubeshard-node{config.instance}", "iptables chain nat/KUBE-SERVICES",
                    "iptables chain filter/KUBE-ROUTER-", "mount ", "cgroup ")

        def sees_everything() -> list[str] | None:
            running = LocalCluster().leftovers()
            return running if all(any(w in r for r in running) for w in expected) else None

        # The check must see a running cluster's parts, or "nothing left" would prove nothing.
        wait_for(sees_everything, timeout=15, what=f"the leftover check to see all of {expected}")
    finally:
        make("cluster-down")
    seen: list[str] = []

    def clean() -> bool:
        seen[:] = LocalCluster().leftovers()
        return not seen

    try:
        wait_for(clean, timeout=20, what="nothing left after `make cluster-down`")
    except AssertionError as e:
        raise AssertionError(f"{e}; still there: {seen}") from None


def make(target: str) -> subprocess.CompletedProcess:
    """Run a Makefile target as a developer would (install is assumed done)."""
    from e2e.cluster.config import REPO_ROOT

    # --no-print-directory: under `make test` this is a nested make, which would otherwise
    # print "Entering/Leaving directory" lines around the output
    proc = subprocess.run(["make", "--no-print-directory", "-o", "install", target], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"make {target} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc
