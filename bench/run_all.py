"""`make bench`: every benchmark, one after another (each writes bench/results/<name>.md/.json).

Run on a quiet machine: the numbers compare kubeshard with its baselines inside one run.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import time
from pathlib import Path

# Order matters little, but the engine comes first: it is the base of the others.
PREFERRED = ["engine_bench", "sharding_bench"]
SKIP = {"common", "run_all", "cuda_check"}


def discover() -> list[str]:
    here = Path(__file__).parent
    found = [m.name for m in pkgutil.iter_modules([str(here)]) if m.name.endswith("_bench") and m.name not in SKIP]
    return [m for m in PREFERRED if m in found] + sorted(m for m in found if m not in PREFERRED)


def main() -> int:
    failed = []
    for name in discover():
        print(f"== bench.{name}", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", f"bench.{name}"])
        print(f"== bench.{name}: exit {code} after {time.monotonic() - started:.0f}s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
