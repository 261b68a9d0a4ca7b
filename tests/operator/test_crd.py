"""The CRD read as data: structure, documentation, and agreement with the operator."""

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
