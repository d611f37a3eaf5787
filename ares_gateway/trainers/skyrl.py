"""SkyRL's generator: each of a batch's prompts one real agent episode (extra ``.[skyrl]``).

:class:`AresGenerator` implements SkyRL's ``GeneratorInterface`` (``skyrl.train.generators.base``):
SkyRL's trainer calls ``await generator.generate(GeneratorInput)`` once per step and trains on the
``GeneratorOutput`` it returns::

    from ares_gateway import EpisodeConfig
    from ares_gateway.trainers.skyrl import AresGenerator

    generator = AresGenerator("examples", inference_engine_client=client,
                              tokenizer=cfg.trainer.policy.model.path,
                              episode=EpisodeConfig("mini-swe-agent", sandbox="docker", step_limit=20))
    trainer = RayPPOTrainer(cfg, tracker, tokenizer, train_dataset, client, generator, ...)

**A prompt** names its task by ``env_extras[i]["task"]``, else by its chat messages' last content
(SkyRL's dataset rows: ``{"prompt": [{"role": "user", "content": "fix-median-bug"}], ...}``). Each is
played as one episode: the harness CLI in a fresh sandbox, every LLM call it makes rendered by the
gateway with the trainer's tokenizer and sampled token-in/token-out through SkyRL's own
``inference_engine_client`` (:class:`~ares_gateway.engines.skyrl.SkyRLEngine`, the episode's session as
its ``session_ids`` entry so each turn goes to the engine holding its prefix), with the batch's
``sampling_params``; rewarded by the task's verifier.

**The output**, entry for entry in the batch's order: ``prompt_token_ids`` the first turn's prompt,
``response_ids`` / ``loss_masks`` / ``rollout_logprobs`` everything after it in the episode's main-line
sample (the model's answers 1, tool outputs and the next turns' headers 0;
:func:`~ares_gateway.trainers.trainer_entry`), ``rewards`` the verifier's reward (one float per
trajectory: SkyRL puts it on the last response token), ``stop_reasons`` ``"stop"`` for an episode that
ended by itself, ``"length"`` for one cut by its step or time limit or by ``max_response_tokens``, else
its exit reason (``agent_error``, ``sandbox_error``, ...: SkyRL's ``zero_reward_on_non_stop`` and
overlong filtering treat every non-``"stop"`` as unfinished), ``trajectory_ids`` as given,
``trajectory_generation_times`` each episode's seconds, ``env_metrics`` each episode's facts, and
``rollout_metrics`` SkyRL's own token statistics (``get_rollout_metrics``) plus ``ares/*`` counts.

A failed episode (the agent or its install failed, the sandbox did not start, the engines failed) is a
one-token masked response with reward 0 and its error in ``env_metrics``: the step goes on. A prompt
that names no task is a :class:`~ares_gateway.trainers.UnknownTaskError` listing the dataset's tasks
(a configuration error, raised). Step-wise training (``generator.step_wise_trajectories``) is not
supported: one entry per episode.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ares_gateway.episodes.config import EpisodeConfig, RunConfig, configs_from
from ares_gateway.trainers.episodes import (
    EpisodeSample,
    TokenizerMismatchError,
    TrainerError,
    describe_failure,
    play_episodes,
    require,
    resolve_dataset,
    resolve_tasks,
    task_name_of,
    tokenizer_mismatch,
    trainer_entry,
)

log = logging.getLogger(__name__)

__all__ = ["INSTALL", "AresGenerator"]


def _import_skyrl() -> None:
    """Import SkyRL's generator modules, or raise :class:`MissingExtraError` naming the extra.

    skyrl 0.3.0 declares Python >= 3.11, but ``skyrl.train.generators.base`` imports ``skyrl.backends``,
    whose ``skyrl.tinker.types`` puts a ``typing.TypedDict`` in a pydantic model: pydantic refuses that
    below Python 3.12. That one module is imported with ``typing.TypedDict`` pointing at
    ``typing_extensions.TypedDict`` (the same class on 3.12+), and nothing else changes."""
    if sys.version_info < (3, 12) and "skyrl.tinker.types" not in sys.modules:
        import typing

        import typing_extensions

        saved = typing.TypedDict
        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
        try:
            require("skyrl.tinker.types", "skyrl", install=INSTALL)
        finally:
            typing.TypedDict = saved  # type: ignore[misc]
    require("skyrl.train.generators.base", "skyrl", install=INSTALL)
    require("skyrl.train.generators.utils", "skyrl", install=INSTALL)


#: How skyrl installs here: the extra's packages, then skyrl itself without its pins (see pyproject.toml).
INSTALL = "python3 -m pip install 'ares-gateway[skyrl]' && python3 -m pip install --no-deps 'skyrl==0.3.0'"

_import_skyrl()

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput  # noqa: E402
from skyrl.train.generators.utils import get_rollout_metrics  # noqa: E402

from ares_gateway.engines.skyrl import SkyRLEngine  # noqa: E402
from ares_gateway.policies.tito import TitoPolicy  # noqa: E402
from ares_gateway.tokens import ChatRenderer  # noqa: E402


class AresGenerator(GeneratorInterface):  # type: ignore[misc]  # SkyRL ships no type information
    """SkyRL's ``GeneratorInterface``: one real agent episode per prompt (see the module docstring).

    Args:
        dataset: the task dataset the prompts name (a registered name such as ``"examples"``, a folder,
            or a :class:`~ares_gateway.episodes.tasks.Dataset`); an empty one is an error.
        inference_engine_client: SkyRL's client (the trainer's ``inference_engine_client``) every turn is
            sampled through. Exactly one of it and ``engine``.
        engine: any gateway engine instead (:mod:`ares_gateway.engines`), such as a
            :class:`~ares_gateway.engines.llama_cpp.LlamaCppEngine` for a run without SkyRL's engines.
        tokenizer: what the gateway renders with (a ``.gguf`` file or Hugging Face folder: the trained
            model's, ``trainer.policy.model.path``; default: the embedded SmolLM2 GGUF).
        renderer: a ``renderers`` name (default: by model name, else the model's chat template).
        episode: what each episode runs (:class:`~ares_gateway.episodes.config.EpisodeConfig`; default:
            ``mini-swe-agent`` in a ``local`` sandbox, 20 LLM calls). mini-swe-agent gets
            ``action_format="text"`` by itself for a model without a tool-call format.
        run: how the episodes run (:class:`~ares_gateway.episodes.config.RunConfig`): ``concurrency``,
            ``out`` (each call's run files go to ``out/step-N/``), ``executor`` (default: this process),
            ``warm``, ``retries``; ``attempts`` stays 1 (SkyRL repeats each prompt itself).
        max_tokens: the most tokens one answer may have (default: the batch's
            ``sampling_params["max_tokens"]``, else 512).
        max_response_tokens: cut each response (ids, mask, logprobs) to this many tokens, its stop reason
            ``"length"`` (``None``: whole episodes; SkyRL does not cut what a generator returns).
        trainer_tokenizer: the tokenizer SkyRL trains with (``get_generator``'s ``tokenizer``): checked once
            against the one the gateway renders with; different ids are a ``TokenizerMismatchError``.
        warm: how many of a call's episodes are set up ahead while its earlier ones run
            (:mod:`~ares_gateway.episodes.warm`); with an ``executor``, give it its own ``warm``.

    Attributes:
        last_episodes: the latest call's :class:`~ares_gateway.trainers.EpisodeSample` list, in prompt order.
        calls: one dict per call: ``step``, ``seconds``, ``generation_s``, ``episodes``, ``failed``,
        ``mean_reward``.
    """

    def __init__(
        self,
        dataset: Any = "examples",
        *,
        inference_engine_client: Any = None,
        engine: Any = None,
        tokenizer: str | None = None,
        renderer: str | None = None,
        episode: EpisodeConfig | None = None,
        run: RunConfig | None = None,
        max_tokens: int | None = None,
        max_response_tokens: int | None = None,
        trainer_tokenizer: Any = None,
        **settings: Any,
    ) -> None:
        if (inference_engine_client is None) == (engine is None):
            raise TrainerError(
                "AresGenerator samples through exactly one of inference_engine_client= (SkyRL's) "
                "and engine= (a gateway engine): give one")
        self.episode, self.run = configs_from(
            "AresGenerator", episode, run, settings,
            episode_default={"harness": "mini-swe-agent", "sandbox": "local", "step_limit": 20})
        if self.run.attempts != 1:
            raise ValueError(f"a generator plays one episode per prompt (got attempts={self.run.attempts}): "
                             "SkyRL repeats each prompt n_samples_per_prompt times")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None: the batch's), got {max_tokens}")
        if max_response_tokens is not None and max_response_tokens < 1:
            raise ValueError(
                f"max_response_tokens must be at least 1 (or None: no cap), got {max_response_tokens}")
        self.dataset = resolve_dataset(dataset)
        self.client = inference_engine_client
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer_name = renderer
        self.max_tokens = max_tokens
        self.max_response_tokens = max_response_tokens
        self.last_episodes: list[EpisodeSample] = []
        self.calls: list[dict[str, Any]] = []
        self.trainer_tokenizer = trainer_tokenizer
        self._renderer: ChatRenderer | None = None
        self._checked = trainer_tokenizer is None

    def renderer(self) -> ChatRenderer:
        """The chat renderer every turn is rendered with (loaded once)."""
        if self._renderer is None:
            from ares_gateway.tokens.tokenizer import default_model_path

            self._renderer = ChatRenderer(self.tokenizer or default_model_path(), renderer=self.renderer_name)
        return self._renderer

    def check_tokenizer(self) -> None:
        """Refuse a trainer tokenizer that gives other ids than the gateway's (once)."""
        if self._checked:
            return
        mismatch = tokenizer_mismatch(self.renderer().tokenizer, self.trainer_tokenizer)
        if mismatch is not None:
            raise TokenizerMismatchError(
                f"SkyRL's tokenizer and the gateway's ({self.tokenizer or 'the embedded SmolLM2 GGUF'}) "
                "give different "
                f"ids for {mismatch[0][:40]!r}: pass AresGenerator(tokenizer=...) the trained model's folder "
                "(cfg.trainer.policy.model.path)")
        self._checked = True

    def tasks_of(self, input_batch: Mapping[str, Any]) -> list[str]:
        """The task name of each prompt: ``env_extras[i]["task"]``, else the prompt's last message."""
        prompts = list(input_batch.get("prompts") or [])
        extras = list(input_batch.get("env_extras") or [None] * len(prompts))
        if len(extras) != len(prompts):
            raise TrainerError(f"the batch has {len(prompts)} prompts but {len(extras)} env_extras entries")
        names = []
        for prompt, extra in zip(prompts, extras, strict=True):
            if isinstance(extra, Mapping) and extra.get("task"):
                names.append(str(extra["task"]))
            else:
                names.append(task_name_of(prompt))
        return names

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        """Play one episode per prompt; their main-line samples as SkyRL's ``GeneratorOutput``."""
        t0 = time.perf_counter()
        tasks = resolve_tasks(self.dataset, self.tasks_of(input_batch))
        self.check_tokenizer()
        if not tasks:
            raise TrainerError("the batch has no prompts: nothing to generate")
        sp = dict(input_batch.get("sampling_params") or {})
        engine = SkyRLEngine(self.client, sampling_params=sp) if self.client is not None else self.engine
        busy0 = float(getattr(engine, "busy_s", 0.0))
        top_k = sp.get("top_k")
        policy = TitoPolicy(
            engine, renderer=self.renderer(),
            max_tokens=int(self.max_tokens or sp.get("max_tokens") or sp.get("max_generate_length") or 512),
            temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
            top_k=max(0, int(top_k if top_k is not None else 0)),
            seed=sp.get("seed"),
        )
        options = {**policy.harness_options(self.episode.harness), **self.episode.harness_options}
        meta = input_batch.get("batch_metadata")
        step = getattr(meta, "global_step", None)
        phase = getattr(meta, "training_phase", None)
        out = None
        if self.run.out:
            out = (f"{self.run.out}/{phase or 'step'}-{step}" if step is not None
                   else f"{self.run.out}/{uuid.uuid4().hex[:8]}")
        try:
            episodes = await play_episodes(
                tasks, policy=policy, episode=dataclasses.replace(self.episode, harness_options=options),
                run=dataclasses.replace(self.run, out=out))
        finally:
            if isinstance(engine, SkyRLEngine):
                await engine.finish_sessions()  # every episode is over: SkyRL's router may release them
        self.last_episodes = episodes
        output = self._output(episodes, input_batch)
        failed = [e for e in episodes if e.sample is None or e.sample.response_length == 0]
        for e in failed:
            log.warning("episode without a sample (reward 0): %s", describe_failure(e))
        generation_s = float(getattr(engine, "busy_s", 0.0)) - busy0
        seconds = time.perf_counter() - t0
        rewards = [float(e.reward) for e in episodes]
        metrics = output["rollout_metrics"]
        metrics.update({
            "ares/episodes": len(episodes), "ares/failed": len(failed),
            "ares/mean_reward": sum(rewards) / len(rewards), "ares/generation_s": generation_s,
            "ares/seconds": seconds,
        })
        self.calls.append(
            {"step": step, "seconds": seconds, "generation_s": generation_s, "episodes": len(episodes),
             "failed": len(failed), "mean_reward": metrics["ares/mean_reward"]})
        return output

    # ----------------------------------------------------------- internals
    def _output(self, episodes: Sequence[EpisodeSample], input_batch: Mapping[str, Any]) -> GeneratorOutput:
        tok = self.renderer().tokenizer
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        prompt_ids, response_ids, loss_masks, logprobs = [], [], [], []
        rewards: list[float] = []
        stop_reasons: list[str] = []
        times: list[float] = []
        env_metrics: list[dict[str, Any]] = []
        for e in episodes:
            entry = trainer_entry(e, eos_id=int(eos), encode=tok.encode,
                                  max_response_tokens=self.max_response_tokens)
            prompt_ids.append(entry.prompt_ids)
            response_ids.append(entry.response_ids)
            loss_masks.append(entry.loss_mask)
            logprobs.append(entry.logprobs)
            rewards.append(float(e.reward))
            truncated = entry.truncated or bool(e.result is not None and e.result.truncated)
            if not entry.sampled:
                stop_reasons.append(e.exit_reason if e.exit_reason != "completed" else "error")
            elif truncated:
                stop_reasons.append("length")
            elif e.exit_reason == "completed":
                stop_reasons.append("stop")
            else:
                stop_reasons.append(e.exit_reason)
            times.append(float(e.result.duration) if e.result is not None else 0.0)
            env_metrics.append({**e.facts(), "sampled_tokens": entry.sampled_tokens, "truncated": truncated,
                                "episode_failed": not entry.sampled})
        metrics = get_rollout_metrics(response_ids, rewards, loss_masks=loss_masks,
                                      trajectory_completion_times=times)
        output: dict[str, Any] = {
            "prompt_token_ids": prompt_ids,
            "response_ids": response_ids,
            "rewards": rewards,
            "loss_masks": loss_masks,
            "stop_reasons": stop_reasons,
            "rollout_metrics": metrics,
            "rollout_logprobs": logprobs,
            "trajectory_ids": input_batch.get("trajectory_ids"),
            "trajectory_generation_times": times,
            "rollout_expert_indices": None,
            "is_last_step": None,
            "env_metrics": env_metrics,
        }
        # SkyRL's TypedDict also lists the vision-only keys, which a text batch leaves out.
        return output  # type: ignore[return-value]
