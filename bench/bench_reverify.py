"""What saving workspaces costs, and how fast ``reverify`` grades them again.

    python3 bench/bench_reverify.py --rounds 5 [--backend local] [--out /tmp/bench-reverify]

Runs the bundled examples (4 tasks) with tiny-agent and the oracle policy, one episode at a time,
``--rounds`` times with saved workspaces and as many without, alternating (so load drifts hit both
alike), and prints the median episode wall time (``duration``) and ``verify_seconds`` of each; then
``reverify_run`` over the last saved run at concurrency 1 and 4, and prints episodes per minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.reverify import reverify_run
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy


async def _one(tasks: Any, backend: str, out: Path, save: bool) -> list[Any]:
    summary = await run_rollouts(
        tasks, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox=backend),
        run=RunConfig(concurrency=1, out=out, stats="null", save_workspaces=save),
    )
    assert all(e.reward == 1.0 for e in summary.episodes), [(e.task, e.error) for e in summary.episodes]
    return summary.episodes


async def main(rounds: int, backend: str, root: Path) -> dict[str, Any]:
    tasks = load_dataset("examples").tasks
    await _one(tasks, backend, root / "warmup", True)
    runs: dict[bool, list[Any]] = {True: [], False: []}
    last = root / "warmup"
    for i in range(rounds):
        for save in (True, False):
            out = root / f"{'save' if save else 'nosave'}-{i}"
            runs[save].extend(await _one(tasks, backend, out, save))
            if save:
                last = out
    result: dict[str, Any] = {"backend": backend, "rounds": rounds}
    for save, eps in runs.items():
        key = "with" if save else "without"
        result[key] = {"episodes": len(eps),
                       "median_duration_s": round(statistics.median(e.duration for e in eps), 3),
                       "median_verify_s": round(statistics.median(e.verify_seconds for e in eps), 3)}
    sizes = [e.workspace_bytes for e in runs[True] if e.workspace_bytes]
    result["workspace_bytes_median"] = statistics.median(sizes) if sizes else None
    for n in (1, 4):
        t0 = time.monotonic()
        report = await reverify_run(last, sandbox=backend, concurrency=n, write=False)
        took = time.monotonic() - t0
        assert report.exit_code == 0, [(c.key, c.status, c.note) for c in report.episodes]
        n_eps = len(report.episodes)
        result[f"reverify_concurrency_{n}"] = {"episodes": n_eps, "seconds": round(took, 2),
                                               "episodes_per_minute": round(n_eps / took * 60, 1)}
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench-reverify-"))
    print(json.dumps(asyncio.run(main(args.rounds, args.backend, root)), indent=2))
