"""What the TRL rollout function hands TRL per entry, built from real episodes without a training run.

The episodes are real: the tiny agent (a real process) in real local sandboxes, answered through the
rollouts' own gateway by the oracle policy with token records (so each episode has a main-line sample),
faults injected at the sandbox factory as in ``tests/rollouts/test_infra_retries.py``. The trainer is a
real ``GRPOTrainer`` over SmolLM2 that is never trained: the entries are the rollout function's
``_batch`` of those episodes, the fence its real ``TrainerCallback``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandbox as sandbox_mod
from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.failures import INFRA_ERROR
from ares_gateway.episodes.tasks import load_dataset
from tests.rollouts.test_infra_retries import Faults, _faulty_class
from tests.rollouts.test_stream import TokenOracle
from tests.trainers.conftest import load_smollm2
from tests.trainers.test_trl import _trainer, _trl

pytestmark = pytest.mark.slow

GREETING = {t.name: t for t in load_dataset("examples").tasks}["write-greeting-file"]
CONTRACT = {"prompt_ids", "completion_ids", "logprobs", "env_mask", "reward", "task", "session_id",
            "exit_reason", "turns", "error", "other_samples", "foreign_samples", "sampled_tokens",
            "mean_logprob", "truncated", "policy_versions", "first_version", "last_version", "mixed_versions",
            "staleness"}


@pytest.fixture(scope="module")
def smollm2_trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A real GRPOTrainer (never trained) and the model it holds."""
    _trl()
    model, tokenizer = load_smollm2()
    from ares_gateway.trainers.trl import rollout_func

    holder = rollout_func("examples")  # the trainer's own rollout function (unused: the tests make theirs)
    trainer = _trainer(model, tokenizer, holder, tmp_path_factory.mktemp("trl-entries"), steps=1)
    yield trainer, tokenizer
    holder.close()


@pytest.fixture
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Faults:
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    state = Faults()
    cls = _faulty_class(state)

    def create(spec: Any = None, backend: str = "auto", **options: Any) -> sandbox_mod.BaseSandbox:
        assert backend == "local"
        return cls(spec, **options)

    monkeypatch.setattr(sandbox_mod, "create", create)
    return state


def _rollouts(trainer: Any, **options: Any) -> Any:
    """A rollout function of tiny-agent episodes, its policy built for ``trainer`` and its gateway open
    (``options``: ``rollout_func``'s, and ``retries``)."""
    from ares_gateway.trainers.trl import _Loop, rollout_func

    run = {k: options.pop(k) for k in ("retries",) if k in options}
    rollouts = rollout_func(
        "examples", episode=EpisodeConfig("tiny-agent", sandbox="local", step_limit=20),
        run=RunConfig(concurrency=1, **run), **options,
    )
    rollouts._policy_for(trainer)
    rollouts._loop = _Loop()
    return rollouts


def _play(rollouts: Any, tasks: list[Any], *, gateway_version: int, version: int | None) -> list[Any]:
    rollouts._loop.run(rollouts._open_gateway(gateway_version))
    return list(rollouts._loop.run(rollouts._play(tasks, TokenOracle(), {}, None, version)))


def _advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def test_an_infra_error_entry_is_masked_with_a_neutral_reward(smollm2_trainer: tuple[Any, Any],
                                                              faults: Faults) -> None:
    trainer, tokenizer = smollm2_trainer
    # Attempt 0 runs; every agent sandbox after it fails to start: attempt 1 is infra_error (retries=0).
    faults.ok_starts, faults.fail_starts = 1, 100
    rollouts = _rollouts(trainer, retries=0)
    try:
        episodes = _play(rollouts, [GREETING, GREETING], gateway_version=0, version=0)
        batch = rollouts._batch(episodes, [GREETING.name] * 2, trainer, 0)
    finally:
        rollouts.close()
    assert set(batch) == CONTRACT and all(len(v) == 2 for v in batch.values())
    assert batch["exit_reason"] == ["completed", INFRA_ERROR]
    assert faults.agent_sandboxes == 2
    # The judged episode: its main-line sample, 2 turns of 3 sampled tokens, at version 0.
    assert sum(batch["env_mask"][0]) == batch["sampled_tokens"][0] == 6
    assert len(batch["completion_ids"][0]) == len(batch["env_mask"][0]) == len(batch["logprobs"][0])
    assert batch["staleness"][0] == 0 and batch["first_version"][0] == batch["last_version"][0] == 0
    # The excluded one: the masked one-token stand-in after the task name's ids, nothing sampled...
    eos = tokenizer.eos_token_id
    assert batch["completion_ids"][1] == [eos] and batch["env_mask"][1] == [0] and batch["logprobs"][1] == [
        0.0]
    assert batch["prompt_ids"][1] == tokenizer.encode(GREETING.name, add_special_tokens=False)
    assert batch["sampled_tokens"][1] == 0 and batch["policy_versions"][1] == [] and batch["staleness"][
        1] is None
    assert "sandbox_error" in batch["error"][1]
    # ...and its reward the group's judged mean, not 0: the judged member's advantage is what it would be
    # without the failed one (with reward 0 it would be +0.5, credit for an infrastructure failure).
    assert batch["reward"] == [1.0, 1.0]
    assert _advantages(batch["reward"])[0] == _advantages(batch["reward"][:1])[0] == 0.0
    assert episodes[1].excluded and not episodes[0].excluded


