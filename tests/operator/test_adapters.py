"""spec.model.adapters and adapterRoot: parsed and refused with messages that name the
field; each adapter is mounted read-only in the shard pod and served with --lora-adapter
NAME=FOLDER, the adapter root mounted read-only at /lora-root and given as --lora-root."""

from __future__ import annotations

import pytest

from kubeshard_operator import builders as b
from kubeshard_operator.spec import SpecError
from tests.operator.factories import CFG, make_spec

ADAPTERS = [{"name": "sql", "source": "pvc://loras/adapters/sql"}, {"name": "chat-v2", "source": "/srv/loras/chat"}]


def one_shard(**model):
    return make_spec(model={"source": "/m", **model}, sharding={"strategy": "tensor", "shards": 1})


def test_adapters_are_mounted_and_served():
    spec = one_shard(adapters=ADAPTERS)
    assert [a.name for a in spec.model.adapters] == ["sql", "chat-v2"]
    pod = b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--lora-adapter") + 1] == "sql=/adapters/sql"
    assert "chat-v2=/adapters/chat-v2" in args and "--enable-lora" in args
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert volumes["adapter-0"]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    assert mounts["adapter-0"] == {"name": "adapter-0", "mountPath": "/adapters/sql", "readOnly": True,
                                   "subPath": "adapters/sql"}
    assert volumes["adapter-1"]["hostPath"] == {"path": "/srv/loras/chat", "type": "Directory"}
    # no adapters: no LoRA flags, the same pod as before
    plain = b.build_statefulset(one_shard(), CFG, 0)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--lora-adapter" not in plain and "--enable-lora" not in plain


def test_an_adapter_root_is_mounted_for_runtime_loads():
    spec = one_shard(adapterRoot="pvc://loras/runtime", adapters=ADAPTERS[:1])
    assert spec.model.adapter_root.location == "loras"
    pod = b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--lora-root") + 1] == "/lora-root"  # the chart router's --lora-root
    assert "sql=/adapters/sql" in args  # static adapters as before
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert volumes["lora-root"]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    assert mounts["lora-root"] == {"name": "lora-root", "mountPath": "/lora-root", "readOnly": True,
                                   "subPath": "runtime"}
    host = b.build_statefulset(one_shard(adapterRoot="/srv/loras"), CFG, 0)["spec"]["template"]["spec"]
    assert {v["name"]: v for v in host["volumes"]}["lora-root"]["hostPath"] == {"path": "/srv/loras",
                                                                                 "type": "Directory"}
    assert "--lora-root" in host["containers"][0]["args"]
    plain = b.build_statefulset(one_shard(), CFG, 0)["spec"]["template"]["spec"]
    assert "--lora-root" not in plain["containers"][0]["args"]
    assert "lora-root" not in {v["name"] for v in plain["volumes"]}


@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
def test_a_sharded_group_gets_its_adapters_on_every_rank(strategy):
    """Every rank of a group reads each adapter (its share of it) and takes runtime loads:
    the StatefulSet's one pod template, shared by the ranks, mounts and names them."""
    spec = make_spec(model={"source": "/m", "adapters": ADAPTERS, "adapterRoot": "/srv/loras"},
                     sharding={"strategy": strategy, "shards": 2})
    pod = b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--shards") + 1] == "2"
    assert "sql=/adapters/sql" in args and "chat-v2=/adapters/chat-v2" in args
    assert args[args.index("--lora-root") + 1] == "/lora-root"
    assert {"adapter-0", "adapter-1", "lora-root"} <= {m["name"] for m in pod["containers"][0]["volumeMounts"]}


@pytest.mark.parametrize("model, sharding, message", [
    ({"adapterRoot": "hf://org/loras"}, None, "spec.model.adapterRoot: hf://"),
    ({"adapterRoot": "relative/loras"}, None, "spec.model.adapterRoot"),
    ({"adapterRoot": "/srv/model.gguf"}, None, "spec.model.adapterRoot must be a folder"),
    ({"adapterRoot": ["/a"]}, None, "spec.model.adapterRoot must be a string"),
    ({"adapters": [{"name": "x", "source": "hf://org/lora"}]}, None, "spec.model.adapters[0].source: hf://"),
    ({"adapters": [{"name": "x", "source": "relative/path"}]}, None, "spec.model.adapters[0].source"),
    ({"adapters": [{"name": "bad name", "source": "/a"}]}, None, "spec.model.adapters[0].name 'bad name'"),
    ({"adapters": [{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]}, None, "'a' is taken"),
    ({"adapters": {"name": "a"}}, None, "spec.model.adapters must be a list"),
])
def test_bad_adapters_are_refused(model, sharding, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_spec(model={"source": "/m", **model}, sharding=sharding or {"strategy": "tensor", "shards": 1})
