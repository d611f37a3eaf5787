"""What confining hardened local commands costs: median ``exec("true")`` round trip on a
hardened local sandbox, as root and as ``agent``, with the seccomp launcher (``sandbox/_confine.py``)
in front of ``nsenter`` and, for comparison, without it (the launcher patched out: measurement only).

    python3 bench/bench_confine.py [--execs 200] [--rounds 3]

Needs bubblewrap and root.  Rounds alternate the two variants, so that load on the machine hits both.
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
from sandbox.local import LocalSandbox


async def round_trips(execs: int, user: str | None) -> list[float]:
    async with sandbox.create(sandbox.SandboxSpec(hardened=True, network="none"), backend="local") as sb:
        await sb.exec("true", user=user)
        times = []
        for _ in range(execs):
            t0 = time.perf_counter()
            r = await sb.exec("true", user=user)
            times.append(time.perf_counter() - t0)
            assert r.ok, r
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    confine = LocalSandbox._confine_prefix
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for variant in ("confined", "without launcher"):
            LocalSandbox._confine_prefix = confine if variant == "confined" else (lambda self: [])  # type: ignore[method-assign]
            for user in (None, "agent"):
                results.setdefault((variant, user or "root"), []).extend(await round_trips(args.execs, user))
    LocalSandbox._confine_prefix = confine  # type: ignore[method-assign]
    print("| user | variant | exec('true') median | p90 |")
    print("| --- | --- | --- | --- |")
    for (variant, user), times in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        times.sort()
        print(f"| {user} | {variant} | {statistics.median(times) * 1000:.2f} ms | "
              f"{times[int(len(times) * 0.9)] * 1000:.2f} ms |")


if __name__ == "__main__":
    asyncio.run(main())
