"""Policy versions and the weight-update fence on a RayExecutor: every node's gateway gets them.

One real 2-node Ray cluster on loopback for the module (tests/scale/test_ray_executor.py's), real
tiny-agent episodes in local sandboxes answered on each node by the oracle, slowed so that generations
are in flight when the fence comes:

* a version set before the run stamps every turn; a drain fence mid-run reaches both nodes, its report
  adds theirs up, no turn is lost, and every turn answered after it carries the new version;
* bad calls raise the gateway's own errors; a node whose pause fails has the other resumed, and the
  error names it; a node whose actor died is left out of the fence.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.core.errors import (
    InvalidFenceError,
    InvalidPolicyVersionError,
    PolicyVersionBackwardsError,
    SamplingNotPausedError,
    SamplingPausedError,
)
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from tests.helpers import left_behind
from tests.scale.test_ray_executor import _node_names, _start_cluster, _stop_cluster

pytestmark = pytest.mark.slow

TASKS = load_dataset("examples").tasks


async def _until_dead(actor: Any, timeout: float = 30.0) -> None:
    """Wait until calls on a killed ``actor`` fail (``ray.kill`` returns before the actor is gone)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            await actor.sampling.remote()
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        await asyncio.sleep(0.1)


class SlowOracle:
    """The oracle policy, each answer ``delay`` seconds late (it travels to the nodes by value)."""

    def __init__(self, delay: float) -> None:
        self.inner: Any = make_policy("oracle")
        self.delay = delay

    def bind(self, session_id: str, *, agent: str, task: Any = None) -> None:
        self.inner.bind(session_id, agent=agent, task=task)

    def unbind(self, session_id: str) -> None:
        self.inner.unbind(session_id)

    async def __call__(self, request: Any) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner(request)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    import ray.cloudpickle

    # This module's SlowOracle goes to the actors by value (the workers need not import the tests).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    before = os.environ.get("ARES_SANDBOX_LOCAL_ROOT")
    root = tmp_path_factory.mktemp("ray-fence") / "sandboxes"
    c = _start_cluster(root)
    try:
        yield c, root
    finally:
        _stop_cluster(c)
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if before is None:
            os.environ.pop("ARES_SANDBOX_LOCAL_ROOT", None)
        else:
            os.environ["ARES_SANDBOX_LOCAL_ROOT"] = before


async def _states(ex: Any) -> dict[str, dict[str, Any]]:
    """Each node's fence state and policy version, asked of its actor."""
    nodes = ex.nodes
    got = await asyncio.gather(*(ex._actors[n].sampling.remote() for n in nodes))
    return dict(zip(nodes, got, strict=True))


