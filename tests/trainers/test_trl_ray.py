"""TRL's rollout function with a RayExecutor: real GRPO steps whose episodes run on two Ray nodes.

A real 2-node ``ray.cluster_utils.Cluster`` on loopback (tests/conftest.py sets
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so Ray takes 127.0.0.1), a real ``GRPOTrainer`` on SmolLM2 (float32,
CPU), the real ``mini`` CLI in local sandboxes on the nodes. The trainer's engine is served over HTTP
on 127.0.0.1 and each node's gateway actor samples ``trainer.model`` through it: the batch must be the
local path's (real episodes, the trainer's own logprobs, env_mask on exactly the sampled ids), each
episode recorded with the node that ran it, and both nodes used.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from tests.helpers import left_behind
from tests.prereq import require
from tests.trainers.conftest import load_smollm2, require_mini_install
from tests.trainers.test_trl import (
    EVERY_ANSWER_IS_A_COMMAND,
    TASKS,
    _spread,
    _trainer,
    _trl,
    _turns,
    check_completion,
    recompute,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("quiet_trl")


@pytest.fixture
def cluster(sandbox_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    try:
        import ray
        from ray.cluster_utils import Cluster
    except Exception as exc:
        require(False, f"ray is not installed ({exc}): python3 -m pip install -e '.[ray]'")
    # The node's workers import this checkout's code (the one under test), whatever is installed.
    monkeypatch.setenv("PYTHONPATH",
                       os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=c.address)
    try:
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback held
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _imported_from(node_ids: list[str]) -> dict[str, str]:
    """Where each node's workers import ``ares_gateway`` from."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def where() -> str:
        import ares_gateway

        return str(ares_gateway.__file__)

    refs = {n: where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
            for n in node_ids}
    return {n: ray.get(r, timeout=120) for n, r in refs.items()}


@pytest.mark.slow
def test_grpo_step_with_episodes_on_two_ray_nodes(cluster: Any, tmp_path: Path, sandbox_root: Path) -> None:
    import cloudpickle
    import ray

    from ares_gateway.episodes.ray import RayExecutor
    from ares_gateway.trainers._served import RemoteTitoPolicy
    from ares_gateway.trainers.trl import EPISODE_KEYS, VERSION_KEYS, reward_from_episode, rollout_func

    _trl()
    require_mini_install()
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    assert len(nodes) == 2
    where = _imported_from(nodes)
    assert all(Path(f).resolve().is_relative_to(ROOT) for f in where.values()), where  # the code under test

    model, tokenizer = load_smollm2()
    out = tmp_path / "episodes"
    executor = RayExecutor(per_node=1)
    rollouts = rollout_func(
        "examples", max_tokens=32,
        episode=EpisodeConfig(
            "mini-swe-agent", step_limit=2, harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND},
            sandbox="local",
        ),
        run=RunConfig(concurrency=2, out=str(out), executor=executor),
    )
    seen: list[dict[str, Any]] = []

    def observed(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        batch = rollouts(prompts, trainer)
        recomputed = recompute(trainer, batch)
        served = rollouts.served
        assert served is not None and served.server is not None and served.policy is not None
        seen.append({"prompts": list(prompts), "batch": copy.deepcopy(batch), "recomputed": recomputed,
                     "episodes": list(rollouts.last_episodes), "generations": served.server.generations,
                     "url": served.server.url, "pickled": cloudpickle.dumps(served.policy)})
        return batch

    trainer = _trainer(model, tokenizer, observed, tmp_path, steps=1,
                       reward_funcs=[reward_from_episode, _spread])
    try:
        trainer.train()
    finally:
        rollouts.close()
    assert trainer.state.global_step == 1 and len(seen) == 1
    (call,) = seen
    batch = call["batch"]
    assert len(call["prompts"]) == 2 and call["prompts"][0] == call["prompts"][1] in TASKS
    # The local path's batch: the same columns, one entry per prompt in each.
    assert set(batch) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", *EPISODE_KEYS,
                          *VERSION_KEYS}
    assert all(len(v) == 2 for v in batch.values())
    # The trainer's step (0 at the first call) reached every node's gateway: each turn is stamped with it.
    assert batch["first_version"] == [0, 0] and batch["last_version"] == [0, 0], batch["policy_versions"]

    # Each completion is a real episode, run on a Ray node: both nodes ran one (per_node=1, 2 at once).
    episodes = call["episodes"]
    assert {e.result.node for e in episodes} == set(nodes)
    turns_total = 0
    for i, e in enumerate(episodes):
        assert batch["session_id"][i] == e.session_id and batch["task"][i] == call["prompts"][i]
        assert batch["exit_reason"][i] == "step_limit", batch["error"][i]
        assert batch["reward"][i] == 0.0 and batch["error"][i] is None
        # Sampled by the trainer's model (through the served engine): its logprobs are the trainer's own.
        turns = _turns(out, e.session_id)
        turns_total += len(turns)
        check_completion(batch, i, call["recomputed"][i], turns)
        tito = turns[-1]["completion"]["extra"]["tito"]
        assert tito["engine"] == "sglang"  # the nodes' engine: the HTTP client
        # the served engine's drawn seed, recorded as locally
        assert isinstance(tito["sampling"]["seed"], int)
    # Every turn of every episode was sampled here, by the served engine (and only those).
    assert call["generations"] == turns_total and rollouts.calls[0]["generation_s"] > 0
    assert call["url"].startswith("http://127.0.0.1:")
    doc = json.loads(next(out.rglob("results.json")).read_text())
    assert doc["run"]["executor"] == "ray" and {x["node"] for x in doc["episodes"]} == set(nodes)

    # What travelled to the nodes: the policy's recipe, not the model (nor torch), a few hundred bytes.
    blob = call["pickled"]
    assert len(blob) < 4096 and b"torch" not in blob and b"Bearer" in blob
    again = cloudpickle.loads(blob)
    assert isinstance(again, RemoteTitoPolicy) and again.engine.url == call["url"]  # type: ignore[attr-defined]
    # Closed: the server is gone, and no sandbox is left on any node.
    assert rollouts.served is not None and rollouts.served.server is None
    assert left_behind(sandbox_root) == []


