"""The startup heap, out of the garbage collector's way.

A loaded model server holds a few hundred thousand Python objects for as long as it
runs (modules, parameter wrappers, tokenizer and config tables). CPython's collection
of its oldest generation walks every one of them: 70-110 ms with the default model
loaded (bench/results/gc-pause.md: 74 ms), a pause that every stream in flight shares, and the
collections that serving's own allocations trigger keep paying it. Frozen once loaded
(``gc.freeze``: vLLM's engine core does the same after its start), they are never
walked again; a collection walks only what serving allocated since.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collects what loading left behind, then moves every surviving object into the
    permanent generation; returns how many the collector no longer walks."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("startup heap frozen: %d objects out of the garbage collector's walks", frozen)
    return frozen
