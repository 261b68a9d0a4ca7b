import pytest

from kubeshard_operator import builders as b
from kubeshard_operator import naming as n
from tests.operator.factories import CFG, OWNER_BODY, make_spec


def container(sts):
    return sts["spec"]["template"]["spec"]["containers"][0]


def flag(args, name):
    return args[args.index(name) + 1]


def test_statefulset_is_one_group_of_parallel_shards():
    spec = make_spec()
    sts = b.build_statefulset(spec, CFG, 1, b.owner_reference(OWNER_BODY))
    assert sts["metadata"]["name"] == "tiny-g1"
    assert sts["metadata"]["namespace"] == "ml"
    assert sts["spec"]["replicas"] == 2  # one pod per shard
    assert sts["spec"]["serviceName"] == "tiny-g1"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["selector"]["matchLabels"] == {n.LABEL_ISVC: "tiny", n.LABEL_GROUP: "1"}
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels[n.LABEL_GROUP] == "1" and labels["app.kubernetes.io/component"] == "shard"
    assert labels[n.LABEL_HASH] == b.template_hash(spec, CFG)
    assert labels["app.kubernetes.io/managed-by"] == "kubeshard-operator"
    owner = sts["metadata"]["ownerReferences"][0]
    assert owner == {"apiVersion": "kubeshard.io/v1alpha1", "kind": "InferenceService",
                     "name": "tiny", "uid": "uid-1", "controller": True,
                     "blockOwnerDeletion": True}


