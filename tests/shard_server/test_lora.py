"""Multi-LoRA: two PEFT adapters (random weights, fixed seeds) served at once, in one batch
with base-model requests, give per request the tokens transformers+peft gives for that
adapter; an adapter's prompt never reuses the base model's cached KV blocks; loading
at run time, unloading, and the errors that name the adapter."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard.engine.request import RequestError, make_sampling_params
from kubeshard_shard.models.lora import AdapterError, load_adapter, slot_runs
from kubeshard_proto import pb
from tests.support.engine import build_engine, random_prompts, run_to_completion
from tests.support.lora import ALL, make_adapter, peft_greedy
from tests.support.shard_process import start_group


@pytest.fixture(scope="module")
def adapters(demo_model, tmp_path_factory):
    model_dir = demo_model("llama")
    root = tmp_path_factory.mktemp("lora")
    a = make_adapter(model_dir, root / "a", seed=1, r=8, targets=ALL, alpha=16)
    b = make_adapter(model_dir, root / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"], alpha=8)
    return model_dir, {"a": a, "b": b}


def greedy(n, adapter=None):
    return make_sampling_params(max_new_tokens=n, ignore_eos=True, adapter=adapter)


def test_two_adapters_in_one_batch_match_transformers_and_peft(adapters):
    model_dir, paths = adapters
    served = build_engine(model_dir, lora_adapters=tuple(paths.items()))
    prompts = random_prompts(5, 1000, (20, 40), seed=8)
    shared = prompts[0]
    # the base model computes (and caches) the shared prompt first
    run_to_completion(served.engine, [(shared, greedy(4))])
    plan = [(shared, "a"), (prompts[1], None), (prompts[2], "b"), (prompts[3], "a"), (prompts[4], "b"),
            (shared, None), (shared, "b")]
    outs = run_to_completion(served.engine, [(p, greedy(12, name)) for p, name in plan])
    got = [[o.token_id for o in out] for out in outs]
    want = [peft_greedy(model_dir, paths[name] if name else None, p, 12) for p, name in plan]
    assert got == want
    assert len({tuple(got[0]), tuple(got[5]), tuple(got[6])}) == 3  # the adapters change the output


def test_runtime_load_unload_and_errors(adapters):
    model_dir, paths = adapters
    served = build_engine(model_dir, enable_lora=True, max_loras=2)
    engine = served.engine
    lora = engine.runner.lora
    with pytest.raises(RequestError, match="adapter 'a' is not loaded"):
        engine.check_adapter("a")
    lora.add(load_adapter("a", paths["a"], engine.runner.model, torch.float32, torch.device("cpu"), 64))
    prompt = random_prompts(1, 1000, (16, 16), seed=3)[0]
    [out] = run_to_completion(engine, [(prompt, greedy(6, "a"))])
    assert [o.token_id for o in out] == peft_greedy(model_dir, paths["a"], prompt, 6)
    with pytest.raises(FileExistsError):
        lora.add(load_adapter("a", paths["a"], engine.runner.model, torch.float32, torch.device("cpu"), 64))
    with pytest.raises(AdapterError, match="rank 8 is outside"):
        load_adapter("big", paths["a"], engine.runner.model, torch.float32, torch.device("cpu"), 4)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter("x", str(model_dir), engine.runner.model, torch.float32, torch.device("cpu"), 64)
    key = engine.add_request("busy", prompt, greedy(50, "a"))
    engine.step()
    with pytest.raises(RuntimeError, match="serving 1 sequences"):
        lora.remove("a")
    engine.abort(key)
    lora.remove("a")
    assert lora.names() == [] and engine.stats().max_loras == 2


def test_no_lora_server_refuses_adapters(demo_model):
    served = build_engine(demo_model("llama"))
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        served.engine.check_adapter("a")


def peft_delta(adapter: str, layer: int, modules: list[str], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x's LoRA delta for one of our (possibly fused) layers, from the PEFT file itself."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    parts = []
    for module, size in zip(modules, sizes):
        key = next((k for k in tensors if f"layers.{layer}." in k and f".{module}.lora_A" in k), None)
        if key is None:
            parts.append(torch.zeros(x.shape[0], size))
            continue
        a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")]
        parts.append(x @ a.t() @ b.t() * scale)
    return torch.cat(parts, 1)


@pytest.mark.parametrize("through", ["kernel", "torch"])
def test_stacked_buffers_give_each_row_its_adapter_on_a_quantized_base(adapters, through):
    """Rows of several adapters in any order, a loaded adapter between them that no row
    uses, an unloaded slot, one adapter's one run and its two runs, and base rows, on int8
    base layers: each row gets exactly its adapter's delta, through the CPU kernel
    (lora.cpp) and through the torch path other devices and dtypes take (the masked
    window, the single-adapter slice)."""
    model_dir, paths = adapters
    served = build_engine(model_dir, quantize="int8", enable_lora=True, max_loras=4)
    lora, model = served.engine.runner.lora, served.engine.runner.model
    if through == "torch":
        lora.native = None  # the packs get no kernel form
    else:
        assert lora.native is not None, "the CPU kernels did not build here"
    for name, path in (("a", paths["a"]), ("gone", paths["b"]), ("b", paths["b"]), ("c", paths["a"])):
        lora.add(load_adapter(name, path, model, torch.float32, torch.device("cpu"), 64))
    lora.remove("gone")  # slot 2 empty: a=1, b=3, c=4 (the same weights as a)
    assert (lora.slot_of, sorted(lora.packs["layers.1.self_attn.qkv_proj"].present)) == ({"a": 1, "b": 3, "c": 4},
                                                                                          [1, 3, 4])
    assert all((pack.native is None) == (through == "torch") for pack in lora.packs.values())
    layers = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
              "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}
    source = {1: paths["a"], 3: paths["b"], 4: paths["a"]}
    g = torch.Generator().manual_seed(5)
    patterns = [[0, 1, 3, 1, 0, 3, 3, 1],  # three adapters' rows interleaved: the mask
                [0, 0, 3, 3, 3, 0],         # one adapter, one run: the slice path
                [1, 1, 0, 1],               # one adapter, two runs: the mask over one slot
                [4, 1, 4]]                  # a and c: two slots holding the same weights
    for attr, modules in layers.items():
        layer = model.model.layers[1].get_submodule(attr)
        assert layer.base.weight.dtype == torch.int8 and type(layer.base.gemm).__name__ == "QuantGemm"
        moved_rows = 0
        for slots in patterns:
            x = torch.randn(len(slots), layer.in_features, generator=g)
            with torch.inference_mode():
                lora.begin_step(None)
                base = layer(x).clone()
                lora.begin_step(slots)
                got = layer(x.clone())
            want = base.clone()
            for row, slot in enumerate(slots):
                if slot:
                    want[row] += peft_delta(source[slot], 1, modules, x[row:row + 1], layer.sizes)[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{attr} rows {slots}")
            moved_rows += int(((got - base).abs().amax(1) > 1e-3).sum())
        assert moved_rows >= 6, attr  # the deltas are there (b adapts q, v and down only)
    lora.begin_step(None)


def check_lora_add(built) -> None:
    """lora_add_ (lora.cpp) against x Aᵀ Bᵀ in float64: runs of several slots and of a
    slot the pack lacks, base rows between them, widths that are not multiples of the
    vector width."""
    g = torch.Generator().manual_seed(3)
    for K, sizes, R in [(37, [70], 5), (64, [48, 16, 16], 8), (130, [141, 141], 16)]:
        S, n_sub = 4, len(sizes)
        a = torch.randn(S, n_sub * R, K, generator=g)
        bt = [torch.randn(S, R, size, generator=g) for size in sizes]
        offsets = [sum(sizes[:i]) for i in range(n_sub)]
        pack = built.LoraPack(a, bt, offsets, [1, 2, 4])  # slot 3 holds no adapter for this layer
        slots = [0, 2, 2, 1, 0, 3, 4, 4, 4, 2, 0]
        x = torch.randn(len(slots), K, generator=g)
        y0 = torch.randn(len(slots), sum(sizes), generator=g)
        y = y0.clone()
        built.lora_add_(y, x, torch.tensor(slot_runs(slots)), pack)
        want = y0.double()
        for t, s in enumerate(slots):
            if s in (1, 2, 4):
                xa = x[t].double() @ a[s - 1].double().t()
                for i in range(n_sub):
                    want[t, offsets[i]:offsets[i] + sizes[i]] += xa[i * R:(i + 1) * R] @ bt[i][s - 1].double()
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4, msg=f"K {K}, sizes {sizes}, rank {R}")
        assert torch.equal(y[[0, 4, 5, 10]], y0[[0, 4, 5, 10]]), "base rows and slot 3's row are left as they were"


def test_the_kernel_gives_each_row_its_adapters_delta(cpu_kernels):
    check_lora_add(cpu_kernels)


def test_the_kernel_of_the_portable_builds_gives_each_row_its_adapters_delta(portable_kernels):
    """The AVX2 and scalar code."""
    check_lora_add(portable_kernels)


def test_the_kernel_names_what_is_wrong_with_its_arguments(cpu_kernels):
    """lora_add_ and LoraPack check what they are given (they run on raw pointers)."""
    built = cpu_kernels
    a, bt = torch.randn(2, 2 * 4, 16), [torch.randn(2, 4, 8), torch.randn(2, 4, 6)]
    pack = built.LoraPack(a, bt, [0, 8], [1, 2])
    x, y = torch.randn(3, 16), torch.zeros(3, 14)
    built.lora_add_(y, x, torch.tensor([[2, 1, 3]]), pack)
    want = torch.zeros(3, 14)
    xa = x[1:] @ a[1].t()
    want[1:, :8], want[1:, 8:] = xa[:, :4] @ bt[0][1], xa[:, 4:] @ bt[1][1]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    for runs, match in [(torch.tensor([[1, 2, 4]]), "within the 3 rows"), (torch.tensor([[1, 1, 2], [2, 0, 1]]),
                                                                             "in order"),
                        (torch.tensor([[1, 0]]), r"\[n, 3\]"), (torch.tensor([[0, 0, 1]]), "slot 0")]:
        with pytest.raises(RuntimeError, match=match):
            built.lora_add_(y, x, runs, pack)
    with pytest.raises(RuntimeError, match="A has 16 inputs, the layer 12"):
        built.lora_add_(y, torch.randn(3, 12), torch.tensor([[1, 0, 1]]), pack)
    with pytest.raises(RuntimeError, match=r"sub-projection 1 \(columns 8..14\) is outside the layer's 12"):
        built.lora_add_(torch.zeros(3, 12), x, torch.tensor([[1, 0, 1]]), pack)
    with pytest.raises(RuntimeError, match="slot 3 is outside 1..2"):
        built.LoraPack(a, bt, [0, 8], [3])
    with pytest.raises(RuntimeError, match="each Bᵀ must be contiguous float32"):
        built.LoraPack(a, [bt[0], torch.randn(2, 5, 6)], [0, 8], [1])


def _generate(stub, prompt, n, adapter=""):
    request = pb.GenerateRequest(request_id="l", input_ids=prompt, adapter=adapter, sampling=pb.SamplingParameters(),
                                 stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))
    return [t.id for t in stub.Generate(request, timeout=180)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
def test_sharded_groups_serve_adapters_as_transformers_and_peft_do(adapters, strategy):
    """A tensor group cuts each adapter as it cuts the projection (B's rows of a column-
    parallel layer, A's columns of a row-parallel one, whose deltas join the partial
    products before the all-reduce); a zero3 group's ranks each apply whole adapters to
    their own lane's rows. Requests for two adapters and the base model, at once, get
    transformers+peft's tokens."""
    import threading

    model_dir, paths = adapters
    group = start_group(model_dir, strategy, 2, "--lora-adapter", f"a={paths['a']}", "--lora-adapter",
                        f"b={paths['b']}")
    try:
        stub = group.leader.stub()
        assert sorted(a.name for a in stub.Info(pb.InfoRequest(), timeout=10).adapters) == ["a", "b"]
        prompts = random_prompts(6, 1000, (10, 30), seed=4)
        plan = list(zip(prompts, ["a", "", "b", "a", "b", ""]))
        results: dict[int, list[int]] = {}

        def run(i):
            results[i] = _generate(stub, plan[i][0], 10, plan[i][1])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(plan))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        want = [peft_greedy(model_dir, paths[name] if name else None, p, 10) for p, name in plan]
        assert [results.get(i) for i in range(len(plan))] == want
        assert want[0] != peft_greedy(model_dir, None, plan[0][0], 10)  # the adapter changes the tokens
    finally:
        group.stop()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
