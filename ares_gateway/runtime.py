"""Process-level tuning for a process whose main job is serving the gateway."""

from __future__ import annotations

import gc


def tune_gc() -> None:
    """Make the garbage collector cheap for a request-heavy server.

    Every turn allocates many short-lived objects (parsed JSON, canonical models,
    futures); with CPython's default thresholds that triggers a young-generation
    collection every 700 allocations and, as recorded turns accumulate, full
    collections that walk every recorded turn: tail latencies of hundreds of
    milliseconds. Freezing what start-up allocated and raising the thresholds
    keeps collections rare and short. Call once, after imports, in a process you
    own (``ares-gateway serve`` does); a trainer embedding the gateway decides for
    its own process.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
