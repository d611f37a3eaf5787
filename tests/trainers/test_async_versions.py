"""Weights that change while real agents run: every sampled token keeps the logprob and the version of
the weights that sampled it.

The transformers engine samples SmolLM2-135M-Instruct's real weights for two real mini-swe-agent
episodes in local sandboxes (text-action mode, every answer run as a command), while the test changes
the weights three times through the gateway's fence (drain, abort, drain), each time while a generation
is in flight, and labels each set of weights on the engine (``set_weight_version``). The gateway is
never given a version, so every version recorded is the engine's own report. Afterwards each sample's
trained tokens are scored again by the model loaded with each version's saved weights: the recorded
logprob matches the stamped version's weights (to 1e-3, at the sampling temperature) and no other's.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.engines import Sampling
from tests.helpers import eventually
from tests.rollouts.e2e import require_mini

pytestmark = pytest.mark.slow

TASKS = ["fix-median-bug", "write-greeting-file"]
STEPS = 5
TEMPERATURE = 0.8
EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"
FENCES = ("drain", "abort", "drain")
TOL = 1e-3


def _perturb(model: Any, version: int) -> None:
    """A stand-in for an optimizer step: noise (2 % of each weight's spread) on every MLP output
    projection."""
    import torch

    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.down_proj.weight
            w.add_(torch.randn(w.shape, generator=gen) * 0.02 * w.std())


def _snapshot(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _scores(model: Any, tokens: list[int], start: int) -> list[float]:
    """``log p(tokens[k] | tokens[:k])`` at the sampling temperature for every ``k >= start`` (NaN before), in
    one forward pass over the whole sequence; logits only where needed (the vocabulary is 49,152 wide)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine: on 2 shared cores, 2 threads wait on each other
    try:
        with torch.inference_mode():
            # Row j of the logits kept is position start - 1 + j, which predicts tokens[start + j].
            logits = model(input_ids=torch.tensor([tokens]), logits_to_keep=len(tokens) - start + 1).logits[0]
            logits = logits[:-1].double() / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[start:])[:, None])[:, 0]
    finally:
        torch.set_num_threads(threads)
    return [math.nan] * start + lp.tolist()