def test_a_sharded_group_loads_and_unloads_adapters_at_run_time_on_every_rank(adapters, tmp_path, strategy):
    """LoadAdapter on a group's leader loads the adapter on every rank between two steps;
    its requests then get transformers+peft's tokens; UnloadAdapter drops it everywhere.
    A load another rank refuses (here: its --lora-root holds only root/shared) fails
    naming the rank, and no rank keeps the adapter."""
    import grpc
    import shutil

    model_dir, paths = adapters
    root = tmp_path / "root"
    shutil.copytree(paths["b"], root / "shared" / "b")
    shutil.copytree(paths["a"], root / "leader-only")
    group = start_group(model_dir, strategy, 2, "--lora-root", str(root),
                        follower_flags={1: ["--lora-root", str(root / "shared")]})
    try:
        stub = group.leader.stub()
        loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name="b", source=str(root / "shared" / "b")), timeout=120)
        assert loaded.name == "b"
        prompts = random_prompts(2, 1000, (10, 30), seed=6)
        assert _generate(stub, prompts[0], 8, "b") == peft_greedy(model_dir, paths["b"], prompts[0], 8)
        assert _generate(stub, prompts[1], 8) == peft_greedy(model_dir, None, prompts[1], 8)
        with pytest.raises(grpc.RpcError) as refused:
            stub.LoadAdapter(pb.LoadAdapterRequest(name="a", source=str(root / "leader-only")), timeout=120)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rank 1 of the group could not load" in refused.value.details(), refused.value.details()
        assert [a.name for a in stub.Info(pb.InfoRequest(), timeout=10).adapters] == ["b"]
        assert "outside this server's --lora-root" in group.followers[0].output
        stub.UnloadAdapter(pb.UnloadAdapterRequest(name="b"), timeout=60)
        assert list(stub.Info(pb.InfoRequest(), timeout=10).adapters) == []
        # the slots agree again: the same adapter loads anew and serves as before
        stub.LoadAdapter(pb.LoadAdapterRequest(name="b2", source=str(root / "shared" / "b")), timeout=120)
        assert _generate(stub, prompts[0], 8, "b2") == peft_greedy(model_dir, paths["b"], prompts[0], 8)
    finally:
        group.stop()


def test_a_runtime_load_crosses_the_step_channel_whole():
    """What a group's leader sends its ranks: names and folders in any script, as int64s."""
    from kubeshard_shard.models.lora import LoraCommand

    for command in (LoraCommand("load", "sql-v2", "/lora-root/añejo/日本"), LoraCommand("unload", "x"),
                    LoraCommand("load", "a", "")):
        assert LoraCommand.decode(command.encode()) == command


def test_runtime_loads_need_a_root_and_stay_under_it(tmp_path):
    """The shard's own check of a runtime load's folder (LoadAdapter): refused without
    --lora-root, and a path that leaves the root, by '..' or by a symbolic link, is
    refused naming the root."""
    from kubeshard_shard.models.lora import AdapterRegistry, RuntimeLoadsOff

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(RuntimeLoadsOff, match="--lora-root DIR"):
        AdapterRegistry(2, 8).runtime_source(str(root / "a"))
    registry = AdapterRegistry(2, 8, runtime_root=root)
    assert registry.runtime_source(str(root / "a")) == str((root / "a").resolve())
    for path in (root / ".." / "outside", root / "link", outside):
        with pytest.raises(AdapterError, match="is outside this server's --lora-root"):
            registry.runtime_source(str(path))
