"""Sandbox latency: start-to-first-exec and exec round trip, for the local and Docker backends.

    python3 bench/bench_sandbox.py [--starts 10] [--execs 50]

Each figure is the median over repeated runs.  Start-to-first-exec is `create + start + exec("true")`
(the Docker image is already built: cache hit); exec round trip is `exec("true")` on a running sandbox.
Docker is skipped when no engine answers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sandbox
from sandbox.docker import engine_available

DOCKERFILE = Path(__file__).resolve().parents[1] / "tests" / "sandbox" / "images" / "Dockerfile"


async def measure(backend: str, starts: int, execs: int) -> tuple[float, float]:
    spec = sandbox.SandboxSpec(dockerfile=DOCKERFILE) if backend == "docker" else sandbox.SandboxSpec()
    async with sandbox.create(spec, backend=backend) as warm:  # build / cache the image first
        await warm.exec("true")
    start_times = []
    for _ in range(starts):
        t0 = time.perf_counter()
        sb = sandbox.create(spec, backend=backend)
        await sb.start()
        result = await sb.exec("true")
        start_times.append(time.perf_counter() - t0)
        assert result.ok, result
        await sb.stop()
    async with sandbox.create(spec, backend=backend) as sb:
        round_trips = []
        for _ in range(execs):
            t0 = time.perf_counter()
            await sb.exec("true")
            round_trips.append(time.perf_counter() - t0)
    return statistics.median(start_times), statistics.median(round_trips)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--execs", type=int, default=50)
    args = parser.parse_args()
    backends = ["local"] + (["docker"] if engine_available() else [])
    print("| backend | start-to-first-exec (median) | exec round trip (median) |")
    print("| --- | --- | --- |")
    for backend in backends:
        start, rtt = await measure(backend, args.starts, args.execs)
        label = backend
        if backend == "local":
            label += " (bubblewrap)" if sandbox.local.bwrap_available() else " (no isolation)"
        print(f"| {label} | {start * 1000:.0f} ms | {rtt * 1000:.1f} ms |", flush=True)
    if "docker" not in backends:
        print("(docker: no engine answers, skipped)")


if __name__ == "__main__":
    asyncio.run(main())
