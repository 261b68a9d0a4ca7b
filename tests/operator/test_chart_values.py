"""The chart's values: documented, and in step with values.schema.json."""

import json
import re
from pathlib import Path

import jsonschema_rs
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kubeshard"


def test_every_value_has_a_comment():
    """Each key line is preceded by a comment line (a `# --` doc or a section comment)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w-]*):", line)
        if not m or line.strip().startswith("#"):
            continue
        has_comment = i > 0 and lines[i - 1].strip().startswith("#")
        is_section = re.match(r"^\s*[\w-]+:\s*$", line)
        # A section header (a mapping of documented values) needs no comment of its own,
        # nor do the keys of a literal default map (resources, securityContext).
        if not has_comment and not is_section and not _inside_literal(lines, i):
            missing.append(line.strip())
    assert missing == []


LITERAL_PARENTS = ("resources:", "requests:", "limits:", "containerSecurityContext:",
                   "podSecurityContext:", "capabilities:", "seccompProfile:")


def _inside_literal(lines, i):
    indent = len(lines[i]) - len(lines[i].lstrip())
    for j in range(i - 1, -1, -1):
        line = lines[j]
        if not line.strip() or line.strip().startswith("#"):
            continue
        k = len(line) - len(line.lstrip())
        if k < indent:
            return line.strip() in LITERAL_PARENTS or _inside_literal(lines, j)
    return False


@pytest.fixture(scope="module")
def validator():
    return jsonschema_rs.validator_for(json.loads((CHART / "values.schema.json").read_text()))


def test_default_values_satisfy_the_schema(validator):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert validator.is_valid(values), list(validator.iter_errors(values))


def test_schema_knows_every_value(validator):
    """additionalProperties: false everywhere: a value missing from the schema fails."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["operator"]["typo"] = 1
    assert not validator.is_valid(values)


@pytest.mark.parametrize("path, bad", [
    (("operator", "replicaCount"), -1),
    (("router", "service", "type"), "Ingress"),
    (("redis", "external", "url"), "http://redis"),
    (("redis", "maxMemory"), "lots"),
])
def test_schema_refuses_bad_values(validator, path, bad):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    assert not validator.is_valid(values)
