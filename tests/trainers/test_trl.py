"""TRL's real GRPOTrainer trains SmolLM2 on real mini-swe-agent episodes in local sandboxes.

Every completion TRL trains on is one episode: the real ``mini`` CLI in a hardened local sandbox, its
LLM calls rendered by the gateway and sampled from ``trainer.model`` itself, its reward the task's
tests'. The 135M model solves no task, so every verifier reward is 0 and GRPO's advantages would all
be 0 (a step that changes nothing); a second reward function (the completion's mean sampled logprob,
different for every episode) gives the groups a spread, so the steps really update the weights.

mini-swe-agent runs with an action regex that takes the whole answer as its command
(``\\A(.+)\\Z``): the model's text runs in the sandbox and its real output comes back, so each
episode's sample holds several turns with tool output between them (with mini's own regex a small
model's answers rarely parse, and mini drops those from its history).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.executor import LocalExecutor
from ares_gateway.episodes.tasks import Dataset as TaskDataset
from ares_gateway.episodes.tasks import DatasetError
from ares_gateway.gateway import GatewayConfig
from ares_gateway.trainers import TrainerError, UnknownTaskError
from harnesses import registry
from tests.helpers import BrokenInstallHarness
from tests.prereq import require
from tests.trainers.conftest import load_smollm2, require_mini_install

#: Answers shorter than the gateway's ``fork_threshold_tokens`` may be replaced in place (REPLACE link).
REPLACE_THRESHOLD = GatewayConfig().fork_threshold_tokens

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("quiet_trl")]

EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"
TASKS = ["fix-median-bug", "write-greeting-file"]


def _trl() -> Any:
    try:
        import trl
    except Exception as exc:
        require(False, f"trl is not installed ({exc}): python3 -m pip install -e '.[trl]'")
    return trl


def recompute(trainer: Any, batch: dict[str, list[Any]]) -> list[list[float]]:
    """The trainer's own recomputation of each completion's logprobs, on the weights that sampled it."""
    import torch

    out = []
    for p_ids, c_ids in zip(batch["prompt_ids"], batch["completion_ids"], strict=True):
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            lp = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, torch.ones_like(ids), len(c_ids), batch_size=1)[0]
        out.append(lp[0].tolist())
    return out


def check_completion(batch: dict[str, list[Any]], i: int, recomputed: list[float],
                     turns: list[dict[str, Any]]) -> None:
    """Entry ``i`` of a rollout batch against the trainer's recomputation and the episode's recorded turns."""
    mask, lps = batch["env_mask"][i], batch["logprobs"][i]
    assert len(mask) == len(lps) == len(recomputed) == len(batch["completion_ids"][i])
    # The sampler's logprobs are the trainer's own on the sampled tokens (temperature 1.0).
    sampled = [k for k, m in enumerate(mask) if m]
    assert sampled and max(abs(lps[k] - recomputed[k]) for k in sampled) < 1e-3
    assert all(lps[k] == 0.0 for k, m in enumerate(mask) if not m)
    # env_mask is 1 exactly on the ids the engine sampled, turn by turn; 0 on everything between
    # them: the agent's tool output and the next turns' headers.
    assert len(turns) >= 2
    start = len(batch["prompt_ids"][i])
    full = batch["prompt_ids"][i] + batch["completion_ids"][i]
    expected = [0] * len(mask)
    for k, t in enumerate(turns):
        tok = t["completion"]["tokens"]
        at = len(tok["prompt_ids"])
        got = full[:at + len(tok["output_ids"])]
        want = tok["prompt_ids"] + tok["output_ids"]
        nxt = turns[k + 1]["completion"]["tokens"]["prompt_ids"] if k + 1 < len(turns) else None
        if got != want and nxt is not None and nxt[:len(want)] != want and batch["other_samples"][i] >= 1:
            # The agent rewrote its history after this turn (mini-swe-agent drops an empty answer,
            # the model's EOS at once, and sends only its format-error message): the next prompt does
            # not continue this turn, so it is another sample of the episode, not in the main one.
            continue
        if (got != want and nxt is not None and full[:len(nxt)] == nxt and nxt[:at] == want[:at]
                and len(tok["output_ids"]) < REPLACE_THRESHOLD):
            # The next prompt drifts only inside this turn's short answer (the model sampled a special
            # token the answer's text drops, e.g. SmolLM2's ``<filename>``): the sample carries the next
            # prompt's tokens in its place and this answer is not trained (mask 0).
            continue
        if got != want:  # say where, and what the turn was, so a rare failure can be read from CI's log
            d = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                     min(len(got), len(want)))
            raise AssertionError(
                f"turn {k} of {len(turns)} ({t.get('request_id')}, side call {t.get('side_call')}) is not "
                "the sample's "
                f"prefix: first difference at id {d} of {len(want)} (prompt {at}); sample "
                f"{got[max(0, d - 8):d + 8]}, turn {want[max(0, d - 8):d + 8]}; tito "
                f"{t['completion'].get('extra', {}).get('tito')}; the sample's length {len(full)}, the "
                f"turns' prompt lengths {[len(x['completion']['tokens']['prompt_ids']) for x in turns]}")
        for k in range(at, at + len(tok["output_ids"])):
            expected[k - start] = 1
    assert mask == expected


def _trainer(model: Any, tokenizer: Any, rollouts: Any, tmp_path: Path, *, steps: int,
             reward_funcs: Sequence[Any] | None = None) -> Any:
    from datasets import Dataset

    trl = _trl()
    from ares_gateway.trainers.trl import reward_from_episode

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, num_generations=2,
        # fp32: the sampler's and the trainer's logprobs agree to ~1e-5
        max_steps=steps, use_cpu=True, bf16=False, learning_rate=3e-4, logging_steps=1, report_to=[],
        save_strategy="no", beta=0.0, seed=7, gradient_accumulation_steps=1,
    )
    return trl.GRPOTrainer(model=model, processing_class=tokenizer,
                           reward_funcs=list(reward_funcs or [reward_from_episode]),
                           train_dataset=Dataset.from_dict({"prompt": TASKS}), args=args,
                           rollout_func=rollouts)


def _spread(completions: list[Any], mean_logprob: list[float], **_: Any) -> list[float]:
    """Each completion's mean sampled logprob (see the module docstring: a spread within groups)."""
    return [float(x) for x in mean_logprob]


