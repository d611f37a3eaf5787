"""Throughput of ``ares-gateway run``: episodes per minute with local sandboxes and a trivial agent.

    python3 bench/bench_rollouts.py [--levels 1,8,32] [--episodes 8,32,64] [--grading fresh|agent]
                                    [--json out.json]

Each level runs :func:`ares_gateway.episodes.rollouts.run_rollouts` (what ``run`` calls) over the bundled
example tasks with the ``tiny-agent`` harness (a python3 stdlib chat-completions agent: no start-up
cost to hide the runner's) and the ``scripted`` policy (one ``true`` command, then finish: two LLM
calls per episode). Every episode is complete: a fresh local sandbox, workdir upload, agent install,
launch, two turns, the task's tests (by default in a fresh grading sandbox started beside the agent's;
``--grading agent`` runs them in the agent's own sandbox, to see what the second sandbox costs), removal.

The gateway's share of the per-turn time: per-turn time is the agent's wall time (launch to exit)
divided by its turns; the gateway's part is the median round trip of the same chat-completions
requests (replayed from the run's turn log) through a fresh gateway session, answered at once in
process; the share is their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from ares_gateway import Completion, EpisodeConfig, Gateway, RunConfig
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy


async def level(concurrency: int, episodes: int, out: Path, grading: str = "fresh") -> dict[str, Any]:
    tasks = [dataclasses.replace(t, config=dataclasses.replace(t.config, grading=grading))
             for t in load_dataset("examples").tasks]
    attempts = -(-episodes // len(tasks))
    started = time.monotonic()
    summary = await run_rollouts(
        tasks, policy=make_policy("scripted", commands=["true"]),
        episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=concurrency, attempts=attempts, out=out, stats="null"),
    )
    wall = time.monotonic() - started
    eps = summary.episodes
    assert all(e.exit_reason == "completed" for e in eps), [e.error for e in eps if e.error]
    per_turn = statistics.median(e.agent_seconds / e.turns for e in eps)
    return {
        "concurrency": concurrency,
        "episodes": len(eps),
        "wall_s": round(wall, 2),
        "episodes_per_minute": round(len(eps) / wall * 60, 1),
        "median_episode_s": round(statistics.median(e.duration for e in eps), 3),
        "median_setup_s": round(statistics.median(e.setup_seconds for e in eps), 3),
        "median_verify_s": round(statistics.median(e.verify_seconds for e in eps), 3),
        "median_turn_s": round(per_turn, 4),
        "median_answer_latency_ms": round(statistics.median(e.answer_latency or 0.0 for e in eps) * 1000, 3),
    }


async def gateway_round_trip(bodies: list[dict[str, Any]], repeats: int = 200) -> float:
    """Median seconds for one recorded chat-completions request through the gateway, answered at once."""
    answer = Completion(text="ok")
    times: list[float] = []
    async with Gateway(port=0) as gw, aiohttp.ClientSession() as http:
        info = await gw.create_session()

        async def responder() -> None:
            while True:
                req = await gw.next_request(session=info.session_id)
                assert req is not None
                await gw.respond(req.id, answer)

        task = asyncio.create_task(responder())
        url = f"{info.base_url}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {info.token}"}
        for i in range(repeats):
            body = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            async with http.post(url, json=body, headers=headers) as r:
                await r.read()
                assert r.status == 200
            times.append(time.perf_counter() - t0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return statistics.median(times[20:])


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    levels = [int(x) for x in args.levels.split(",")]
    counts = [int(x) for x in args.episodes.split(",")]
    rows = []
    with TemporaryDirectory() as tmp:
        for c, n in zip(levels, counts, strict=True):
            out = Path(tmp) / f"c{c}"
            row = await level(c, n, out, args.grading)
            turns_file = next((out / "turns").glob("*.jsonl"))
            bodies = [json.loads(line)["request"] for line in turns_file.read_text().splitlines()]
            rtt = await gateway_round_trip(bodies)
            row["gateway_round_trip_ms"] = round(rtt * 1000, 3)
            row["gateway_share_of_turn"] = round(rtt / row["median_turn_s"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| concurrency | episodes | episodes/min | median episode | setup | verify | turn (agent) | "
          "gateway round trip | gateway share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['episodes']} | {r['episodes_per_minute']} | "
              f"{r['median_episode_s']} s | {r['median_setup_s']} s | {r['median_verify_s']} s | "
              f"{r['median_turn_s'] * 1000:.0f} ms | {r['gateway_round_trip_ms']} ms | "
              f"{r['gateway_share_of_turn'] * 100:.2f} % |")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--episodes", default="8,32,64", help="episodes per level (rounded up to whole attempts)")
    ap.add_argument("--grading", choices=("fresh", "agent"), default="fresh",
                    help="where the tests run ([verifier] sandbox): a fresh sandbox (the default) "
                         "or the agent's")
    ap.add_argument("--json", default=None)
    cli_args = ap.parse_args()
    results = asyncio.run(main(cli_args))
    if cli_args.json:
        Path(cli_args.json).write_text(json.dumps(results, indent=2) + "\n")