async def test_a_version_and_a_weight_update_reach_every_nodes_turns(cluster: tuple[Any, Path],
                                                                    tmp_path: Path) -> None:
    from ares_gateway.episodes.ray import RayExecutor

    _, root = cluster
    ex = RayExecutor(per_node=2)
    await ex.set_policy_version(3)  # before start: for the gateways start() builds
    with pytest.raises(InvalidPolicyVersionError):
        await ex.set_policy_version(-1)
    with pytest.raises(RuntimeError, match="before start"):
        await ex.pause_sampling()
    with pytest.raises(SamplingNotPausedError):
        await ex.resume_sampling(4)
    fenced: dict[str, Any] = {}

    async def fence() -> None:
        while True:  # both nodes have a generation in flight
            states = await _states(ex) if len(ex.nodes) == 2 else {}
            if states and all(s["in_flight"] >= 1 for s in states.values()):
                break
            await asyncio.sleep(0.05)
        assert {s["policy_version"] for s in states.values()} == {3}
        with pytest.raises(InvalidFenceError):
            await ex.pause_sampling("later")
        with pytest.raises(InvalidFenceError):
            await ex.pause_sampling(timeout=0)
        fenced["paused_at"] = time.time()
        async with ex.weight_update(4, timeout=60) as report:
            fenced["report"], fenced["per_node"] = report, dict(ex.pause_reports)
            fenced["during"] = await _states(ex)
            with pytest.raises(SamplingPausedError):
                await ex.pause_sampling()
            await asyncio.sleep(0.3)  # "updating the weights"
        fenced["resumed_at"] = time.time()
        fenced["after"] = await _states(ex)
        with pytest.raises(SamplingNotPausedError):
            await ex.resume_sampling()
        with pytest.raises(PolicyVersionBackwardsError):
            await ex.set_policy_version(3)

    fencing = asyncio.create_task(fence())
    out = tmp_path / "run"
    try:
        summary = await run_rollouts(
            TASKS, policy=SlowOracle(1.5), episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(out=out, executor=ex, stats="null"),
        )
    finally:
        if not fencing.done():
            fencing.cancel()
        await asyncio.gather(fencing, return_exceptions=True)
    fencing.result()  # the fence's own assertions
    assert [e.reward for e in summary.episodes] == [1.0] * len(TASKS), [(e.key, e.error)
                                                                        for e in summary.episodes]
    assert all(e.turns == 2 for e in summary.episodes)  # no turn lost
    names = _node_names()
    assert {names[e.node] for e in summary.episodes if e.node} == {"node-a", "node-b"}

    # The drain reached both nodes and its report adds theirs up.
    report, per_node = fenced["report"], fenced["per_node"]
    assert set(per_node) == set(fenced["during"]) and len(per_node) == 2
    assert all(s["state"] == "paused" for s in fenced["during"].values())
    assert report.mode == "drain" and report.in_flight == sum(r.in_flight for r in per_node.values()) >= 2
    assert report.drain_seconds == max(r.drain_seconds for r in per_node.values())
    assert report.parked == sum(r.parked for r in per_node.values()) and report.aborted == 0
    assert all(s["state"] == "sampling" and s["policy_version"] == 4 for s in fenced["after"].values())

    versions = []
    for e in summary.episodes:
        turns = [json.loads(line) for line in (out / "turns" / f"{e.key}.jsonl").read_text().splitlines()]
        got = [t["policy_version"] for t in turns]
        assert got == sorted(got) and set(got) <= {3, 4}, (e.key, got)  # every turn stamped
        for t in turns:
            if t["timestamp"] > fenced["resumed_at"]:
                assert t["policy_version"] == 4, (e.key, t["timestamp"], fenced)
            if t["policy_version"] == 4:
                assert t["timestamp"] > fenced["paused_at"], (e.key, t["timestamp"], fenced)
        versions += got
    assert {3, 4} <= set(versions)
    assert ex.policy_version == 4  # kept after close, for the next start
    assert left_behind(root) == []


async def test_a_node_whose_pause_fails_leaves_the_others_resumed(cluster: tuple[Any, Path]) -> None:
    import ray

    from ares_gateway.episodes.ray import RayExecutor

    ex = RayExecutor(per_node=1)
    await ex.start(tasks=TASKS, policy=make_policy("oracle"),
                   episode=EpisodeConfig("tiny-agent", sandbox="local"))
    try:
        await ex.set_policy_version(5)
        assert {s["policy_version"] for s in (await _states(ex)).values()} == {5}
        a, b = ex.nodes
        await ex._actors[b].pause_sampling.remote("drain", None)  # someone paused node b's gateway directly
        with pytest.raises(SamplingPausedError, match=f"^node {b[:12]}: .*the other nodes were resumed"):
            await ex.pause_sampling()
        states = await _states(ex)
        assert states[a]["state"] == "sampling" and states[b]["state"] == "paused"
        await ex._actors[b].resume_sampling.remote(None)

        report = await ex.pause_sampling("abort", timeout=10)  # the executor's fence is usable again
        assert report.mode == "abort" and report.in_flight == 0 and set(ex.pause_reports) == {a, b}
        with pytest.raises(InvalidPolicyVersionError):
            await ex.resume_sampling(True)  # type: ignore[arg-type]
        with pytest.raises(PolicyVersionBackwardsError):
            await ex.resume_sampling(4)
        # a refused resume: still paused
        assert {s["state"] for s in (await _states(ex)).values()} == {"paused"}
        assert await ex.resume_sampling(6) >= 0
        assert {(s["state"], s["policy_version"]) for s in (await _states(ex)).values()} == {("sampling", 6)}
        assert ex.policy_version == 6

        ray.kill(ex._actors[b], no_restart=True)  # a node's actor dies: the fence goes on without it
        await _until_dead(ex._actors[b])  # ray.kill only asks: a call right after it may still be served
        report = await ex.pause_sampling()
        assert set(ex.pause_reports) == {a} and ex.lost == [b] and ex.nodes == [a] and report.in_flight == 0
        await ex.resume_sampling(7)
        assert {n: s["policy_version"] for n, s in (await _states(ex)).items()} == {a: 7}
    finally:
        await ex.close()
