"""RayExecutor on a real Ray cluster of simulated nodes on this machine (loopback only)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from tests.prereq import require

pytestmark = pytest.mark.slow

TASKS = load_dataset("examples").tasks


@pytest.fixture
def sandbox_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))  # before the cluster: its workers inherit it
    return root


@pytest.fixture
def cluster(sandbox_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    try:
        import ray
        from ray.cluster_utils import Cluster
    except Exception as exc:
        require(False, f"ray is not installed ({exc}): python3 -m pip install -e '.[ray]'")
    # tests/conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray was imported: loopback only.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node-a": 1},
                                                      "node_ip_address": "127.0.0.1"})
    c.add_node(num_cpus=1, resources={"node-b": 1}, node_ip_address="127.0.0.1")
    ray.init(address=c.address)
    try:
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback held
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _files(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "tb" not in p.parts}


async def test_oracle_on_two_nodes_gives_a_local_runs_outputs(cluster: Any, tmp_path: Path, sandbox_root: Path) -> None:
    from ares_gateway.episodes.ray import RayExecutor

    ex = RayExecutor(per_node=2)
    summary = await run_rollouts(TASKS, harness="tiny-agent", policy=make_policy("oracle"), sandbox="local",
                                 attempts=2, out=tmp_path / "ray", executor=ex, stats="null")
    assert len(summary.episodes) == 8 and all(e.reward == 1.0 for e in summary.episodes)
    assert len({e.key for e in summary.episodes}) == 8
    nodes = {e.node for e in summary.episodes}
    assert len(nodes) == 2 and None not in nodes  # both nodes ran episodes
    doc = json.loads((tmp_path / "ray" / "results.json").read_text())
    assert doc["run"]["executor"] == "ray" and {e["node"] for e in doc["episodes"]} == nodes
    lines = [json.loads(x) for x in (tmp_path / "ray" / "episodes.jsonl").read_text().splitlines()]
    assert {x["node"] for x in lines} == nodes

    local = await run_rollouts(TASKS, harness="tiny-agent", policy=make_policy("oracle"), sandbox="local",
                               attempts=2, out=tmp_path / "local", concurrency=4, stats="null")
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")
    for e in local.episodes:
        key = f"{e.task}.{e.attempt}"
        ours = (tmp_path / "ray" / "trajectories" / f"{key}.jsonl").read_text().splitlines()
        theirs = (tmp_path / "local" / "trajectories" / f"{key}.jsonl").read_text().splitlines()
        assert len(ours) == len(theirs)
    assert _left(sandbox_root) == []


def _left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


async def test_a_dead_node_actor_reruns_its_episodes_elsewhere_once(cluster: Any, tmp_path: Path,
                                                                     sandbox_root: Path) -> None:
    import ray

    from ares_gateway.episodes.ray import RayExecutor

    ex = RayExecutor(per_node=2)
    killed: list[str] = []

    def on_episode(result: Any) -> None:
        if not killed:  # after the first finished episode, the other node's actor dies mid-run
            victim = next(n for n in ex.nodes if n != result.node)
            killed.append(victim)
            ray.kill(ex._actors[victim], no_restart=True)

    policy = make_policy("scripted", commands=["sleep 2"])
    summary = await run_rollouts(TASKS, harness="tiny-agent", policy=policy, sandbox="local", attempts=2,
                                 out=tmp_path / "run", executor=ex, stats="null", on_episode=on_episode)
    keys = [e.key for e in summary.episodes]
    assert sorted(keys) == sorted(f"{t.name}.{a}" for t in TASKS for a in (0, 1))  # each exactly once
    assert not summary.cancelled and all(e.exit_reason == "completed" for e in summary.episodes)
    # The episodes the dead actor was running ran again on the live node; none is recorded on the dead one.
    assert killed and ex.reruns and all(e.node != killed[0] for e in summary.episodes)
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert len(doc["episodes"]) == 8 and sorted(e["attempt"] for e in doc["episodes"]) == [0] * 4 + [1] * 4
    # The killed actor's sandboxes were removed from its node at close (the sandbox janitor's own gc).
    assert ex.lost == killed and len(ex.collected) == len(ex.reruns)
    assert _left(sandbox_root) == []
