"""The CRD read as data: structure, documentation, and agreement with the operator."""

import re
from pathlib import Path

import pytest
import yaml

from kubeshard_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "kubeshard.io_inferenceservices.yaml"


def load_crd():
    return yaml.safe_load(CRD_FILE.read_text())


def version():
    return load_crd()["spec"]["versions"][0]


def walk(schema, path="."):
    """Yields (path, node) for every schema node below the root."""
    for name, child in (schema.get("properties") or {}).items():
        yield f"{path}{name}", child
        yield from walk(child, f"{path}{name}.")
    if "items" in schema:
        yield f"{path}[]", schema["items"]
        yield from walk(schema["items"], f"{path}[].")


def test_repo_and_chart_crds_are_identical():
    repo = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (ROOT / "charts/kubeshard/crds").glob("*.yaml"))
    assert repo == chart and repo
    for name in repo:
        assert (ROOT / "crds" / name).read_bytes() == \
            (ROOT / "charts/kubeshard/crds" / name).read_bytes(), name


def test_every_field_is_described():
    schema = version()["schema"]["openAPIV3Schema"]
    # Array item nodes are described by their array; every property needs its own.
    undocumented = [path for path, node in walk(schema)
                    if path != ".metadata" and not path.endswith("[]")
                    and not node.get("description")]
    assert undocumented == []


def test_group_names_and_short_name():
    crd = load_crd()["spec"]
    assert crd["group"] == "kubeshard.io" and crd["names"]["kind"] == "InferenceService"
    assert version()["name"] == "v1alpha1"
    # KServe owns isvc, Knative ksvc.
    assert not {"isvc", "ksvc"} & set(crd["names"]["shortNames"])


def test_scale_and_status_subresources():
    sub = version()["subresources"]
    assert sub["status"] == {}
    assert sub["scale"] == {"specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector"}


def test_printer_columns():
    columns = {c["name"]: c["jsonPath"] for c in version()["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".spec.model.source", "Shards": ".spec.sharding.shards",
        "Replicas": ".spec.replicas", "Ready": ".status.readyReplicas",
        "Phase": ".status.phase", "URL": ".status.url", "Age": ".metadata.creationTimestamp",
    }


def apply_defaults(schema, value):
    """What the API server does with `default:` on write (enough for this CRD)."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for name, child in (schema.get("properties") or {}).items():
        if name not in out and "default" in child:
            out[name] = child["default"]
        if name in out:
            out[name] = apply_defaults(child, out[name])
    return out


@pytest.mark.parametrize("spec", [
    {"model": {"source": "/m"}},
    {"model": {"source": "hf://o/n"}, "autoscaling": {"maxReplicas": 3},
     "resources": {"gpu": 1}},
    {"model": {"source": "/m", "quantize": "int4"}, "engine": {"speculative": {"method": "ngram"}}},
    {"model": {"source": "/m"}, "engine": {"speculative": {"method": "draft", "draftQuantize": "int8"}}},
])
def test_crd_defaults_agree_with_the_operator_defaults(spec):
    """The operator must read a spec the same with or without the API server's defaults
    (builders run on plain dicts too)."""
    schema = version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaulted = apply_defaults(schema, spec)
    assert parse_spec("m", "ns", defaulted) == parse_spec("m", "ns", spec)


def test_cel_rules_carry_messages():
    schema = version()["schema"]["openAPIV3Schema"]
    nodes = [("", schema)] + list(walk(schema))
    rules = [(path, r) for path, node in nodes for r in node.get("x-kubernetes-validations", ())]
    assert len(rules) >= 15
    for path, rule in rules:
        assert rule.get("message") or rule.get("messageExpression"), path


def cel_rules():
    """(schema path, rule) for every CEL rule of the CRD."""
    schema = version()["schema"]["openAPIV3Schema"]
    return [(path, r) for path, node in [("", schema)] + list(walk(schema))
            for r in node.get("x-kubernetes-validations", ())]


def test_cel_messages_name_a_field():
    """A refusal at admission says which field to change."""
    for path, rule in cel_rules():
        assert re.search(r"\b(spec|metadata)\.[a-zA-Z]", rule["message"]), (path, rule["message"])


def test_speed_option_enums_match_the_operator():
    from kubeshard_operator import spec as s

    props = version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    model, engine = props["model"]["properties"], props["engine"]["properties"]
    speculative = engine["speculative"]["properties"]
    assert tuple(model["quantize"]["enum"]) == s.QUANTIZE_METHODS and model["quantize"]["default"] == "none"
    assert tuple(engine["kvCacheDtype"]["enum"]) == s.KV_CACHE_DTYPES  # fp8: no pool serves it
    assert "fp8" not in s.KV_CACHE_DTYPES
    assert tuple(speculative["method"]["enum"]) == s.SPECULATIVE_METHODS
    assert tuple(speculative["draftQuantize"]["enum"]) == s.DRAFT_QUANTIZE
    assert (speculative["numTokens"]["default"], speculative["ngramMin"]["default"],
            speculative["ngramMax"]["default"]) == (4, 2, 4)


@pytest.mark.parametrize("overrides, field", [
    ({"model": {"source": "/m", "quantize": "gguf"}}, "spec.model.quantize gguf"),
    ({"model": {"source": "/m", "quantize": "int8", "dtype": "float16"}}, "spec.model.quantize int8, int4 and gguf"),
    ({"model": {"source": "/m", "quantize": "int8"}, "resources": {"gpu": 1}},
     "spec.model.quantize int8, int4 and gguf run CPU kernels"),
    ({"model": {"source": "/m", "quantize": "int8"}, "sharding": {"strategy": "zero3", "shards": 2}},
     "spec.model.quantize is not available with spec.sharding.strategy zero3"),
    ({"runtime": {"name": "vllm"}, "model": {"source": "/m", "quantize": "int8"}},
     "spec.model.quantize is an option of kubeshard's own engine"),
    ({"runtime": {"name": "vllm"}, "engine": {"speculative": {"method": "ngram"}}},
     "spec.engine.speculative is an option of kubeshard's own engine"),
    ({"runtime": {"name": "vllm"}, "engine": {"kvCacheDtype": "int8"}},
     "spec.engine.kvCacheDtype is an option of kubeshard's own engine"),
    ({"engine": {"speculative": {"method": "ngram", "ngramMin": 5}}}, "spec.engine.speculative.ngramMin must be at most"),
    ({"engine": {"speculative": {"draftModel": "/d"}}}, "spec.engine.speculative.draftModel is only used with"),
    ({"engine": {"speculative": {"method": "draft"}}}, "spec.engine.speculative.method draft without draftModel"),
    ({"engine": {"speculative": {"method": "draft", "draftModel": "/d", "draftQuantize": "int8"}},
      "resources": {"gpu": 1}}, "spec.engine.speculative.draftQuantize int8 and int4 run CPU kernels"),
])
def test_the_operators_speed_refusals_have_a_cel_twin(overrides, field):
    """Each refusal the operator makes about the speed options is also a CEL rule, so the
    API server refuses the spec at admission (e2e/operator/test_speed_options.py shows it on
    a real API server); both messages name the same field first."""
    from kubeshard_operator.spec import SpecError
    from tests.operator.factories import spec_dict

    with pytest.raises(SpecError) as info:
        parse_spec("tiny", "ml", spec_dict(**overrides))
    named = field.split()[0]
    assert str(info.value).startswith(named)
    messages = [" ".join(rule["message"].split()) for _, rule in cel_rules()]
    assert any(m.startswith(field) for m in messages), field
