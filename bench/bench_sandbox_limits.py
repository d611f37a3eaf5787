"""What the local backend's cgroups and disk quota cost: hardened sandboxes with and without limits.

    python3 bench/bench_sandbox_limits.py [--runs 15] [--execs 50]

(as root, with bubblewrap).  For each spec: start-to-first-exec (``create + start + exec("true")``),
exec round trip (``exec("true")``), ``kill_processes()`` with nothing to kill, and ``stop()``; each
the median over the runs.  Run it on an older checkout to compare (the limits are then ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sandbox
from sandbox import Resources, SandboxSpec

SPECS = {
    "no limits": Resources(),
    "memory+pids": Resources(memory="1g", pids=512),
    "memory+pids+disk": Resources(memory="1g", pids=512, disk="2g"),
}


async def measure(resources: Resources, runs: int, execs: int) -> dict[str, float]:
    spec = SandboxSpec(hardened=True, network="none", resources=resources)
    times: dict[str, list[float]] = {"start": [], "exec": [], "kill": [], "stop": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        sb = sandbox.create(spec, backend="local")
        await sb.start()
        assert (await sb.exec("true")).ok
        times["start"].append(time.perf_counter() - t0)
        for _ in range(execs // runs or 1):
            t1 = time.perf_counter()
            await sb.exec("true")
            times["exec"].append(time.perf_counter() - t1)
        t2 = time.perf_counter()
        await sb.kill_processes()
        times["kill"].append(time.perf_counter() - t2)
        t3 = time.perf_counter()
        await sb.stop()
        times["stop"].append(time.perf_counter() - t3)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--execs", type=int, default=50)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (hardened local sandboxes)")
    with tempfile.TemporaryDirectory() as root:
        os.environ["ARES_SANDBOX_LOCAL_ROOT"] = root
        print(f"{'spec':<18} {'start+exec':>11} {'exec':>8} {'kill (none)':>12} {'stop':>8}   (ms, medians)")
        for name, resources in SPECS.items():
            m = await measure(resources, args.runs, args.execs)
            print(f"{name:<18} {m['start']:>11.1f} {m['exec']:>8.1f} {m['kill']:>12.1f} {m['stop']:>8.1f}")


if __name__ == "__main__":
    asyncio.run(main())
