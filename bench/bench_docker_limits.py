"""Docker sandbox start and exec cost with resource limits (memory, pids, disk).

    python3 bench/bench_docker_limits.py [--starts 10] [--execs 30] [--image ares-gateway/agent-base:latest]

Start-to-first-exec is ``create + start + exec("true")`` (median over ``--starts``); exec round trip is
``exec("true")`` as root and as the agent user on a running sandbox (median over ``--execs``);
``limits_reached()`` is timed on a running sandbox.  Configurations: no resources (the backend's
defaults), memory + pids, and memory + pids + disk (the writable layer on a loop-mounted file system).
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

CONFIGS = {
    "defaults": sandbox.Resources(),
    "memory+pids": sandbox.Resources(memory="2g", pids=1024),
    "memory+pids+disk": sandbox.Resources(memory="2g", pids=1024, disk="10g"),
}


async def measure(image: str, resources: sandbox.Resources, starts: int, execs: int) -> dict[str, float]:
    spec = sandbox.SandboxSpec(image=image, network="none", resources=resources)
    times = []
    for _ in range(starts):
        t0 = time.perf_counter()
        sb = sandbox.create(spec, backend="docker")
        await sb.start()
        r = await sb.exec("true")
        times.append(time.perf_counter() - t0)
        assert r.ok, r
        await sb.stop()
    out = {"start_to_first_exec_ms": statistics.median(times) * 1000}
    async with sandbox.create(spec, backend="docker") as sb:
        for user in ("root", "agent"):
            rt = []
            for _ in range(execs):
                t0 = time.perf_counter()
                await sb.exec("true", user=user)
                rt.append(time.perf_counter() - t0)
            out[f"exec_{user}_ms"] = statistics.median(rt) * 1000
        if hasattr(sb, "limits_reached"):
            lt = []
            for _ in range(max(3, execs // 3)):
                t0 = time.perf_counter()
                await sb.limits_reached()
                lt.append(time.perf_counter() - t0)
            out["limits_reached_ms"] = statistics.median(lt) * 1000
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--execs", type=int, default=30)
    ap.add_argument("--image", default="ares-gateway/agent-base:latest")
    ap.add_argument("--only", choices=sorted(CONFIGS), action="append")
    args = ap.parse_args()
    if not engine_available():
        print("no Docker engine answers: nothing to measure")
        return
    for name in args.only or CONFIGS:
        try:
            result = await measure(args.image, CONFIGS[name], args.starts, args.execs)
        except sandbox.SandboxError as exc:
            print(f"{name:18s} cannot start: {str(exc).splitlines()[0][:160]}")
            continue
        print(f"{name:18s} " + "  ".join(f"{k} {v:7.1f}" for k, v in result.items()))


if __name__ == "__main__":
    asyncio.run(main())