async def test_weight_updates_mid_episode_keep_every_token_faithful_to_its_version(
    smollm2: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_mini("local")
    model, _tok = smollm2
    weights = {0: _snapshot(model)}
    try:
        await _run_and_check(model, weights, tmp_path, monkeypatch)
    finally:
        model.load_state_dict(weights[0])  # the module's model, as the other tests find it


async def _run_and_check(model: Any, weights: dict[int, Any], tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ares_gateway import Gateway
    from ares_gateway.engines.transformers import TransformersEngine
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.episodes.tasks import load_dataset
    from ares_gateway.policies.tito import TitoPolicy
    from ares_gateway.tokens.tokenizer import default_model_path

    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    t0 = time.monotonic()
    engine = TransformersEngine(model, weight_version=0, threads=1)  # 1: steadier on 2 shared cores
    running: list[int] = []  # generations on the engine's worker now (at most one: it is serialized)
    generate_sync = engine._generate_sync

    def tracked(*args: Any) -> Any:
        running.append(1)
        try:
            return generate_sync(*args)
        finally:
            running.pop()

    engine._generate_sync = tracked  # type: ignore[method-assign]
    policy = TitoPolicy(engine, tokenizer=default_model_path(), temperature=TEMPERATURE, max_tokens=16)
    reports: list[Any] = []
    out = tmp_path / "run"
    tasks = [t for t in load_dataset("examples").tasks if t.name in TASKS]
    async with Gateway(port=0) as gw:

        async def update_weights() -> None:
            for version, mode in enumerate(FENCES, start=1):
                calls = engine.calls
                # A turn of the current version is done, and the next one is being sampled: the fence
                # meets it (drain: it finishes with the old weights; abort: it stops, and is sampled again).
                await eventually(lambda calls=calls: engine.calls > calls and bool(running),  # type: ignore[misc]
                             f"a turn before fence {version}", timeout=120.0, every=0.02)
                await asyncio.sleep(0.2)  # some tokens into it
                async with gw.weight_update(mode=mode, timeout=300) as report:
                    # Nothing in flight, and nothing on the engine's worker (an aborted generation is off
                    # the model before the pause returns): the weights change under no forward pass.
                    assert gw.fence.in_flight() == 0 and not running
                    _perturb(model, version)
                    engine.set_weight_version(version)
                    weights[version] = _snapshot(model)
                reports.append(report)

        updating = asyncio.create_task(update_weights())
        try:
            summary = await run_rollouts(
                tasks, policy=policy, gateway=gw,
                episode=EpisodeConfig(
                    "mini-swe-agent", sandbox="local", step_limit=STEPS, time_limit=240,
                    harness_options={"action_format": "text", "action_regex": EVERY_ANSWER_IS_A_COMMAND,
                                 "command_timeout": 10},
                ),
                run=RunConfig(concurrency=2, out=out, stats="null"),
            )
            await asyncio.wait_for(updating, 5)
        finally:
            updating.cancel()
            await policy.aclose()
        metrics = gw.metrics
        assert gw.policy_version is None  # never set: every version below is the engine's
    rollout_s = time.monotonic() - t0

    # The fences met generations in flight: a drain let one finish, an abort cancelled one.
    assert [r.mode for r in reports] == list(FENCES)
    assert all(r.in_flight >= 1 for r in reports)
    assert all(r.aborted >= 1 for r in reports if r.mode == "abort")

    # Nothing lost: every request the agents sent was answered once and recorded; mini made its
    # STEPS calls and got an answer to each (its own trajectory says so).
    assert [e.exit_reason for e in summary.episodes] == ["step_limit"] * len(TASKS), summary.episodes
    turns = {e.task: [json.loads(x)
                      for x in (out / "turns" / f"{e.task}.{e.attempt}.jsonl").read_text().splitlines()]
             for e in summary.episodes}
    samples = {
        e.task: [json.loads(x) for x in (out / "trajectories" / f"{e.task}.{e.attempt}.jsonl").read_text()
                 .splitlines()] for e in summary.episodes}
    assert all(len(t) == STEPS for t in turns.values())
    assert metrics.parked_total == metrics.answered_total == STEPS * len(TASKS)
    assert metrics.timed_out_total == metrics.withdrawn_total == 0
    trajectories = sorted(out.rglob("trajectory.json"))
    assert len(trajectories) == len(TASKS)
    for path in trajectories:
        messages = json.loads(path.read_text())["messages"]
        assert sum(m.get("role") == "assistant" for m in messages) == STEPS, path
    # The aborted generations ran on the engine too (each cut short), and only their re-sampled answers
    # were recorded.
    assert engine.calls >= STEPS * len(TASKS) + FENCES.count("abort")

    # Every turn carries the engine's version, never going back within an episode, and every version was used.
    for ts in turns.values():
        versions = [t["policy_version"] for t in ts]
        assert all(isinstance(v, int) for v in versions) and versions == sorted(versions), versions
    assert {t["policy_version"] for ts in turns.values() for t in ts} == set(weights)

    # Every trained token's logprob is the stamped version's (a forward pass on its saved weights): the
    # turn saw exactly the weights it is stamped with. That the check can fail: on each version's tokens
    # the neighbouring versions' weights (just before or after a fence) give other logprobs (a span of
    # near-certain tokens may not tell them apart; each version's spans together do).
    span_tokens: Counter[int] = Counter()
    told_apart: set[tuple[int, int]] = set()
    mixed = 0
    checked = 0
    all_samples = [(task, s) for task, ss in samples.items() for s in ss]
    # Scored under the versions it holds and their neighbours (the weights just before or after a fence).
    t1 = time.monotonic()
    scored: dict[tuple[int, int], list[float]] = {}
    for version, state in weights.items():
        model.load_state_dict(state)
        for i, (_, s) in enumerate(all_samples):
            if any(abs(v - version) <= 1 for _, _, v in s["metadata"]["policy_versions"]):
                scored[i, version] = _scores(model, s["tokens"], len(s["tokens"]) - s["response_length"])
    for i, (_, s) in enumerate(all_samples):
        n = len(s["tokens"]) - s["response_length"]
        spans = s["metadata"]["policy_versions"]
        mixed += bool(s["metadata"]["mixed_versions"])
        assert s["metadata"]["mixed_versions"] == (len({v for _, _, v in spans}) > 1)
        for start, end, version in spans:
            trained = [k for k in range(start, end) if s["loss_mask"][k - n] == 1]
            assert trained, (start, end)
            span_tokens[version] += len(trained)
            for other in (u for u in weights if abs(u - version) <= 1):
                err = max(abs(scored[i, other][k] - s["logprobs"][k - n]) for k in trained)
                if other == version:
                    assert err < TOL, (i, start, end, version, err)
                elif err > TOL:
                    told_apart.add((version, other))
            checked += len(trained)
    assert told_apart == {(v, u) for v in span_tokens for u in weights if abs(u - v) == 1}
    assert mixed >= 1  # an episode went on across an update: one sample trains tokens of two versions
    # The samples' spans hold exactly the turns' tokens, version by version.
    by_turn: Counter[int] = Counter()
    for task, s in all_samples:
        for tid in s["metadata"]["trained_turn_ids"]:
            t = turns[task][tid - 1]  # turn ids count an episode's turns from 1, in answer order
            by_turn[t["policy_version"]] += len(t["completion"]["tokens"]["output_ids"])
    assert by_turn == span_tokens and checked == sum(span_tokens.values())
    print(f"\nrollouts {rollout_s:.1f} s, scoring {time.monotonic() - t1:.1f} s ({len(scored)} passes over "
          f"{len(all_samples)} samples), {checked} trained tokens checked against {len(weights)} versions; "
          f"fences {[(r.mode, round(r.drain_seconds, 3), r.aborted) for r in reports]}; engine calls "
          f"{engine.calls}")


async def test_the_engine_reports_its_label_only_for_the_weights_it_was_set_on(
    smollm2: tuple[Any, Any]) -> None:
    import torch

    from ares_gateway.engines.transformers import TransformersEngine

    model, tok = smollm2
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    engine = TransformersEngine(model, weight_version=3)
    head = model.model.layers[0].mlp.down_proj.weight
    saved = head.detach().clone()
    try:
        assert (await engine.generate(prompt, Sampling(max_tokens=2, seed=0))).weight_version == 3
        with torch.no_grad():
            head.mul_(1.01)  # modified after the label: an unlabelled optimizer step
        assert engine.weight_version is None
        assert (await engine.generate(prompt, Sampling(max_tokens=2, seed=0))).weight_version is None
        engine.set_weight_version(4)
        assert (await engine.generate(prompt, Sampling(max_tokens=2, seed=0))).weight_version == 4
        engine.reset()  # a reset says the weights changed unseen: the label lapses
        assert (await engine.generate(prompt, Sampling(max_tokens=2, seed=0))).weight_version is None
        for bad in (-1, 1.5, True, "7"):
            with pytest.raises(ValueError, match="non-negative integer"):
                engine.set_weight_version(bad)  # type: ignore[arg-type]
        # A cancelled call (an abort fence) returns only once the worker is off the model, which it left
        # at its next token rather than after the 400 asked for.
        assert engine.calls == 4
        task = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=400, seed=1)))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.calls == 5
        # A call cancelled before the worker took it never runs.
        first = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=40, seed=2)))
        queued = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=40, seed=3)))
        await asyncio.sleep(0.2)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert len((await first).output_ids) >= 1
        assert engine.calls == 6
    finally:
        with torch.no_grad():
            head.copy_(saved)
        await engine.aclose()
