"""verl's agent loop: each dataset row one real agent episode, sampled by verl's rollout servers.

Importing this module registers :class:`AresAgentLoop` with verl as ``ares_gateway`` (extra ``.[verl]``).
Rows pick it by their ``agent_name`` column; its options come from verl's agent-loop config file
(``actor_rollout_ref.rollout.agent.agent_loop_config_path``), whose extra keys hydra passes to the
loop's constructor::

    # agent_loops.yaml
    - name: ares_gateway
      _target_: ares_gateway.trainers.verl.AresAgentLoop
      dataset: examples            # the task dataset the rows name (a registered name or a folder)
      harness: mini-swe-agent
      sandbox: docker
      step_limit: 20

**A row** names its task by a ``task`` column, else ``extra_info["task"]``, else its prompt's last
message (``prompt: [{"role": "user", "content": "fix-median-bug"}]``). :meth:`AresAgentLoop.run` plays
one episode of it: the harness CLI in a fresh sandbox, every LLM call it makes rendered by the gateway
with the trainer's own tokenizer (``actor_rollout_ref.model.path``, checked against verl's) and sampled
through ``self.server_manager.generate`` (:class:`~ares_gateway.engines.verl.VerlEngine`, the episode's
session as the sticky request id), rewarded by the task's verifier.

**The output** is the :class:`AgentLoopOutput` of the episode's main-line sample, the harness CLI's own
conversation (:func:`~ares_gateway.trainers.main_sample`; side calls and foreign conversations are never it):
``prompt_ids`` the first turn's prompt (left-cut to
``rollout.prompt_length`` by verl's own rule), ``response_ids`` / ``response_mask`` / ``response_logprobs``
everything after it (the model's answers 1, tool outputs and the next turns' headers 0), cut to
``rollout.response_length`` (verl pads); ``reward_score`` the verifier's reward; ``num_turns`` the
episode's LLM turns; the episode's facts in ``extra_fields`` and, for verl's logs, ``reward_extra_info``.
A failed episode (the agent or its install failed, the sandbox did not start, the servers failed) is a
one-token masked response with reward 0 and its error: the step goes on. A row that names no task is a
:class:`~ares_gateway.trainers.UnknownTaskError` listing the dataset's tasks (a configuration error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ares_gateway.episodes.config import EpisodeConfig, RunConfig
from ares_gateway.trainers.episodes import (
    EpisodeSample,
    TokenizerMismatchError,
    describe_failure,
    play_episodes,
    require,
    resolve_dataset,
    resolve_tasks,
    task_name_of,
    tokenizer_mismatch,
    trainer_entry,
)

require("verl.experimental.agent_loop.agent_loop", "verl")

from verl.experimental.agent_loop.agent_loop import (  # noqa: E402  (after the extra's check)
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from ares_gateway.engines.verl import VerlEngine  # noqa: E402
from ares_gateway.policies.tito import TitoPolicy  # noqa: E402
from ares_gateway.tokens import ChatRenderer  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["EPISODE_INFO_KEYS", "AresAgentLoop"]

#: The episode facts each output carries in ``reward_extra_info`` (verl logs them per sample).
EPISODE_INFO_KEYS = ("exit_reason", "turns", "other_samples", "foreign_samples", "episode_failed")

# One renderer per (tokenizer source, renderer name) and one resolved dataset per name, per worker
# process: verl builds a loop object for every row.
_renderers: dict[tuple[str, str | None], ChatRenderer] = {}
_datasets: dict[str, Any] = {}
_checked: set[tuple[str, int]] = set()
_cache_lock = threading.Lock()


def _renderer(source: str, name: str | None) -> ChatRenderer:
    with _cache_lock:
        r = _renderers.get((source, name))
        if r is None:
            r = _renderers[(source, name)] = ChatRenderer(source, renderer=name)
        return r


def _plain(value: Any) -> Any:
    """A row value as plain Python (verl's batches hold numpy object arrays)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


@register("ares_gateway")
class AresAgentLoop(AgentLoopBase):
    """One real agent episode per row (see the module docstring).

    Args (from the agent-loop config file; verl's own arguments pass through to ``AgentLoopBase``):
        dataset: the task dataset the rows name (a registered name such as ``"examples"`` or a folder).
        harness / sandbox / step_limit / time_limit / harness_options: what each episode runs, the fields
            of :class:`~ares_gateway.episodes.config.EpisodeConfig` (``mini-swe-agent`` in a ``local``
            sandbox, 20 LLM calls by default).
        tokenizer_path: what the gateway renders with (a ``.gguf`` file or Hugging Face folder; default:
            verl's ``actor_rollout_ref.model.path``, the tokenizer verl trains with); checked against
            verl's tokenizer once per worker. (``tokenizer`` is verl's own argument: its tokenizer object.)
        renderer: a ``renderers`` name (default: by model name, else the model's chat template).
        max_tokens: the most tokens one answer may have (default: ``rollout.response_length``).
        out: a folder for each episode's run files (``out/<task>-<id>/``: results.json, trajectories, logs).
    """

    def __init__(
        self,
        *args: Any,
        dataset: Any = "examples",
        harness: str = "mini-swe-agent",
        sandbox: str = "local",
        step_limit: int | None = 20,
        time_limit: float | None = None,
        tokenizer_path: str | None = None,
        renderer: str | None = None,
        max_tokens: int | None = None,
        harness_options: Mapping[str, Any] | None = None,
        out: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        key = str(dataset)
        with _cache_lock:
            if key not in _datasets:
                _datasets[key] = resolve_dataset(dataset)
            self.dataset = _datasets[key]
        # The config file's keys, as the one value every entry point takes.
        self.episode = EpisodeConfig(harness, dict(_plain(harness_options) or {}), sandbox=sandbox,
                                     step_limit=step_limit, time_limit=time_limit)
        self.model_path = str(self.config.actor_rollout_ref.model.path)
        self.tokenizer_source = tokenizer_path or self.model_path
        self.renderer_name = renderer
        self.max_tokens = int(max_tokens or self.rollout_config.response_length)
        self.out = out

    def task_of(self, row: Mapping[str, Any]) -> str:
        """The task name a row carries: ``task``, else ``extra_info["task"]``, else its prompt's last
        message."""
        if row.get("task"):
            return str(_plain(row["task"]))
        extra = _plain(row.get("extra_info"))
        if isinstance(extra, Mapping) and extra.get("task"):
            return str(extra["task"])
        return task_name_of(_plain(row.get("raw_prompt", row.get("prompt", ""))))

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        """Play one episode of the row's task; its main-line sample as verl's output."""
        (task,) = resolve_tasks(self.dataset, [self.task_of(row)])
        renderer = await asyncio.to_thread(_renderer, self.tokenizer_source, self.renderer_name)
        self._check_tokenizer(renderer)
        engine = VerlEngine(self.server_manager, model=self.model_path, sampling_params=sampling_params)
        policy = TitoPolicy(
            engine, renderer=renderer, max_tokens=self.max_tokens,
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=max(0, int(sampling_params.get("top_k", -1) or 0)),
        )
        options = {**policy.harness_options(self.episode.harness), **self.episode.harness_options}
        out = f"{self.out}/{task.name}-{uuid.uuid4().hex[:8]}" if self.out else None
        t0 = time.perf_counter()
        (episode,) = await play_episodes(
            [task], policy=policy, episode=dataclasses.replace(self.episode, harness_options=options),
            run=RunConfig(concurrency=1, out=out))
        wall = time.perf_counter() - t0
        if episode.sample is None or episode.sample.response_length == 0:
            log.warning("episode without a sample (reward 0): %s", describe_failure(episode))
        return self._output(episode, engine, wall)

    # ----------------------------------------------------------- internals
    def _check_tokenizer(self, renderer: ChatRenderer) -> None:
        theirs_tok: Any = self.tokenizer
        key = (self.tokenizer_source, id(theirs_tok))
        if key in _checked or theirs_tok is None:
            return
        mismatch = tokenizer_mismatch(renderer.tokenizer, theirs_tok)
        if mismatch is not None:
            raise TokenizerMismatchError(
                f"verl's tokenizer ({self.model_path}) and the gateway's ({self.tokenizer_source}) "
                "give different "
                f"ids for {mismatch[0][:40]!r}: leave the loop's tokenizer_path option unset, or point it at "
                "the same model"
            )
        _checked.add(key)

    def _output(self, e: EpisodeSample, engine: VerlEngine, wall: float) -> AgentLoopOutput:
        tok: Any = self.tokenizer
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        # Nothing sampled: a masked one-token response keeps verl's batch shape; reward 0.
        entry = trainer_entry(e, eos_id=int(eos),
                              encode=lambda text: tok.encode(text, add_special_tokens=False),
                              max_response_tokens=int(self.rollout_config.response_length))
        prompt_ids = self._cap_text_prompt_length(entry.prompt_ids)
        response_ids, response_mask, response_logprobs = entry.response_ids, entry.loss_mask, entry.logprobs
        failed = not entry.sampled
        facts = {k: v for k, v in e.facts().items() if k != "reward"}  # the reward is reward_score
        info = {"exit_reason": e.exit_reason, "turns": e.turns, "other_samples": e.other_samples,
                "foreign_samples": e.foreign_samples, "episode_failed": failed}
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=response_mask,
            response_logprobs=response_logprobs,
            reward_score=float(e.reward),
            num_turns=e.turns,
            metrics=AgentLoopMetrics(generate_sequences=engine.busy_s,
                                     tool_calls=max(0.0, wall - engine.busy_s)),
            extra_fields={**facts, "reward_extra_info": info},
        )
