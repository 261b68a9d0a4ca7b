"""The garbage collector's pause in a started model server and router, before and after
their startup heap is frozen (kubeshard_shard/server/heap.py, the router's
``freeze_startup_heap``).

Each process kind starts in a fresh interpreter as it does when served (the shard: the
default model loaded, float32; the router: its app created for one backend), then times a
collection of the oldest generation (``gc.collect()``, the pause serving's own
allocations trigger now and then) several times, freezes, and times it again.

    python -m bench.gc_pause_bench [--reps 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import load_average_lines, machine, md_table, rerender, write_results

NAME = "gc-pause"


def start_shard() -> None:
    from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
    from kubeshard_shard.config import EngineConfig, MemoryBudget
    from kubeshard_shard.server.factory import build_served_model

    model_dir = local_checkpoint(default_model_file())
    build_served_model(EngineConfig(model_dir=model_dir, model_id=model_dir.name, max_total_tokens=2048,
                                    kv_cache_memory=MemoryBudget.parse("256MiB")))


def start_router() -> None:
    from kubeshard_router.app import create_app
    from kubeshard_router.config import RouterConfig

    create_app(RouterConfig(backends={"demo": ("127.0.0.1:1",)}))


def pauses(reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - started)
    return out


def child(kind: str, reps: int) -> None:
    {"shard": start_shard, "router": start_router}[kind]()
    gc.collect()
    tracked = len(gc.get_objects())
    before = pauses(reps)
    if kind == "shard":
        from kubeshard_shard.server.heap import freeze_startup_heap
        freeze_startup_heap()
    else:
        from kubeshard_router.cli import freeze_startup_heap
        freeze_startup_heap()
    after = pauses(reps)
    print(json.dumps({"tracked": tracked, "frozen": gc.get_freeze_count(), "tracked_after": len(gc.get_objects()),
                      "before_ms": statistics.median(before) * 1000, "after_ms": statistics.median(after) * 1000}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--child", choices=["shard", "router"], help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.reps)
        return
    if args.render:
        rerender(NAME, render)
        return
    results = {"machine": machine(), "reps": args.reps, "command": f"python -m bench.gc_pause_bench --reps {args.reps}",
               "load_average_1m": {"before": os.getloadavg()[0]}, "processes": {}}
    for kind in ("shard", "router"):
        out = subprocess.run([sys.executable, "-m", "bench.gc_pause_bench", "--child", kind, "--reps", str(args.reps)],
                             check=True, capture_output=True, text=True).stdout
        results["processes"][kind] = json.loads(out.strip().splitlines()[-1])
        print(kind, results["processes"][kind], flush=True)
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(NAME, results, render(results))


def render(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# The garbage collector's pause in a started process, before and after freezing its startup heap", "",
        f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}.",
        "",
        "Each process as served, in a fresh interpreter (the shard server: the default model loaded, float32; "
        "the router: its app created), then the median of the runs of a collection of the oldest generation "
        "(`gc.collect()`: the pause that serving's own allocations trigger now and then, shared by every "
        "stream in flight), before and after `gc.freeze()`.", "",
        *md_table(["process", "objects the collector walks", "pause before", "frozen", "walked after",
                   "pause after"],
                  [(kind, f"{p['tracked']:,}", f"{p['before_ms']:.1f} ms", f"{p['frozen']:,}",
                    f"{p['tracked_after']:,}", f"{p['after_ms'] * 1000:.1f} µs")
                   for kind, p in r["processes"].items()], right=True, left=(0,)),
        "", *load_average_lines(r), "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
