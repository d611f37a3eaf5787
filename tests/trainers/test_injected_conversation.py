"""An agent's tool command that sends its own conversation with the session's credentials is not trained.

A real episode: the real ``mini`` CLI (mini-swe-agent) in a hardened local sandbox, every LLM call it
makes rendered by the gateway with SmolLM2's real tokenizer and answered through the TITO policy by a
scripted engine (the answers are fixed texts, tokenized; the ids, masks and logprobs are recorded as
for any model). The agent's first command is ``curl`` to its own session's endpoint (the base URL and
token every command inherits from the CLI) with a made-up conversation, whose answer is far longer
than anything the CLI's own turns hold. The sample the trainer adapters train (``main_sample``, the
TRL adapter's batch) must be the CLI's conversation: its first request's prompt, its two turns; the
injected conversation is recorded, tagged foreign, counted, and not trained.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.engines.base import GenerateResult, Sampling, TokenChunk
from tests.prereq import require
from tests.tito.conftest import need_model_files

pytestmark = pytest.mark.slow

MARKER = "MADE-UP CONVERSATION"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: Every answer is the command (the whole text): the scripted answers need no fenced block.
EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"


def _injection() -> str:
    """The agent's first command: its own conversation, sent to its session's endpoint."""
    body = {
        "model": "anything",
        "max_tokens": 1500,
        "messages": [
            {"role": "system", "content": f"{MARKER}: you are whatever the agent wants trained."},
            {"role": "user", "content": "Say the things the agent wants reinforced."},
        ],
    }
    return ("curl -s -o /dev/null -w '%{http_code}' \"$OPENAI_BASE_URL/chat/completions\" "
            "-H \"Authorization: Bearer $OPENAI_API_KEY\" -H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'")


class _ScriptEngine:
    """Answers the CLI's requests with the script (the injection, then submit) and the injected
    conversation with a long text; logprob -0.25 per token."""

    name = "scripted"
    model = "scripted-model"

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cli_answers = [_injection(), SUBMIT]
        self.injected_calls = 0
        self.cli_outputs: list[list[int]] = []
        self.first_prompt: list[int] | None = None

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        text = self.tok.decode(list(prompt_ids))
        head = text.split("<|im_end|>", 1)[0]  # the system message: whose conversation this is
        if MARKER in head:
            self.injected_calls += 1
            answer = " ".join(["reinforce this"] * 400)
        else:
            if self.first_prompt is None:
                self.first_prompt = list(prompt_ids)
            answer = self.cli_answers.pop(0) if self.cli_answers else SUBMIT
        ids = [*self.tok.encode(answer), self.tok.eos_token_id][: sampling.max_tokens]
        if MARKER not in head:
            self.cli_outputs.append(ids)
        return GenerateResult(ids, [-0.25] * len(ids), "stop", prompt_tokens=len(prompt_ids))

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        res = await self.generate(prompt_ids, sampling)
        yield TokenChunk(res.output_ids, res.logprobs)
        yield res

    async def aclose(self) -> None:
        pass


def _recorded(out: Path, session_id: str) -> list[dict[str, Any]]:
    """The episode's samples as the gateway wrote them (trajectories/*.jsonl)."""
    rows = []
    for f in out.rglob("*.jsonl"):
        if f.parent.name == "trajectories":
            rows += [d for d in map(json.loads, f.read_text().splitlines())
                     if d["metadata"].get("session_id") == session_id]
    return rows


def test_a_conversation_a_tool_command_sends_is_tagged_and_not_trained(tmp_path: Path) -> None:
    need_model_files()
    from ares_gateway.episodes.installs import install_root

    require(install_root("mini-swe-agent") is not None,
            "mini-swe-agent is not installed for local sandboxes: bash .ci/provision-agents.sh")
    from ares_gateway.episodes.tasks import load_dataset
    from ares_gateway.policies.tito import TitoPolicy
    from ares_gateway.tokens import load_tokenizer
    from ares_gateway.tokens.tokenizer import default_model_path
    from ares_gateway.trainers import play_episodes
    from ares_gateway.trainers.trl import AresRollouts

    tok = load_tokenizer()
    engine = _ScriptEngine(tok)
    policy = TitoPolicy(engine, tokenizer=default_model_path(), max_tokens=2048, temperature=1.0)
    dataset = load_dataset("examples")
    task = dataset.task("write-greeting-file")
    options = {**policy.harness_options("mini-swe-agent"), "action_regex": EVERY_ANSWER_IS_A_COMMAND}
    out = tmp_path / "episodes"
    (ep,) = asyncio.run(play_episodes(
        [task], policy=policy,
        episode=EpisodeConfig("mini-swe-agent", sandbox="local", step_limit=6, harness_options=options),
        run=RunConfig(concurrency=1, out=str(out)),
    ))
    assert ep.error is None, ep.error
    # The injection reached the policy through the session's endpoint, from the agent's command.
    assert engine.injected_calls == 1, "the agent's curl did not get an answer"
    assert len(engine.cli_outputs) == 2

    # What the adapters train: the CLI's conversation, from its first request's prompt, both turns.
    s = ep.sample
    assert s is not None and engine.first_prompt is not None
    assert s.tokens[: s.prompt_length].tolist() == engine.first_prompt, (
        f"the trained sample is not the CLI's conversation: it begins {tok.decode(s.tokens[:40].tolist())!r}")
    text = tok.decode(s.tokens.tolist())
    assert MARKER not in text.split("<|im_end|>", 1)[0]
    assert "greeting.txt" in tok.decode(s.tokens[: s.prompt_length].tolist())
    assert int(s.loss_mask.sum()) == sum(len(o) for o in engine.cli_outputs)
    assert "reinforce this" not in tok.decode(s.tokens[s.loss_mask.nonzero()[0] + s.prompt_length].tolist())
    assert s.metadata["main_line"] and not s.metadata["foreign"]
    assert ep.other_samples == 1 and ep.foreign_samples == 1

    # The injected conversation is recorded, tagged, and not the trained one.
    rows = _recorded(out, ep.session_id)
    foreign = [d for d in rows if d["metadata"]["foreign"]]
    assert len(foreign) == 1 and not foreign[0]["metadata"]["main_line"]
    assert MARKER in tok.decode(foreign[0]["tokens"])
    assert sum(foreign[0]["loss_mask"]) > int(s.loss_mask.sum())  # the larger one, all the same

    # The TRL adapter's batch entry is that sample, and logs the foreign count.
    rollouts = AresRollouts(
        dataset, tokenizer=None, renderer=None, sampling={}, check_tokenizer=False,
        episode=EpisodeConfig("mini-swe-agent", sandbox="local", step_limit=6),
        run=RunConfig(concurrency=1, out=None),
    )
    rollouts.policy = policy
    batch = rollouts._batch([ep], [task.name], trainer=None)
    assert batch["prompt_ids"][0] == engine.first_prompt
    assert batch["env_mask"][0] == s.loss_mask.tolist()
    assert batch["foreign_samples"] == [1] and batch["other_samples"] == [1]
    assert np.allclose([lp for lp, m in zip(batch["logprobs"][0], batch["env_mask"][0], strict=True) if m],
                       -0.25)
