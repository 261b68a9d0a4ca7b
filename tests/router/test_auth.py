"""API keys: from a file (YAML or plain) or a Secret's data; 401s; reloads; never logged."""

from __future__ import annotations

import base64
import logging
import os
import time

import httpx
import pytest

from kubeshard_router.auth import ApiKeys, parse_keys_text, parse_secret_data
from kubeshard_router.errors import Unauthorized
from tests.support.waiting import wait_for

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210"
BODY = {"inputs": "hi", "parameters": {"max_new_tokens": 1}}


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - name: alice\n    key: {ALICE}\n    rpm: 1\n  - name: bob\n    key: {BOB}\n")
    return path


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys_are_required_and_checked(make_router, key_file):
    h = make_router(api_keys_file=str(key_file))
    missing = httpx.post(h.url + "/generate", json=BODY)
    assert missing.status_code == 401 and missing.json()["error_type"] == "authentication"
    assert "Authorization: Bearer" in missing.json()["error"] and missing.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.post(h.url + "/v1/completions", json={"prompt": "x"}, headers=auth("sk-nope"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    basic = httpx.post(h.url + "/generate", json=BODY, headers={"Authorization": "Basic abc"})
    assert basic.status_code == 401 and "expected `Bearer <key>`" in basic.json()["error"]
    assert httpx.post(h.url + "/generate", json=BODY, headers=auth(BOB)).status_code == 200
    assert httpx.get(h.url + "/v1/models").status_code == 401
    assert httpx.get(h.url + "/v1/models", headers=auth(ALICE)).status_code == 200
    # Probes and metrics stay open for Kubernetes and Prometheus.
    assert httpx.get(h.url + "/health").status_code == 200
    assert httpx.get(h.url + "/metrics").status_code == 200


def test_per_key_rate_limits_override_the_default(make_router, key_file):
    h = make_router(api_keys_file=str(key_file), rate_limit_rpm=100)
    assert httpx.post(h.url + "/generate", json=BODY, headers=auth(ALICE)).status_code == 200
    limited = httpx.post(h.url + "/generate", json=BODY, headers=auth(ALICE))
    assert limited.status_code == 429 and "1 requests per minute" in limited.json()["error"]
    for _ in range(3):  # bob has the default limit, and his own bucket
        assert httpx.post(h.url + "/generate", json=BODY, headers=auth(BOB)).status_code == 200
    assert 'kubeshard_router_rate_limited_total{key="alice"} 1.0' in httpx.get(h.url + "/metrics").text


def test_key_file_changes_are_picked_up(make_router, key_file):
    h = make_router(api_keys_file=str(key_file))
    h.state._key_watchers[0].interval_s = 0.05
    key_file.write_text("# one key per line\nsk-carol-000\n")
    os.utime(key_file, (time.time() + 5, time.time() + 5))
    assert wait_for(lambda: httpx.post(h.url + "/generate", json=BODY, headers=auth("sk-carol-000")).status_code == 200)
    assert httpx.post(h.url + "/generate", json=BODY, headers=auth(ALICE)).status_code == 401


def test_keys_never_reach_the_logs(make_router, key_file, caplog):
    caplog.set_level(logging.DEBUG)
    h = make_router(api_keys_file=str(key_file))
    httpx.post(h.url + "/generate", json=BODY, headers=auth(ALICE))
    httpx.post(h.url + "/generate", json=BODY, headers=auth("sk-wrong-secret-value"))
    httpx.post(h.url + "/generate", json=BODY, headers=auth(ALICE))  # rate limited (rpm 1)
    text = caplog.text + httpx.get(h.url + "/metrics").text
    assert "loaded 2 API keys" in caplog.text
    for secret in (ALICE, BOB, "sk-wrong-secret-value"):
        assert secret not in text


def test_plain_yaml_and_secret_formats():
    plain = parse_keys_text("# comment\nk1\n\n  k2  \n", "f")
    assert len(plain) == 2 and all(v.name.startswith("key-") for v in plain.values())
    keys = ApiKeys(plain)
    assert keys.authenticate("Bearer k2").name in {v.name for v in plain.values()}
    with pytest.raises(Unauthorized):
        keys.authenticate("Bearer k3")
    with pytest.raises(ValueError, match=r"keys\[0\] needs a non-empty string `key`"):
        parse_keys_text("keys:\n  - name: x\n", "f")
    with pytest.raises(ValueError, match="`rpm` must be a non-negative integer"):
        parse_keys_text("keys:\n  - key: a\n    rpm: -1\n", "f")
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    secret = parse_secret_data({"ci": b64("sk-ci\n"), "extra.yaml": b64("keys:\n  - name: ops\n    key: sk-ops\n    tpm: 5\n")}, "s")
    names = {v.name: v for v in secret.values()}
    assert set(names) == {"ci", "ops"} and names["ops"].tpm == 5
    assert ApiKeys(secret).authenticate("bearer sk-ci").name == "ci"


def test_a_bad_key_file_stops_startup(tmp_path):
    from tests.support.router_harness import RouterHarness
    bad = tmp_path / "keys.yaml"
    bad.write_text("keys: {}\n")
    h = RouterHarness(api_keys_file=str(bad))
    with pytest.raises(Exception):
        h.start()
    h.close()
