"""What grading in a fresh sandbox adds to an episode: the bundled tasks with the oracle policy, graded in
a fresh sandbox (``[verifier] sandbox = "fresh"``, the default) and in the agent's own sandbox (the
``"agent"`` opt-out), on each backend.

    python3 bench/bench_grading.py [--backends local,docker] [--repeats 5] [--harness tiny-agent]
                                   [--json out.json]

Each episode runs alone (one at a time, the two modes interleaved task by task so that drift hits
both alike) through :func:`ares_gateway.episodes.rollouts.run_rollouts`, what ``ares-gateway run``
calls: a fresh sandbox, workdir upload, the agent's install (reused) and launch, the oracle's turns,
the task's tests, and removal of every sandbox. ``episode_s`` is the wall time of that call;
``verify_s`` the episode's ``verify_seconds`` (fresh: the kill, the workdir's copy and the tests;
agent: the tests). The added seconds per episode are the difference of the medians, fresh minus
agent, per task and over all tasks. The fresh grading sandbox starts while the agent runs, so its
start shows only where it outlasts the agent or slows it down; its removal is in ``episode_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ares_gateway import EpisodeConfig, Gateway, RunConfig
from ares_gateway.episodes.episode import harness_side_call_detector, resolve_backend
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import Task, load_dataset
from ares_gateway.policies import make_policy

MODES = ("fresh", "agent")


def graded(task: Task, mode: str) -> Task:
    """``task`` with ``[verifier] sandbox = mode``."""
    return dataclasses.replace(task, config=dataclasses.replace(task.config, grading=mode))


async def one(gw: Gateway, task: Task, backend: str, harness: str, out: Path) -> dict[str, Any]:
    started = time.monotonic()
    summary = await run_rollouts(
        [task], policy=make_policy("oracle"), gateway=gw,
        episode=EpisodeConfig(harness, sandbox=backend, time_limit=300), run=RunConfig(out=out, stats="null"),
    )
    wall = time.monotonic() - started
    [e] = summary.episodes
    if e.exit_reason != "completed" or e.reward != 1.0:
        raise SystemExit(
            f"{task.name} ({task.config.grading}, {backend}): {e.exit_reason}, reward {e.reward}: {e.error}")
    return {"episode_s": wall, "verify_s": e.verify_seconds, "setup_s": e.setup_seconds}


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


async def bench(backend: str, repeats: int, harness: str) -> dict[str, Any]:
    tasks = list(load_dataset("examples").tasks)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(t.name, m): [] for t in tasks for m in MODES}
    async with Gateway(port=0, side_call_detector=harness_side_call_detector(harness)) as gw:
        with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
            # One untimed round first: images built, the agent's install cached, caches warm.
            for task in tasks:
                await one(gw, graded(task, "fresh"), backend, harness, Path(tmp) / f"warm-{task.name}")
            n = 0
            for rep in range(repeats):
                for task in tasks:
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        n += 1
                        row = await one(gw, graded(task, mode), backend, harness, Path(tmp) / f"{n}")
                        runs[(task.name, mode)].append(row)
                print(f"  {backend}: round {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    per_task = {}
    for task in tasks:
        fresh, agent = runs[(task.name, "fresh")], runs[(task.name, "agent")]
        per_task[task.name] = {
            "fresh_episode_s": round(med(fresh, "episode_s"), 3),
            "agent_episode_s": round(med(agent, "episode_s"), 3),
            "added_episode_s": round(med(fresh, "episode_s") - med(agent, "episode_s"), 3),
            "fresh_verify_s": round(med(fresh, "verify_s"), 3),
            "agent_verify_s": round(med(agent, "verify_s"), 3),
        }
    every = {m: [r for (_, mode), rows in runs.items() if mode == m for r in rows] for m in MODES}
    return {
        "backend": backend,
        "repeats": repeats,
        "harness": harness,
        "tasks": per_task,
        "fresh_episode_s": round(med(every["fresh"], "episode_s"), 3),
        "agent_episode_s": round(med(every["agent"], "episode_s"), 3),
        "added_episode_s": round(med(every["fresh"], "episode_s") - med(every["agent"], "episode_s"), 3),
        "added_verify_s": round(med(every["fresh"], "verify_s") - med(every["agent"], "verify_s"), 3),
        "added_setup_s": round(med(every["fresh"], "setup_s") - med(every["agent"], "setup_s"), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="local,docker", help="comma-separated: local, docker")
    ap.add_argument("--repeats", type=int, default=5,
                    help="episodes per task and mode (the median is reported)")
    ap.add_argument("--harness", default="tiny-agent",
                    help="the agent CLI (tiny-agent: no start-up cost to hide ours)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    results = []
    for backend in args.backends.split(","):
        backend = resolve_backend(backend.strip())
        result = asyncio.run(bench(backend, args.repeats, args.harness))
        results.append(result)
        print(f"{backend} ({args.harness}, oracle, median of {args.repeats} per task and mode):")
        print(f"  {'task':<24} {'fresh s':>8} {'agent s':>8} {'added s':>8} {'verify fresh':>13} "
              f"{'verify agent':>13}")
        for name, row in result["tasks"].items():
            print(f"  {name:<24} {row['fresh_episode_s']:>8.3f} {row['agent_episode_s']:>8.3f} "
                  f"{row['added_episode_s']:>8.3f} {row['fresh_verify_s']:>13.3f} "
                  f"{row['agent_verify_s']:>13.3f}")
        print(
            f"  all tasks: fresh {result['fresh_episode_s']:.3f} s, agent {result['agent_episode_s']:.3f} s, "
            f"added {result['added_episode_s']:.3f} s per episode (verify +{result['added_verify_s']:.3f} s, "
            f"setup {result['added_setup_s']:+.3f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