async def test_the_served_engine_is_one_server_per_engine_and_a_bad_address_is_a_clear_error() -> None:
    from ares_gateway.engines.llama_cpp import LlamaCppEngine
    from ares_gateway.episodes.ray import RayExecutor
    from ares_gateway.tokens.tokenizer import default_model_path
    from ares_gateway.trainers import TrainerError
    from ares_gateway.trainers._served import ServedEngine
    from ares_gateway.trainers.trl import rollout_func

    _trl()
    source = default_model_path()
    sampling = {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None}
    one, two = LlamaCppEngine(), LlamaCppEngine()  # never loaded: serving does not touch the model
    served = ServedEngine()
    taken = ServedEngine(port=0)
    try:
        policy = await served.policy_for(one, tokenizer=source, renderer=None, sampling=sampling)
        assert await served.policy_for(one, tokenizer=source, renderer=None, sampling=sampling) is policy
        first = served.server
        assert first is not None and policy.engine.url == first.url  # type: ignore[attr-defined]
        # A new model object (a new engine): served instead, the old server closed.
        other = await served.policy_for(two, tokenizer=source, renderer=None, sampling=sampling)
        assert other is not policy and served.server is not first and served.server.engine is two  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="not started"):
            _ = first.url
        # The port is taken: a TrainerError that says what to change.
        taken = ServedEngine(port=served.server.port)  # type: ignore[union-attr]
        with pytest.raises(TrainerError,
                           match=r"could not serve the trainer's engine on 127\.0\.0\.1:.*engine_host"):
            await taken.policy_for(one, tokenizer=source, renderer=None, sampling=sampling)
    finally:
        await served.aclose()
        await taken.aclose()
    assert served.server is None and served.policy is None
    with pytest.raises(ValueError, match="engine_port"):
        rollout_func("examples", engine_port=70000, run=RunConfig(executor=RayExecutor()))
    with pytest.raises(ValueError, match="engine_host"):
        rollout_func("examples", engine_host="", run=RunConfig(executor=RayExecutor()))