def test_shard_command_line_carries_rendezvous_and_engine_limits():
    spec = make_spec(engine={"maxInputTokens": 100, "maxTotalTokens": 200,
                             "kvCacheMemory": "0.5", "prefixCaching": False},
                     model={"source": "/m", "name": "llama", "dtype": "float32"})
    c = container(b.build_statefulset(spec, CFG, 0))
    args = c["args"]
    assert args[0] == "serve-shard"
    assert flag(args, "--headless-service") == "tiny-g0"
    assert flag(args, "--shards") == "2" and flag(args, "--strategy") == "tensor"
    assert flag(args, "--model") == "/models/model" and flag(args, "--model-id") == "llama"
    assert flag(args, "--dtype") == "float32" and flag(args, "--device") == "cpu"
    assert flag(args, "--port") == "50051" and flag(args, "--master-port") == "29500"
    assert flag(args, "--max-input-tokens") == "100"
    assert flag(args, "--max-total-tokens") == "200"
    assert flag(args, "--kv-cache-memory") == "0.5"
    assert "--no-prefix-caching" in args and "--max-batch-tokens" not in args
    assert flag(args, "--num-threads") == "1"  # the CPU request, not the node's cores
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def model_pod(source: str) -> tuple[dict, dict, dict | None]:
    """The shard pod of a spec serving ``source``: (pod spec, its model volume, the
    container's mount of it)."""
    pod = b.build_statefulset(make_spec(model={"source": source}), CFG, 0)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    mount = next((m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"), None)
    return pod, volume, mount


def test_host_path_model_is_mounted_read_only():
    _, volume, mount = model_pod("file:///data/llama")
    assert volume["hostPath"] == {"path": "/data/llama", "type": "Directory"}
    assert mount == {"name": "model", "mountPath": "/models/model", "readOnly": True}


def test_a_gguf_file_on_the_host_is_mounted_as_a_file_and_served_from_it():
    pod, volume, mount = model_pod("/data/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert volume["hostPath"] == {"path": "/data/SmolLM2-135M-Instruct.Q4_1.gguf", "type": "File"}
    assert mount == {"name": "model", "mountPath": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "readOnly": True}
    assert flag(pod["containers"][0]["args"], "--model") == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    # a GGUF file inside a claim is served from its path in the claim
    pod, _, _ = model_pod("pvc://weights/gguf/model.Q8_0.gguf")
    assert flag(pod["containers"][0]["args"], "--model") == "/models/pvc/gguf/model.Q8_0.gguf"


def test_pvc_model_points_inside_the_claim():
    pod, volume, _ = model_pod("pvc://weights/llama/7b")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert flag(pod["containers"][0]["args"], "--model") == "/models/pvc/llama/7b"


def test_hf_model_is_downloaded_by_an_init_container():
    spec = make_spec(model={"source": "hf://org/name@v2",
                            "tokenSecretRef": {"name": "hf", "key": "tok"}})
    pod = b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"][:3] == ["hf", "download", "org/name"]
    assert flag(init["command"], "--revision") == "v2"
    assert flag(init["command"], "--local-dir") == "/models/model"
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "tok"}
    assert next(v for v in pod["volumes"] if v["name"] == "model")["emptyDir"] == {}


def test_pods_get_shared_memory_probes_and_a_restricted_context():
    spec = make_spec(pod={"shmSize": "2Gi", "startupTimeoutSeconds": 600})
    pod = b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["readinessProbe"]["grpc"] == {"port": 50051}
    assert c["startupProbe"]["grpc"] == {"port": 50051}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False


def test_gpus_select_the_cuda_image_limits_and_toleration():
    spec = make_spec(resources={"gpu": 1, "memory": "40Gi", "cpu": "4"})
    pod = b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "ghcr.io/kubeshard/shard-server:test-cuda"
    assert flag(c["args"], "--device") == "cuda"
    assert "--num-threads" not in c["args"]
    assert c["resources"]["limits"] == {"memory": "40Gi", "nvidia.com/gpu": 1}
    assert c["resources"]["requests"]["cpu"] == "4"
    assert "cpu" not in c["resources"]["limits"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["tolerations"]


def test_pod_overrides_apply_and_user_env_wins():
    spec = make_spec(pod={"image": "my/shard:1", "nodeSelector": {"pool": "gpu"},
                          "env": [{"name": "HOME", "value": "/home"},
                                  {"name": "EXTRA", "value": "1"}],
                          "labels": {"team": "ml", n.LABEL_ISVC: "spoofed"}})
    tpl = b.build_statefulset(spec, CFG, 0)["spec"]["template"]
    c = tpl["spec"]["containers"][0]
    assert c["image"] == "my/shard:1"
    assert tpl["spec"]["nodeSelector"] == {"pool": "gpu"}
    env = [(e["name"], e.get("value")) for e in c["env"]]
    assert ("HOME", "/home") in env and ("EXTRA", "1") in env
    assert len({name for name, _ in env}) == len(env)  # one entry per name
    assert tpl["metadata"]["labels"]["team"] == "ml"
    assert tpl["metadata"]["labels"][n.LABEL_ISVC] == "tiny"  # ours win


def test_template_hash_ignores_replicas_and_autoscaling_but_not_engine_limits():
    base = b.template_hash(make_spec(), CFG)
    assert b.template_hash(make_spec(replicas=5), CFG) == base
    assert b.template_hash(make_spec(autoscaling={"maxReplicas": 4}), CFG) == base
    assert b.template_hash(make_spec(engine={"maxTotalTokens": 512}), CFG) != base
    assert b.template_hash(make_spec(sharding={"shards": 4}), CFG) != base


def test_headless_service_publishes_loading_pods():
    svc = b.build_headless_service(make_spec(), 3)
    assert svc["metadata"]["name"] == "tiny-g3"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {n.LABEL_ISVC: "tiny", n.LABEL_GROUP: "3"}


def test_leader_service_selects_rank_zero_and_follows_the_router_contract():
    svc = b.build_leader_service(make_spec())
    labels = svc["metadata"]["labels"]
    assert labels[n.LABEL_ISVC] == "tiny" and labels[n.LABEL_ROLE] == "leader"
    assert svc["spec"]["selector"][n.LABEL_POD_INDEX] == "0"
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "shard"
    assert svc["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc",
                                     "protocol": "TCP", "appProtocol": "grpc"}]


def test_pdb_allows_one_shard_down_at_a_time():
    pdb = b.build_pdb(make_spec())
    assert pdb["spec"] == {"maxUnavailable": 1,
                           "selector": {"matchLabels": n.shard_selector("tiny")}}


def test_hpa_targets_the_scale_subresource_and_never_goes_below_one():
    assert b.build_hpa(make_spec()) is None
    hpa = b.build_hpa(make_spec(autoscaling={"minReplicas": 0, "maxReplicas": 4}))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "kubeshard.io/v1alpha1",
                                             "kind": "InferenceService", "name": "tiny"}
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 4
    metric = hpa["spec"]["metrics"][0]
    assert metric["object"]["metric"]["name"] == "concurrency"
    assert metric["object"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    cpu = b.build_hpa(make_spec(autoscaling={"maxReplicas": 2, "metric": "cpu", "target": 70}))
    assert cpu["spec"]["metrics"][0]["resource"]["target"] == {
        "type": "Utilization", "averageUtilization": 70}


@pytest.mark.parametrize("metric, name", [("tokensInFlight", "tokens_in_flight"), ("queueDepth", "queue_depth")])
def test_hpa_on_a_token_or_queue_metric_keeps_the_specs_target_and_stabilization_windows(metric, name):
    hpa = b.build_hpa(make_spec(autoscaling={"minReplicas": 0, "maxReplicas": 3, "metric": metric, "target": 1500,
                                             "scaleUpStabilizationSeconds": 15,
                                             "scaleDownStabilizationSeconds": 240}))
    (m,) = hpa["spec"]["metrics"]
    assert m == {"type": "Object", "object": {
        "describedObject": {"apiVersion": "kubeshard.io/v1alpha1", "kind": "InferenceService", "name": "tiny"},
        "metric": {"name": name},
        "target": {"type": "AverageValue", "averageValue": "1500"}}}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 15
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 240
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]


def test_hpa_defaults_for_tokens_in_flight():
    hpa = b.build_hpa(make_spec(autoscaling={"maxReplicas": 2, "metric": "tokensInFlight"}))
    assert hpa["spec"]["metrics"][0]["object"]["target"] == {"type": "AverageValue", "averageValue": "2048"}
    assert hpa["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300  # the spec default


def test_url_points_at_the_router_or_the_leader_service():
    from kubeshard_operator.config import OperatorConfig
    spec = make_spec(model={"source": "/m", "name": "llama"})
    assert b.service_url(spec, CFG) == \
        "http://kubeshard-router.kubeshard.svc:8080/models/tiny"
    assert b.service_url(spec, OperatorConfig()) == "grpc://tiny.ml.svc:50051"


def test_shards_get_the_activation_cache_settings_and_redis():
    from dataclasses import replace

    from kubeshard_operator.shard_pod import shard_redis_url

    spec = make_spec(cache={"activations": {"minHits": 3, "ttlSeconds": 120, "maxBytes": "256Mi"}})
    cfg = replace(CFG, redis_url="redis://kubeshard-redis.kubeshard.svc:6379/0")
    c = container(b.build_statefulset(spec, cfg, 0))
    args = c["args"]
    assert flag(args, "--redis-key-model") == "tiny"      # metadata.name: the finalizer cleans kubeshard:tiny:*
    assert flag(args, "--activation-cache-min-hits") == "3" and flag(args, "--activation-cache-ttl") == "120"
    assert flag(args, "--activation-cache-max-bytes") == str(256 * 1024**2)
    assert "--no-activation-cache" not in args
    env = {e["name"]: e for e in c["env"]}
    assert env["KUBESHARD_REDIS_URL"]["value"] == "redis://kubeshard-redis.kubeshard.svc:6379/0"
    off = container(b.build_statefulset(make_spec(cache={"activations": {"enabled": False}}), cfg, 0))
    assert "--no-activation-cache" in off["args"]
    # no Redis, or one whose URL carries a password: the pods get no URL (the cache stays off)
    assert "KUBESHARD_REDIS_URL" not in {e["name"] for e in container(b.build_statefulset(spec, CFG, 0))["env"]}
    assert shard_redis_url("redis://:secret@redis:6379/0") is None
    assert shard_redis_url("rediss://user:pw@redis:6380") is None
    assert shard_redis_url("redis://redis:6379/0") == "redis://redis:6379/0"


def test_a_redis_url_secret_reaches_the_shards_as_a_reference_only():
    """spec.cache.activations.urlSecretRef: the kubelet reads the URL (and its password)
    from the Secret; the pod spec holds the reference, whatever the operator's Redis."""
    from dataclasses import replace

    from kubeshard_operator import engine_pod

    ref = {"cache": {"activations": {"urlSecretRef": {"name": "team-redis"}}}}
    for operator_url in (None, "redis://kubeshard-redis:6379/0", "redis://:secret@redis:6379/0"):
        cfg = replace(CFG, redis_url=operator_url)
        env = [e for e in container(b.build_statefulset(make_spec(**ref), cfg, 0))["env"]
               if e["name"] == "KUBESHARD_REDIS_URL"]
        assert env == [{"name": "KUBESHARD_REDIS_URL",
                        "valueFrom": {"secretKeyRef": {"name": "team-redis", "key": "url"}}}]
    keyed = make_spec(cache={"activations": {"urlSecretRef": {"name": "team-redis", "key": "activations"}}})
    env = {e["name"]: e for e in container(b.build_statefulset(keyed, CFG, 0))["env"]}
    assert env["KUBESHARD_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "activations"
    # a peer engine has no activation cache: its pods get no Redis at all
    peer = make_spec(runtime={"name": "vllm"}, **ref)
    pod = engine_pod.pod_template(peer, CFG, 0)
    assert "KUBESHARD_REDIS_URL" not in str(pod)
