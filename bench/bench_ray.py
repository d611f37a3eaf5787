"""Episodes per minute: :class:`LocalExecutor` against :class:`RayExecutor` on 1 and 2 simulated nodes.

    python3 bench/bench_ray.py [--harness tiny-agent|mini-swe-agent] [--attempts 4] [-n 4] [--repeat 3]

The same plan (the bundled example tasks x ``--attempts``, the ``oracle`` policy, local sandboxes,
``-n`` episodes at once) runs with each executor, ``--repeat`` times, interleaved (local, ray-1, ray-2,
local, ...) so that a noisy machine weighs on each alike; the medians are printed.

* ``local``: this process, one gateway (what ``ares-gateway run`` does without ``--ray``);
* ``ray-1``: a Ray cluster of one node on this machine (loopback), one gateway actor;
* ``ray-2``: the same cluster with a second simulated node: two actors, on the same cores.

The actor call's overhead per episode is the driver's wall time of each ``RayExecutor.run`` call
less the episode's own duration measured on its node: what Ray adds (dispatch, the record sent back,
pickling the episode's samples and turn log). The per-run start (actors, their gateways, each node's
harness check) is reported apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.executor import LocalExecutor
from ares_gateway.episodes.ray import RayExecutor
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy


class _Timed:
    """Wraps an executor: each run call's wall time next to the episode's own duration."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.calls: list[tuple[float, float]] = []
        self.start_s = 0.0

    @property
    def slots(self) -> int:
        return int(self.inner.slots)

    async def start(self, **kw: Any) -> None:
        t0 = time.perf_counter()
        await self.inner.start(**kw)
        self.start_s = time.perf_counter() - t0

    async def run(self, spec: Any) -> Any:
        t0 = time.perf_counter()
        record = await self.inner.run(spec)
        self.calls.append((time.perf_counter() - t0, float(record.result.duration)))
        return record

    def turns_answered(self) -> int:
        return int(self.inner.turns_answered())

    def describe(self) -> list[str]:
        return list(self.inner.describe())

    async def close(self) -> None:
        await self.inner.close()


async def one(kind: str, tasks: list[Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    inner: Any = LocalExecutor(concurrency=args.n) if kind == "local" else RayExecutor(per_node=args.n)
    ex = _Timed(inner)
    t0 = time.perf_counter()
    summary = await run_rollouts(
        tasks, policy=make_policy("oracle"), episode=EpisodeConfig(args.harness, sandbox="local"),
        run=RunConfig(concurrency=args.n, attempts=args.attempts, out=out, executor=ex, stats="null"),
    )
    wall = time.perf_counter() - t0
    bad = [e.key for e in summary.episodes if e.reward != 1.0]
    if bad or len(summary.episodes) != len(tasks) * args.attempts:
        raise SystemExit(f"{kind}: not every episode passed: {bad}")
    overhead = [call - own for call, own in ex.calls]
    return {"kind": kind, "episodes": len(summary.episodes), "wall_s": wall, "start_s": ex.start_s,
            "episodes_per_min": 60 * len(summary.episodes) / wall,
            "episodes_per_min_after_start": 60 * len(summary.episodes) / max(wall - ex.start_s, 1e-9),
            "call_overhead_ms_p50": 1000 * statistics.median(overhead),
            "nodes": len({e.node for e in summary.episodes if e.node})}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--harness", default="tiny-agent")
    p.add_argument("--attempts", type=int, default=4)
    p.add_argument("-n", type=int, default=4, help="episodes at once (and per node on Ray)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    tasks = list(load_dataset("examples").tasks)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    os.environ["ARES_SANDBOX_LOCAL_ROOT"] = str(tmp / "sandboxes")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    ray.init(address=cluster.address, logging_level="ERROR")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    rows: dict[str, list[dict[str, Any]]] = {"local": [], "ray-1": [], "ray-2": []}
    try:
        # A warm-up of each: the harness install on the host, Ray's worker pool.
        await one("local", tasks, args, tmp / "warm-local")
        await one("ray", tasks, args, tmp / "warm-ray")
        second = None
        for r in range(args.repeat):
            for kind in ("local", "ray-1", "ray-2"):
                if kind == "ray-2" and second is None:
                    second = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
                    cluster.wait_for_nodes()
                if kind == "ray-1" and second is not None:
                    cluster.remove_node(second)
                    second = None
                    while sum(1 for n in ray.nodes() if n["Alive"]) != 1:  # noqa: ASYNC110 (Ray's state, no event)
                        await asyncio.sleep(0.2)
                row = await one("local" if kind == "local" else "ray", tasks, args, tmp / f"{kind}-{r}")
                rows[kind].append(row)
                print(
                    f"{kind} #{r}: {row['episodes_per_min']:.1f} episodes/min ({row['wall_s']:.1f} s, start "
                    f"{row['start_s']:.2f} s, {row['nodes']} node(s)), call overhead p50 "
                    f"{row['call_overhead_ms_p50']:.1f} ms", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0] if f != "kind"} for k, v in rows.items()}
    base = med["local"]["episodes_per_min"]
    print(f"\n{args.harness}, {len(tasks)} tasks x {args.attempts} attempts, -n {args.n}, medians of "
          f"{args.repeat}:")
    print("| executor | episodes/min | vs local | start (s) | episodes/min after start | actor call "
          "overhead p50 |")
    print("|---|---|---|---|---|---|")
    for k, m in med.items():
        overhead = f"{m['call_overhead_ms_p50']:.1f} ms"
        print(f"| {k} | {m['episodes_per_min']:.1f} | {m['episodes_per_min'] / base:.2f} | "
              f"{m['start_s']:.2f} | {m['episodes_per_min_after_start']:.1f} | {overhead} |")
    if args.json:
        text = json.dumps({"args": vars(args), "rows": rows, "medians": med}, indent=2)
        await asyncio.to_thread(Path(args.json).write_text, text)


if __name__ == "__main__":
    asyncio.run(main())
