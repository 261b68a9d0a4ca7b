import pytest

from kubeshard_operator.spec import ModelSource, SpecError, parse_spec
from tests.operator.factories import make_spec, spec_dict


def test_defaults_fill_every_optional_field():
    spec = parse_spec("tiny", "ml", {"model": {"source": "/models/x"}})
    assert spec.replicas == 1
    assert (spec.sharding.strategy, spec.sharding.shards) == ("tensor", 1)
    assert spec.model.name == "tiny"  # served name defaults to the object's name
    assert spec.model.revision == "main"
    assert spec.model.dtype == "auto"
    assert spec.resources.gpu == 0 and spec.resources.cpu is None
    assert spec.autoscaling is None
    assert spec.engine.block_size == 16 and spec.engine.prefix_caching is True
    assert spec.pod.shm_size == "1Gi" and spec.pod.startup_timeout_seconds == 1800


@pytest.mark.parametrize("uri, kind, location, path, revision", [
    ("hf://org/name@v1", "hf", "org/name", "", "v1"),
    ("hf://gpt2", "hf", "gpt2", "", None),
    ("pvc://models/llama/7b", "pvc", "models", "llama/7b", None),
    ("pvc://models", "pvc", "models", "", None),
    ("file:///data/llama", "host", "/data/llama", "", None),
    ("/data/llama/", "host", "/data/llama", "", None),
])
def test_model_sources(uri, kind, location, path, revision):
    assert ModelSource.parse(uri) == ModelSource(kind=kind, location=location, path=path,
                                                 revision=revision)


def test_hf_revision_comes_from_the_uri():
    spec = make_spec(model={"source": "hf://org/name@abc123"})
    assert spec.model.revision == "abc123"


@pytest.mark.parametrize("overrides, field", [
    ({"sharding": {"shards": 0}}, "spec.sharding.shards"),
    ({"sharding": {"strategy": "pipeline"}}, "spec.sharding.strategy"),
    ({"model": {"source": "s3://bucket/x"}}, "spec.model.source"),
    ({"model": {"source": ""}}, "spec.model.source"),
    ({"model": {"source": "pvc://claim/../etc"}}, "spec.model.source"),
    ({"model": {"source": "hf://o/n@v1", "revision": "v2"}}, "spec.model.revision"),
    ({"resources": {"cpu": "-1"}}, "spec.resources.cpu"),
    ({"resources": {"memory": "lots"}}, "spec.resources.memory"),
    ({"resources": {"gpu": -1}}, "spec.resources.gpu"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({"autoscaling": {"minReplicas": 0}}, "spec.autoscaling.maxReplicas"),
    ({"autoscaling": {"maxReplicas": 2, "idleSeconds": -5}}, "spec.autoscaling.idleSeconds"),
    ({"engine": {"maxInputTokens": 300, "maxTotalTokens": 200}}, "spec.engine.maxInputTokens"),
    ({"engine": {"kvCacheMemory": "1.5"}}, "spec.engine.kvCacheMemory"),
    ({"engine": {"kvCacheMemory": "-2Gi"}}, "spec.engine.kvCacheMemory"),
    ({"replicas": -1}, "spec.replicas"),
    ({"replicas": "two"}, "spec.replicas"),
    ({"pod": {"env": [{"value": "x"}]}}, "spec.pod.env[0].name"),
    ({"cache": {"activations": {"minHits": 0}}}, "spec.cache.activations.minHits"),
    ({"cache": {"activations": {"ttlSeconds": 0}}}, "spec.cache.activations.ttlSeconds"),
    ({"cache": {"activations": {"maxBytes": "lots"}}}, "spec.cache.activations.maxBytes"),
    ({"cache": {"activations": {"maxBytes": "0"}}}, "spec.cache.activations.maxBytes"),
    ({"cache": {"activations": {"urlSecretRef": {}}}}, "spec.cache.activations.urlSecretRef.name"),
    ({"cache": {"activations": {"urlSecretRef": "redis"}}}, "spec.cache.activations.urlSecretRef.name"),
    ({"cache": {"activations": {"urlSecretRef": {"name": "Team_Redis"}}}}, "spec.cache.activations.urlSecretRef.name"),
    ({"cache": {"activations": {"urlSecretRef": {"name": "r", "key": "a/b"}}}},
     "spec.cache.activations.urlSecretRef.key"),
    ({"model": {"source": "hf://o/n", "tokenSecretRef": {"key": "t"}}}, "spec.model.tokenSecretRef.name"),
])
def test_bad_specs_name_the_field(overrides, field):
    with pytest.raises(SpecError) as info:
        parse_spec("tiny", "ml", spec_dict(**overrides))
    assert field in str(info.value)


def test_missing_model_is_named():
    with pytest.raises(SpecError, match="spec.model is required"):
        parse_spec("tiny", "ml", {"replicas": 1})


@pytest.mark.parametrize("name", ["Tiny", "9lives", "a" * 48, "has_underscore"])
def test_names_that_cannot_name_children_are_refused(name):
    with pytest.raises(SpecError, match="metadata.name"):
        parse_spec(name, "ml", spec_dict())


def test_kv_cache_memory_accepts_bytes_and_fractions():
    assert make_spec(engine={"kvCacheMemory": "8Gi"}).engine.kv_cache_memory == "8Gi"
    assert make_spec(engine={"kvCacheMemory": "0.9"}).engine.kv_cache_memory == "0.9"


def test_autoscaling_target_defaults_per_metric():
    assert make_spec(autoscaling={"maxReplicas": 3}).autoscaling.target == 8
    assert make_spec(autoscaling={"maxReplicas": 3, "metric": "cpu"}).autoscaling.target == 80


def test_activation_cache_defaults_and_settings():
    from kubeshard_operator.spec import ActivationCache, SecretKeyRef

    assert parse_spec("tiny", "ml", spec_dict()).activations == ActivationCache(True, 2, 3600, 512 * 1024**2)
    a = parse_spec("tiny", "ml", spec_dict(cache={"activations": {"enabled": False, "minHits": 3, "ttlSeconds": 60,
                                                                  "maxBytes": "512Mi"}})).activations
    assert a == ActivationCache(False, 3, 60, 512 * 1024**2)
    ref = parse_spec("tiny", "ml", spec_dict(cache={"activations": {"urlSecretRef": {"name": "redis"}}}))
    assert ref.activations.url_secret == SecretKeyRef("redis", "url")
