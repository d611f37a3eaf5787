"""The streaming rollout source on a RayExecutor: a real 2-node Ray cluster on loopback
(tests/scale/test_ray_executor.py's), real tiny-agent episodes in local sandboxes answered on each node
by the oracle. Groups complete with every attempt, both nodes run episodes, a version set through the
source before the start stamps the first epoch's turns, and a weight update fenced through the source
between groups stamps the episodes launched after it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ares_gateway import EpisodeConfig, RolloutSource, RunConfig
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from tests.helpers import left_behind
from tests.scale.test_ray_executor import _node_names, _start_cluster, _stop_cluster

pytestmark = pytest.mark.slow

TASKS = load_dataset("examples").tasks[:2]


@pytest.mark.asyncio
async def test_groups_stream_from_a_ray_cluster_with_fenced_versions(tmp_path: Path) -> None:
    from ares_gateway.episodes.ray import RayExecutor

    before = os.environ.get("ARES_SANDBOX_LOCAL_ROOT")
    root = tmp_path / "sandboxes"
    cluster = _start_cluster(root)
    try:
        names = _node_names()
        out = tmp_path / "run"
        # One epoch in hand at most (concurrency 2 + 2 buffered): the second epoch launches only as the
        # first one's groups are taken, so after the fence below.
        source = RolloutSource(
            TASKS, policy=make_policy("oracle"), epochs=2, max_buffered=2,
            episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(concurrency=2, attempts=2, out=out, stats="null", executor=RayExecutor(per_node=1)),
        )
        await source.set_policy_version(3)
        groups = []
        async with source:
            async for group in source.groups():
                groups.append(group)
                if len(groups) == 1:
                    async with source.weight_update(4):
                        pass
                    assert source.policy_version == 4
        assert [sorted(g.members[i].attempt for i in range(2)) for g in groups
                if g.epoch == 1] == [[2, 3]] * 2
        assert len(groups) == 4 and all(g.rewards == [1.0, 1.0] for g in groups)
        assert all(m.first_version == 4 for g in groups if g.epoch == 1 for m in g.members)
        assert all(m.first_version == 3 for m in groups[0].members)
        doc = json.loads((out / "results.json").read_text())
        assert doc["run"]["executor"] == "ray" and doc["summary"]["finished"] == 8
        assert {names[e["node"]] for e in doc["episodes"]} == {"node-a", "node-b"}
        assert left_behind(root) == []
    finally:
        _stop_cluster(cluster)
        if before is None:
            os.environ.pop("ARES_SANDBOX_LOCAL_ROOT", None)
        else:
            os.environ["ARES_SANDBOX_LOCAL_ROOT"] = before
