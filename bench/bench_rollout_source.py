"""Throughput of the streaming rollout source against ``run_rollouts`` on the same tasks.

    python3 bench/bench_rollout_source.py [--concurrency 8] [--attempts 4] [--repeat 5] [--json out.json]

Both run the bundled example tasks ``attempts`` times each with the ``tiny-agent`` harness (a python3
chat-completions agent that starts in milliseconds) and the ``scripted`` policy (one ``true`` command,
then finish: two LLM calls per episode), ``concurrency`` at once, in local sandboxes, writing the same
OUT files: :func:`~ares_gateway.episodes.rollouts.run_rollouts` as ``run`` calls it, and a
:class:`~ares_gateway.RolloutSource` whose consumer takes each item as soon as it is there (``episodes``:
one by one; ``groups``: whole groups). Wall time is from the call to the end of the run (its
``results.json`` written and its gateway closed). The three are interleaved, their order rotated each
round; medians over the rounds, and each source's ratio to ``run_rollouts`` per round, then the median.
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

from ares_gateway import EpisodeConfig, RolloutSource, RunConfig
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy


async def one(kind: str, concurrency: int, attempts: int, out: Path) -> dict[str, Any]:
    tasks = load_dataset("examples").tasks
    policy = make_policy("scripted", commands=["true"])
    started = time.monotonic()
    if kind == "run_rollouts":
        summary = await run_rollouts(
            tasks, policy=policy, episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(concurrency=concurrency, attempts=attempts, out=out, stats="null"),
        )
        episodes = summary.episodes
    else:
        source = RolloutSource(
            tasks, policy=policy, episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(concurrency=concurrency, attempts=attempts, out=out, stats="null"),
        )
        async with source:
            if kind == "source-episodes":
                async for _ in source.episodes():
                    pass
            else:
                async for _ in source.groups():
                    pass
        episodes = source.summary.episodes
    wall = time.monotonic() - started
    assert len(episodes) == len(tasks) * attempts, len(episodes)
    assert all(e.exit_reason == "completed" for e in episodes), [e.error for e in episodes if e.error]
    return {"kind": kind, "episodes": len(episodes), "wall_s": round(wall, 3),
            "episodes_per_minute": round(len(episodes) / wall * 60, 2)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--attempts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    kinds = ["run_rollouts", "source-episodes", "source-groups"]
    rows: list[dict[str, Any]] = []
    with TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                row = await one(kind, args.concurrency, args.attempts, Path(tmp) / f"{kind}-{r}")
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    by_kind = {k: [row for row in rows if row["kind"] == k] for k in kinds}
    base = {row["round"]: row["episodes_per_minute"] for row in by_kind["run_rollouts"]}
    summary = {}
    for k in kinds:
        rates = [row["episodes_per_minute"] for row in by_kind[k]]
        ratios = [row["episodes_per_minute"] / base[row["round"]] for row in by_kind[k]]
        summary[k] = {"median_episodes_per_minute": round(statistics.median(rates), 2),
                      "min": min(rates), "max": max(rates),
                      "median_ratio_to_run_rollouts": round(statistics.median(ratios), 3)}
    print(json.dumps({"concurrency": args.concurrency, "attempts": args.attempts, "repeat": args.repeat,
                      "summary": summary}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