def _turns(out: Path, session_id: str) -> list[dict[str, Any]]:
    """The recorded turns (with their token records) of the episode whose session is ``session_id``."""
    for results in out.rglob("results.json"):
        for e in json.loads(results.read_text())["episodes"]:
            if e["session_id"] == session_id:
                path = results.parent / "turns" / f"{e['task']}.{e['attempt']}.jsonl"
                return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    raise AssertionError(f"no recorded episode has session {session_id}")


def test_grpo_trains_two_steps_on_real_agent_episodes(tmp_path: Path) -> None:
    import torch

    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    _trl()
    require_mini_install()
    model, tokenizer = load_smollm2()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = tmp_path / "episodes"
    rollouts = rollout_func(
        "examples", max_tokens=64,
        episode=EpisodeConfig(
            "mini-swe-agent", step_limit=3, harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND},
            sandbox="local",
        ),
        run=RunConfig(concurrency=2, out=str(out)),
    )
    probe = tokenizer.encode(
        "<|im_start|>user\nls -la<|im_end|>\n<|im_start|>assistant\n```bash\nls -la\n```",
        add_special_tokens=False)
    seen: list[dict[str, Any]] = []

    def probe_logprob(m: Any) -> float:
        with torch.no_grad():
            logits = m(input_ids=torch.tensor([probe])).logits[0]
        return float(
            torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(probe[1:])[:, None]).sum())

    def observed(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        probe_lp = probe_logprob(trainer.model)
        batch = rollouts(prompts, trainer)
        seen.append(
            {"prompts": list(prompts), "batch": copy.deepcopy(batch), "recomputed": recompute(trainer, batch),
             "probe": probe_lp, "step": trainer.state.global_step})
        return batch

    trainer = _trainer(model, tokenizer, observed, tmp_path, steps=2,
                       reward_funcs=[reward_from_episode, _spread])
    try:
        trainer.train()
    finally:
        rollouts.close()
    assert trainer.state.global_step == 2 and [s["step"] for s in seen] == [0, 1]

    for call in seen:
        batch = call["batch"]
        assert len(call["prompts"]) == 2 and call["prompts"][0] == call["prompts"][1] in TASKS  # a group of 2
        for i in range(2):
            # A real episode: its own session, the agent ran to its step limit, the verifier judged it.
            assert batch["session_id"][i] and batch["task"][i] == call["prompts"][i]
            assert batch["exit_reason"][i] == "step_limit", batch["error"][i]
            assert batch["reward"][i] == 0.0 and batch["error"][i] is None
            turns = _turns(out, batch["session_id"][i])
            check_completion(batch, i, call["recomputed"][i], turns)
            mask, start = batch["env_mask"][i], len(batch["prompt_ids"][i])
            full = batch["prompt_ids"][i] + batch["completion_ids"][i]
            between = tokenizer.decode([full[start + k] for k, m in enumerate(mask) if not m])
            assert "returncode" in between or "<output>" in between or "output" in between.lower()
    # The logged extras (TRL keeps the latest generation batch's) name each completion's episode and reward.
    logged = trainer._logs["extra"]
    assert list(logged["session_id"]) == seen[-1]["batch"]["session_id"]
    assert list(logged["exit_reason"]) == ["step_limit", "step_limit"]
    assert list(trainer._logs["rewards"]["reward_from_episode"]) == seen[-1]["batch"]["reward"]
    assert len({s for c in seen for s in c["batch"]["session_id"]}) == 4  # four episodes, four sessions
    # Step 1 changed the weights, and step 2's episodes were sampled from the changed weights (their
    # logprobs matched the trainer's recomputation on them, above; a fixed probe's logprob moved).
    changed = sum(float((p.detach() - initial[n]).abs().sum()) for n, p in model.named_parameters())
    assert changed > 0
    assert abs(seen[1]["probe"] - seen[0]["probe"]) > 1e-4
    assert rollouts.calls[1]["generation_s"] > 0 and len(rollouts.calls) == 2


def test_a_failed_install_and_an_engine_failure_are_reward_0_episodes_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ares_gateway.engines.transformers import TransformersEngine
    from ares_gateway.trainers.trl import rollout_func

    _trl()
    require_mini_install()
    model, tokenizer = load_smollm2()
    # An agent that cannot be installed: each episode ends before any LLM call.
    registry.register("broken-install", BrokenInstallHarness, replace=True)
    try:
        broken = rollout_func(
            "examples", max_tokens=8,
            episode=EpisodeConfig(
                "broken-install", step_limit=2, harness_options={"install_root": str(tmp_path / "agents")},
                sandbox="local",
            ),
        )
        trainer = _trainer(model, tokenizer, broken, tmp_path, steps=1)
        batch = broken(["write-greeting-file", "write-greeting-file"], trainer)
        broken.close()
    finally:
        registry.unregister("broken-install")
    # install_error on every try and batch["reward"] == [0.0, 0.0]
    assert batch["exit_reason"] == ["infra_error", "infra_error"]
    assert all("registry says no" in e for e in batch["error"])
    assert batch["env_mask"] == [[0], [0]] and all(len(c) == 1 for c in batch["completion_ids"])

    # The engine fails on the second call of the step (as an out-of-memory would): that request is an
    # error answer to its agent, the episode still ends and is scored, and the training step completes.
    calls = {"n": 0}
    real = TransformersEngine._generate_sync

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransformersEngine, "_generate_sync", failing)
    # With completions capped at 40 tokens (what TRL trains on, whole, otherwise).
    rollouts = rollout_func(
        "examples", max_tokens=24, max_completion_tokens=40,
        episode=EpisodeConfig(
            "mini-swe-agent", step_limit=3, harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND},
            sandbox="local",
        ),
        run=RunConfig(concurrency=1),
    )
    batches: list[dict[str, list[Any]]] = []
    real_batch = rollouts._batch
    monkeypatch.setattr(rollouts, "_batch", lambda *a: batches.append(real_batch(*a)) or batches[-1])
    trainer = _trainer(model, tokenizer, rollouts, tmp_path, steps=1)
    try:
        trainer.train()
    finally:
        rollouts.close()
    assert trainer.state.global_step == 1
    eps = rollouts.last_episodes
    assert len(eps) == 2 and calls["n"] >= 3
    hit = [e for e in eps if e.error and "policy failed" in e.error]
    assert len(hit) == 1 and "out of memory" in hit[0].error and hit[0].reward == 0.0
    (batch,) = batches
    for i, e in enumerate(eps):
        full = e.sample.response_length if e.sample is not None else 1
        assert batch["truncated"][i] == (full > 40)
        assert len(batch["completion_ids"][i]) == len(batch["env_mask"][i]) == len(
            batch["logprobs"][i]) == min(full, 40)
    assert any(batch["truncated"])  # tool output makes a 3-turn episode longer than 40 tokens


