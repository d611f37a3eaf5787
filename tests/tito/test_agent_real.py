"""A real agent CLI on the real model: mini-swe-agent (text-action mode, unmodified) in a local sandbox,
every LLM call answered by the tito policy on in-process llama.cpp (SmolLM2-135M), through
``run_rollouts`` (the code ``ares-gateway run --policy tito`` runs).

Skips only when ``llama_cpp`` or the provisioned mini-swe-agent is missing; fails instead under
``ARES_CI=1``. Greedy sampling keeps the agent's path fixed (on this task the model's first answer is
a ```bash block, which mini executes, so the next request extends the stream); its recorded
logprobs are then the model's log-softmax, which a second model instance recomputes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ares_gateway import EpisodeConfig, RunConfig
from tests.rollouts.e2e import require_mini
from tests.tito.conftest import need_llama
from tests.tito.test_llama_real import TOL, Recording

TASK = "make-slug-tests-pass"
STEPS = 3


EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"


@pytest.mark.slow
async def test_mini_swe_agent_on_the_real_model(tmp_path: Path, smol_renderer) -> None:  # type: ignore[no-untyped-def]
    need_llama()
    require_mini("local")
    from ares_gateway.engines.llama_cpp import LlamaCppEngine
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.episodes.selectors import resolve
    from ares_gateway.policies.tito import TitoPolicy

    engine = Recording(LlamaCppEngine(n_ctx=4096))
    policy = TitoPolicy(engine, renderer=smol_renderer, temperature=0.0, max_tokens=96)  # type: ignore[arg-type]
    out = tmp_path / "run"
    tasks = resolve(f"examples-mswea:{TASK}").tasks
    try:
        summary = await run_rollouts(
            tasks, policy=policy, run_info=policy.run_info(),
            episode=EpisodeConfig(
                "mini-swe-agent", sandbox="local", step_limit=STEPS,
                harness_options={"action_format": "text", "action_regex": EVERY_ANSWER_IS_A_COMMAND},
            ),
            run=RunConfig(concurrency=1, out=out, stats="null"),
        )
    finally:
        await policy.aclose()
    [episode] = summary.episodes
    assert episode.exit_reason == "step_limit", episode
    turns = [json.loads(line) for line in (out / "turns" / f"{TASK}.0.jsonl").read_text().splitlines()]
    samples = [json.loads(line)
               for line in (out / "trajectories" / f"{TASK}.0.jsonl").read_text().splitlines()]
    # The agent really ran in text mode: mini's text-based config, no tool schemas sent.
    assert "mswea_bash_command" in turns[0]["request"]["messages"][0]["content"]
    assert all(not t["request"].get("tools") for t in turns)
    assert len(engine.results) == len(turns) == STEPS

    # A turn's prompt starts with the prompt + output ids of the turn it continues, exactly. That is
    # turn k for turn k+1 when mini kept answer k; mini drops an answer without an action from its
    # history (and adds a format-error message), so the next request continues the turn before it,
    # or, when nothing recorded is continued, is a counted fresh render.
    recs = [t["completion"]["extra"]["tito"] for t in turns]
    modes = [r["mode"] for r in recs]
    assert modes[0] == "first" and "extend" in modes, modes
    for k in range(1, STEPS):
        p1 = engine.results[k][0]
        if modes[k] == "extend":
            bases = [p0 + r0.output_ids for p0, r0 in engine.results[:k]]
            base = next(b for b in reversed(bases) if len(b) == recs[k]["extended_tokens"])
            assert p1[: len(base)] == base
            kept = sum(m.get("role") == "assistant" for m in turns[k]["request"]["messages"])
            if kept == k:  # every earlier answer is in the history: turn k+1 continues turn k
                assert base == bases[-1]
        else:
            assert modes[k] == "fresh" and recs[k]["reason"]
    # The agent executed the model's command and got its output back in the extended turn.
    k = modes.index("extend")
    assert "<returncode>" in str(turns[k]["request"]["messages"][-1]["content"])

    # Every loss-1 token of the samples was sampled by the engine, with the engine's logprob, in order.
    samples.sort(key=lambda s: s["metadata"]["trained_turn_ids"][0])
    trained, trained_lp = [], []
    for s in samples:
        n = len(s["tokens"]) - s["response_length"]
        mask = np.array(s["loss_mask"]) == 1
        trained += np.array(s["tokens"][n:])[mask].tolist()
        trained_lp += np.array(s["logprobs"])[mask].tolist()
    assert trained == [t for _, r in engine.results for t in r.output_ids]
    assert np.allclose(trained_lp, [lp for _, r in engine.results for lp in r.logprobs], atol=1e-6)

    # results.json: the run's policy, engine, model, sampling; per episode the fidelity.
    doc = json.loads((out / "results.json").read_text())
    assert doc["run"]["engine"] == "llama-cpp" and doc["run"]["sampling"]["temperature"] == 0.0
    assert doc["run"]["model"].endswith(".gguf")
    fid = doc["episodes"][0]["fidelity"]
    assert fid["turns"] == STEPS and fid["main_line_drift"] == 0 and fid["trained_tokens"] == len(trained)
    assert fid["fresh_renders"] == modes.count("fresh") and fid["samples"] == len(samples)

    # A second, independent evaluation (a fresh model instance, one teacher-forced pass per sample).
    ref_engine = LlamaCppEngine(n_ctx=4096)
    try:
        for s in samples:
            n = len(s["tokens"]) - s["response_length"]
            ref = await ref_engine.score(s["tokens"], n)
            mask = np.array(s["loss_mask"]) == 1
            assert np.max(np.abs(np.array(ref)[mask] - np.array(s["logprobs"])[mask])) <= TOL
    finally:
        await ref_engine.aclose()


def test_mini_swe_agent_text_mode_command_line() -> None:
    import shlex

    from harnesses import HarnessContext, registry
    from harnesses.base import Prepared
    from harnesses.mini_swe_agent import LENIENT_ACTION_REGEX

    ctx = HarnessContext(workdir="/w", session_id="s", base_url="http://127.0.0.1:9/s/s", token="t")
    prep = Prepared(user=None, home="/h", state_dir="/st", time_budget=60.0)
    text = registry.create("mini-swe-agent", action_format="text", action_regex=LENIENT_ACTION_REGEX)
    argv = shlex.split(text.agent_command(ctx, prep, "do it"))
    assert argv[argv.index("--model-class") + 1] == "litellm_textbased"
    assert "mini_textbased.yaml" in argv and f"model.action_regex={LENIENT_ACTION_REGEX}" in argv
    tools = shlex.split(registry.create("mini-swe-agent").agent_command(ctx, prep, "do it"))
    assert "mini.yaml" in tools and "--model-class" not in tools
    with pytest.raises(ValueError, match="action_format"):
        registry.create("mini-swe-agent", action_format="json")
    with pytest.raises(ValueError, match="action_regex"):
        registry.create("mini-swe-agent", action_regex="x")