def test_drop_group_on_infra_error_masks_the_whole_group(smollm2_trainer: tuple[Any, Any],
                                                         faults: Faults) -> None:
    trainer, _ = smollm2_trainer
    faults.ok_starts, faults.fail_starts = 1, 100
    rollouts = _rollouts(trainer, retries=0, drop_group_on_infra_error=True)
    try:
        episodes = _play(rollouts, [GREETING, GREETING], gateway_version=0, version=0)
        batch = rollouts._batch(episodes, [GREETING.name] * 2, trainer, 0)
    finally:
        rollouts.close()
    assert batch["exit_reason"] == ["completed", INFRA_ERROR]
    assert all(e.excluded for e in episodes)
    assert batch["env_mask"] == [[0], [0]] and batch["sampled_tokens"] == [0, 0]
    assert batch["reward"] == [0.0, 0.0]  # equal rewards: no advantage from the group


def test_max_staleness_masks_responses_older_than_the_calls_step(smollm2_trainer: tuple[Any, Any],
                                                                 faults: Faults) -> None:
    from ares_gateway.trainers.trl import _await, _Background

    trainer, _ = smollm2_trainer
    rollouts = _rollouts(trainer, max_staleness=0)
    try:
        # Turns stamped 2 by the gateway; the call that takes them is at step 3: bound 0 masks them all.
        (old,) = _play(rollouts, [GREETING], gateway_version=2, version=3)
        (fresh,) = _play(rollouts, [GREETING], gateway_version=2, version=2)
        # Overlap's episodes started ahead are judged at the step of the call that will take them.
        bg = _Background([GREETING], 4)
        bg.task = rollouts._loop.run(rollouts._spawn(bg, TokenOracle(), {}))
        (ahead,) = rollouts._loop.run(_await(bg.task))
        batch = rollouts._batch([old, fresh, ahead], [GREETING.name] * 3, trainer, 3)
    finally:
        rollouts.close()
    assert batch["reward"] == [1.0, 1.0, 1.0]  # masked tokens, the episode's reward as it was
    assert old.stale_tokens == 6 and ahead.stale_tokens == 6 and fresh.stale_tokens == 0
    assert [sum(m) for m in batch["env_mask"]] == batch["sampled_tokens"] == [0, 6, 0]
    assert all(len(m) == len(c) == len(lp) for m, c, lp in
               zip(batch["env_mask"], batch["completion_ids"], batch["logprobs"], strict=True))
    assert all(lp == 0.0 for lp in batch["logprobs"][0])
    # Stale spans leave policy_versions: the entry's versions are those of what it trains.
    assert batch["policy_versions"][0] == [] and batch["first_version"][0] is None
    assert [v for _, _, v in batch["policy_versions"][1]] == [2, 2] and batch["staleness"][1] == 1


def test_max_staleness_is_checked(smollm2_trainer: tuple[Any, Any]) -> None:
    from ares_gateway.episodes.executor import LocalExecutor
    from ares_gateway.trainers.trl import rollout_func

    with pytest.raises(ValueError, match="max_staleness must be a non-negative integer"):
        rollout_func("examples", max_staleness=-1)
    with pytest.raises(ValueError, match="leave executor unset, or max_staleness None"):
        rollout_func("examples", max_staleness=1, run=RunConfig(executor=LocalExecutor()))
    with pytest.raises(ValueError, match="retries must be 0 or more"):
        rollout_func("examples", run=RunConfig(retries=-1))


def test_the_fence_labels_the_engines_weights(smollm2_trainer: tuple[Any, Any], faults: Faults) -> None:
    trainer, _ = smollm2_trainer
    rollouts = _rollouts(trainer, overlap=True)
    try:
        rollouts._loop.run(rollouts._open_gateway(0))
        rollouts._install_fence(trainer)
        fence = rollouts.fence_callback
        assert fence in trainer.callback_handler.callbacks
        assert rollouts.engine.weight_version is None
        trainer.state.global_step = 4
        fence.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)
        fence.on_optimizer_step(trainer.args, trainer.state, trainer.control)
        assert rollouts.fences[-1]["version"] == rollouts.gateway.policy_version == 5
        assert rollouts.engine.weight_version == 5
        # A generation sampled now reports the engine's own label (what the gateway records for the turn).
        from ares_gateway.engines.base import Sampling

        result = rollouts._loop.run(rollouts.engine.generate([1, 2, 3], Sampling(max_tokens=2, seed=0)))
        assert result.weight_version == 5 and len(result.output_ids) >= 1
    finally:
        trainer.callback_handler.remove_callback(rollouts.fence_callback)
        trainer.state.global_step = 0
        rollouts.close()