def test_bad_prompts_and_datasets_are_clear_errors(tmp_path: Path) -> None:
    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    _trl()
    model, tokenizer = load_smollm2()
    rollouts = rollout_func("examples")
    trainer = _trainer(model, tokenizer, rollouts, tmp_path, steps=1)
    with pytest.raises(UnknownTaskError) as info:
        rollouts(["fix-median-bug", "no-such-task"], trainer)
    assert "'no-such-task'" in str(info.value)
    assert all(name in str(info.value) for name in TASKS)  # it lists the dataset's tasks
    # Chat-message prompts name their task by their last content.
    from ares_gateway.trainers import task_name_of

    assert task_name_of([{"role": "user", "content": " fix-median-bug "}]) == "fix-median-bug"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no tasks in"):
        rollout_func(str(empty))  # a folder without task folders
    with pytest.raises(TrainerError, match="has no tasks"):
        rollout_func(TaskDataset("empty", empty, ()))
    with pytest.raises(TrainerError, match="rollout's 'reward' column"):
        reward_from_episode(["x"])
    with pytest.raises(ValueError, match="concurrency"):
        rollout_func("examples", run=RunConfig(concurrency=0))
    with pytest.raises(ValueError, match="warm must be a whole number"):
        rollout_func("examples", run=RunConfig(warm=-1))
    with pytest.raises(ValueError, match=r"pass warm= to it \(RayExecutor"):
        rollout_func("examples", run=RunConfig(warm=2, executor=LocalExecutor()))
    rollouts.close()


def test_without_trl_installed_the_error_names_the_extra() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from ares_gateway.trainers.trl import rollout_func\n"
            "from ares_gateway.trainers import MissingExtraError\n"
            "try:\n    rollout_func('examples')\nexcept MissingExtraError as e:\n    print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert "ERR torch is not installed" in proc.stdout and "ares-gateway[trl]" in proc.stdout


def test_the_example_trains_a_step(tmp_path: Path) -> None:
    """examples/train_trl.py runs as docs/training.md says, here cut to one short step."""
    _trl()
    require_mini_install()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "train_trl.py"), "--steps", "1", "--step-limit", "2",
         "--max-tokens", "16", "--tasks", "write-greeting-file", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 0: 2 episodes in" in proc.stdout and "0 failed" in proc.stdout, proc.stdout
    assert len(list((tmp_path / "run" / "episodes").rglob("results.json"))) == 1
