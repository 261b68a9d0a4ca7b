"""The CUDA checks of the sharding issue, in one go, for a machine with NVIDIA GPUs.

1. Identity on CUDA: greedy output of the unsharded engine equals transformers'
   `generate` (float32) on the llama and qwen2 tiny demo models, 16 mixed-length requests.
2. With 2+ GPUs: the same for tensor and zero3 groups of N = 2 (and 4) ranks over NCCL.
   (NCCL cannot put two ranks on one GPU; with one GPU this part is reported as not run.)
3. The sharding benchmark in bfloat16 on CUDA for every N the GPUs allow.
Results: bench/results/cuda.md (+ sharding-cuda.md from the benchmark).

    python -m bench.cuda_check
"""

from __future__ import annotations

import subprocess
import sys

import torch

from bench.common import RESULTS, demo_model, machine


def identity_unsharded(arch: str) -> tuple[int, int]:
    from tests.support.engine import build_engine, greedy, hf_model, random_prompts, run_to_completion

    model_dir = demo_model(arch, "tiny")
    served = build_engine(model_dir, kv="256MiB", device="cuda", dtype="float32")
    prompts = random_prompts(16, 1000, (1, 200), seed=3)
    outs = run_to_completion(served.engine, [(p, greedy(20)) for p in prompts])
    hf = hf_model(str(model_dir)).cuda()
    same = 0
    for p, o in zip(prompts, outs):
        x = torch.tensor([p], device="cuda")
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0, len(p):].tolist()
        same += ref == [t.token_id for t in o]
    return same, len(prompts)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device here; run this on a GPU machine", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    lines = ["# CUDA checks", "", f"{machine()['date']}: {gpus} × {torch.cuda.get_device_name(0)}, "
             f"torch {torch.__version__}", "", "## Identity (float32, greedy, 16 mixed-length requests)", ""]
    ok = True
    for arch in ("llama", "qwen2"):
        same, total = identity_unsharded(arch)
        ok &= same == total
        lines.append(f"- unsharded engine vs transformers, {arch}: {same}/{total} identical")
    if gpus >= 2:
        shards = [n for n in (2, 4) if n <= gpus]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/shard_server/test_sharding.py", "-k",
                            "identity and (" + " or ".join(f"{n}-" for n in shards) + ")"],
                           env={**__import__("os").environ, "KUBESHARD_TEST_DEVICE": "cuda"},
                           capture_output=True, text=True)
        ok &= r.returncode == 0
        lines.append(f"- sharded groups over NCCL, N ∈ {shards}: {'passed' if r.returncode == 0 else 'FAILED'}")
        lines.append("```\n" + r.stdout[-1500:] + "\n```")
    else:
        lines.append("- sharded groups over NCCL: not run (one GPU; NCCL needs one GPU per rank)")
    shard_list = ",".join(str(n) for n in (1, 2, 4) if n <= gpus)
    b = subprocess.run([sys.executable, "-m", "bench.sharding_bench", "--device", "cuda", "--dtype", "bfloat16",
                        "--shards", shard_list], capture_output=True, text=True)
    lines += ["", "## Benchmark (bfloat16)", "", b.stdout[-3000:] if b.returncode == 0 else f"FAILED:\n{b.stderr[-2000:]}"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cuda.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok and b.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
