"""Episodes per minute with the warm pool (``run --warm N``) against cold starts.

    python3 bench/bench_warm.py [--backends local,docker] [--harnesses tiny-agent,mini-swe-agent]
                                [--concurrency 2] [--episodes 16] [--start-delay 0,2] [--repeat 3]
                                [--json out.json]

Each configuration runs :func:`ares_gateway.episodes.rollouts.run_rollouts` (what ``run`` calls) over
the bundled example tasks, the oracle policy answering (the task's ``solution/solve.sh`` through the
agent's shell: every reward 1.0), ``--concurrency`` episodes at once, first cold (``warm=0``: each
episode starts its sandbox, prepares its workdir and installs its agent when its turn comes), then with
a pool as deep as the concurrency (``warm=N``), alternating, ``--repeat`` times; the medians are
reported with their ratio. Every episode is whole: a fresh sandbox, the agent CLI launched, its turns,
the task's tests in a fresh grading sandbox, removal.

``--start-delay S`` adds S seconds to every sandbox start (an ``asyncio.sleep`` before the backend's
own start, agent and grading sandboxes alike): a remote provider's creation latency, which waits on
the network rather than this machine's CPU (Daytona, Modal and Kubernetes take seconds to hand over a
sandbox). It is an emulation, named as such in the output; 0 is this machine's own backends as they are.

On this 2-core machine the local and Docker starts are CPU work (bubblewrap and namespaces; dockerd and
runc): a pool that sets up ahead competes with the running episodes for the same two cores, so the pool
can only hide what waits on something other than the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sandbox as sandbox_mod
from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy

_DELAY = [0.0]  # seconds every sandbox start waits first (the emulated provider latency)
_real_start = sandbox_mod.BaseSandbox.start


async def _delayed_start(self: Any) -> None:
    if _DELAY[0] > 0:
        await asyncio.sleep(_DELAY[0])
    await _real_start(self)


sandbox_mod.BaseSandbox.start = _delayed_start  # type: ignore[method-assign]


async def _one(backend: str, harness: str, concurrency: int, episodes: int, warm: int) -> dict[str, Any]:
    tasks = load_dataset("examples").tasks
    attempts = -(-episodes // len(tasks))
    with TemporaryDirectory() as out:
        t0 = time.perf_counter()
        summary = await run_rollouts(
            tasks, policy=make_policy("oracle"), episode=EpisodeConfig(harness, sandbox=backend),
            run=RunConfig(concurrency=concurrency, attempts=attempts, warm=warm, stats="null", out=out),
        )
        wall = time.perf_counter() - t0
    eps = summary.episodes
    ok = sum(1 for e in eps if e.reward == 1.0)
    return {
        "episodes": len(eps), "rewarded": ok, "wall_s": wall, "episodes_per_min": 60.0 * len(eps) / wall,
        "warm_episodes": sum(1 for e in eps if e.warm),
        "median_setup_s": statistics.median(e.setup_seconds for e in eps),
        "median_episode_s": statistics.median(e.duration for e in eps),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="local,docker")
    ap.add_argument("--harnesses", default="tiny-agent,mini-swe-agent")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--start-delay", default="0,2", help="emulated provider start latency(s), seconds")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for delay in [float(x) for x in args.start_delay.split(",")]:
        _DELAY[0] = delay
        for backend in args.backends.split(","):
            for harness in args.harnesses.split(","):
                runs: dict[int, list[dict[str, Any]]] = {0: [], args.concurrency: []}
                for _ in range(args.repeat):
                    for warm in runs:
                        runs[warm].append(await _one(backend, harness, args.concurrency, args.episodes, warm))
                med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
                cold, warm = med[0], med[args.concurrency]
                row = {"backend": backend, "harness": harness, "start_delay_s": delay,
                       "concurrency": args.concurrency, "cold": cold, "warm": warm,
                       "ratio": warm["episodes_per_min"] / cold["episodes_per_min"],
                       "all_rewarded": all(r["rewarded"] == r["episodes"]
                                           for rs in runs.values() for r in rs)}
                rows.append(row)
                print(f"{backend:6} {harness:15} start +{delay:.0f}s  -n {args.concurrency}: "
                      f"cold {cold['episodes_per_min']:6.1f}/min (setup {cold['median_setup_s']:.2f}s, "
                      f"episode {cold['median_episode_s']:.2f}s)  warm {warm['episodes_per_min']:6.1f}/min "
                      f"(episode {warm['median_episode_s']:.2f}s, {warm['warm_episodes']:.0f} warm)  "
                      f"ratio {row['ratio']:.2f}x  all rewarded: {row['all_rewarded']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))  # noqa: ASYNC240 (once, at the end)


if __name__ == "__main__":
    asyncio.run(main())
