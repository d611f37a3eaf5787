"""TRL's real GRPOTrainer with ``rollout_func(overlap=True)``: the next batch's episodes run while the trainer
trains.

SmolLM2 trains on real mini-swe-agent episodes in local sandboxes (as in ``test_trl.py``). With overlap
the episodes of TRL's next call are started as a call returns and run while the trainer does its
forward, backward and optimizer step; a ``TrainerCallback`` fences each optimizer step on the rollouts'
gateway. Recorded here with their own clocks: each engine call's sampling interval (the engine's
``_generate_sync``), each optimizer step (torch's global optimizer hooks) and each rollout call; checked:
no turn was sampled while an optimizer step ran or sampling was paused, every optimizer step ran inside
a pause, episodes were sampled while the trainer trained, and each entry says which weights sampled it.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.trainers import TrainerError
from tests.trainers.conftest import load_smollm2, require_mini_install
from tests.trainers.test_trl import EVERY_ANSWER_IS_A_COMMAND, TASKS, _spread, _trl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("quiet_trl")]

STEPS = 3


def _args(tmp_path: Path, steps: int) -> Any:
    trl = _trl()
    return trl.GRPOConfig(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, num_generations=2,
        max_steps=steps, use_cpu=True, bf16=False, learning_rate=3e-4, logging_steps=1, report_to=[],
        save_strategy="no", beta=0.0, seed=7, gradient_accumulation_steps=1, disable_dropout=True,
        disable_tqdm=True,
    )


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_overlapped_rollouts_run_while_the_trainer_trains_and_never_across_a_weight_update(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from ares_gateway.engines.transformers import TransformersEngine
    from ares_gateway.trainers.trl import VERSION_KEYS, reward_from_episode, rollout_func

    trl = _trl()
    require_mini_install()
    model, tokenizer = load_smollm2()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    # Each engine call's sampling interval, on the engine's worker thread.
    sampled: list[tuple[float, float]] = []
    lock = threading.Lock()
    real = TransformersEngine._generate_sync

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return real(self, *args, **kwargs)
        finally:
            with lock:
                sampled.append((t0, time.monotonic()))

    monkeypatch.setattr(TransformersEngine, "_generate_sync", timed)
    # Each optimizer step, from torch's own hooks.
    steps: list[list[float]] = []
    pre = register_optimizer_step_pre_hook(lambda *_: steps.append([time.monotonic()]))
    post = register_optimizer_step_post_hook(lambda *_: steps[-1].append(time.monotonic()))

    rollouts = rollout_func(
        "examples", max_tokens=24, overlap=True,
        episode=EpisodeConfig(
            "mini-swe-agent", step_limit=2, harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND},
            sandbox="local",
        ),
        run=RunConfig(concurrency=2, out=str(tmp_path / "episodes")),
    )
    calls: list[dict[str, Any]] = []

    def observed(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        t0 = time.monotonic()
        batch = rollouts(prompts, trainer)
        calls.append({"window": (t0, time.monotonic()), "step": trainer.state.global_step,
                      "prompts": list(prompts), "batch": batch})
        return batch

    seen_by_reward: list[dict[str, Any]] = []

    def versions_reward(completions: list[Any], **kw: Any) -> list[float]:
        seen_by_reward.append({k: list(kw[k]) for k in VERSION_KEYS})
        return [0.0] * len(completions)

    trainer = trl.GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[reward_from_episode, _spread, versions_reward],
        train_dataset=Dataset.from_dict({"prompt": TASKS}), args=_args(tmp_path, STEPS),
        rollout_func=observed)
    try:
        trainer.train()
        gw = rollouts.gateway
        assert gw is not None
        pauses = gw.fence.pauses
        assert not gw.fence.paused
    finally:
        pre.remove()
        post.remove()
        rollouts.close()
    assert rollouts.gateway is None and rollouts._next is None  # closed; nothing left running

    # The steps completed and changed the weights.
    assert trainer.state.global_step == STEPS and [c["step"] for c in calls] == list(range(STEPS))
    assert sum(float((p.detach() - initial[n]).abs().sum()) for n, p in model.named_parameters()) > 0

    # Every optimizer step was fenced: one pause per step, each step inside its pause, and no turn sampled
    # while sampling was paused (so none while the weights changed).
    assert len(steps) == STEPS and all(len(s) == 2 for s in steps)
    assert pauses == len(rollouts.fences) == STEPS
    assert [f["version"] for f in rollouts.fences] == list(range(1, STEPS + 1))
    for (s0, s1), f in zip(steps, rollouts.fences, strict=True):
        assert f["paused_at"] <= s0 <= s1 <= f["resumed_at"]
    assert len(sampled) >= 2 * STEPS  # 2 episodes a step, each at least one turn
    for turn in sampled:
        for f in rollouts.fences:
            assert not _overlaps(turn, (f["paused_at"], f["resumed_at"])), (turn, f)
        for s in steps:
            assert not _overlaps(turn, (s[0], s[1])), (turn, s)

    # The next batch's episodes ran while the trainer trained (between one call's return and the next
    # call): turns were sampled then, and the calls after the first took their entries from them.
    training = [(a["window"][1], b["window"][0]) for a, b in itertools.pairwise(calls)]
    training.append((calls[-1]["window"][1], steps[-1][1]))
    during = [t for t in sampled if any(_overlaps(t, w) for w in training)]
    assert during, (sampled, training)
    sampled_while_training = sum(min(t[1], w[1]) - max(t[0], w[0]) for t in sampled for w in training
                                 if _overlaps(t, w))
    assert sampled_while_training > 0.5
    info = rollouts.calls
    assert info[0]["ran_now"] == 2 and info[0]["prefetched"] == 0
    for c in info[1:]:
        assert c["prefetched"] == 2 and c["ran_now"] == 0 and c["discarded"] == 0, info
    assert sum(c["overlap_s"] for c in info[1:]) > 0.5
    # The last call started nothing (no call comes after it).
    assert len({s for c in calls for s in c["batch"]["session_id"]}) == 2 * STEPS

    # Each entry says which weights sampled it: the first call's the initial ones (version 0); a later
    # call's were started before the last optimizer step, so they hold version step - 1, step, or both.
    for c in calls:
        batch, step = c["batch"], c["step"]
        assert batch["task"] == [task for task in c["prompts"]]
        for i in range(2):
            spans = batch["policy_versions"][i]
            assert spans and all(0 <= a < b <= len(batch["completion_ids"][i]) for a, b, _ in spans)
            versions = [v for _, _, v in spans]
            assert set(versions) <= ({0} if step == 0 else {step - 1, step}), (step, spans)
            assert batch["first_version"][i] == versions[0] and batch["last_version"][i] == versions[-1]
            assert batch["mixed_versions"][i] == (len(set(versions)) > 1)
            assert batch["staleness"][i] == step - min(versions)
            # The spans cover exactly the sampled tokens.
            mask = batch["env_mask"][i]
            assert sum(b - a for a, b, _ in spans) == sum(mask)
            assert all(mask[k] == 1 for a, b, _ in spans for k in range(a, b))
    assert max(v for c in calls for v in c["batch"]["last_version"]) >= 1
    assert [max(c["batch"]["last_version"]) for c in calls] == sorted(max(c["batch"]["last_version"])
                                                                      for c in calls)
    # TRL handed the version keys to the reward functions, entry for entry.
    assert [r["first_version"] for r in seen_by_reward] == [c["batch"]["first_version"] for c in calls]
    assert all(isinstance(r["mixed_versions"][0], bool) for r in seen_by_reward)


def test_overlap_refuses_dropout_and_an_executor(tmp_path: Path) -> None:
    from ares_gateway.episodes.executor import LocalExecutor
    from ares_gateway.trainers.trl import rollout_func

    trl = _trl()
    from datasets import Dataset

    with pytest.raises(ValueError, match="overlap runs the episodes in this process"):
        rollout_func("examples", overlap=True, run=RunConfig(executor=LocalExecutor()))
    with pytest.raises(ValueError, match="fence_timeout"):
        rollout_func("examples", overlap=True, fence_timeout=0)
    model, tokenizer = load_smollm2()
    model.config.attention_dropout = 0.1
    rollouts = rollout_func("examples", overlap=True)
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer,
                              reward_funcs=[lambda completions, **_: [0.0]],
                              train_dataset=Dataset.from_dict({"prompt": TASKS}), args=_args(tmp_path, 1),
                              rollout_func=rollouts)
    try:
        with pytest.raises(TrainerError, match="disable_dropout=True"):
            rollouts(["fix-median-bug", "fix-median-bug"], trainer)
    finally:
        rollouts.close()
