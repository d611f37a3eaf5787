"""OpenEnv's loop-owning harness sessions: each one real agent episode, for TRL's AsyncGRPO harness rollout.

TRL's ``AsyncGRPOTrainer`` takes installed agents through its harness rollout worker
(``trl.experimental.async_grpo.openenv_harness.HarnessRolloutWorker``), which drives an OpenEnv
``ResourceSessionFactory`` (pip ``openenv`` 0.10, ``openenv.core.harness``). In its loop-owning mode
the worker calls the factory with ``sampling=`` (its training policy), then per rollout
``factory.create(prompt, seed=, episode_id=)``, ``session.wait_for_completion()``,
``session.fetch_training_trace()`` (OpenEnv's validated ``TrainingTrace``), ``session.verify(...)`` for
the reward, and ``session.close()``::

    import functools
    from ares_gateway import EpisodeConfig
    from ares_gateway.engines.vllm import VLLMEngine
    from ares_gateway.trainers.openenv import AresSessionFactory

    factory = functools.partial(AresSessionFactory, "examples", engine=VLLMEngine(url=vllm_server_url),
                                episode=EpisodeConfig("mini-swe-agent", sandbox="docker", step_limit=20))
    worker = HarnessRolloutWorker(..., harness_session_factory=factory)

**A session** is one episode of the task its prompt names (a task name, or chat messages whose last
content is one): the harness CLI in a fresh sandbox, every LLM call it makes rendered by the gateway and
sampled token-in/token-out by ``engine`` (the trainer's vLLM server) with the worker's sampling, rewarded
by the task's verifier. The episodes of all sessions run on one event loop of the factory's own thread
(OpenEnv's sessions are synchronous; TRL calls them from a thread pool).

**Its trace** is the episode's main-line sample (:func:`~ares_gateway.trainers.main_sample`), one
``TrainingTurn`` per model answer (:func:`~ares_gateway.trainers.sample_turns`): ``prompt_token_ids``
every id before the answer, ``completion_token_ids`` the sampled ids, ``per_token_logps`` the sampler's,
``loss_mask`` 0 on the prompt and 1 on the answer, ``metadata`` the session, the turn's index and its
``policy_version`` where the engine reported one. The turns extend each other, so TRL's reconciler
chains them back into the one sequence the gateway recorded. **Its outcome**: ``verify`` forwards the
verifier's reward as ``env_reward`` with the episode's facts as metrics.

A failed episode (the agent or its install failed, the sandbox did not start) has an empty trace and
``env_reward`` 0.0 with its error in the metrics: TRL trains nothing from it. A prompt that names no
task is a :class:`~ares_gateway.trainers.UnknownTaskError` from ``create`` listing the dataset's tasks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ares_gateway.episodes.config import EpisodeConfig, RunConfig, configs_from
from ares_gateway.trainers.episodes import (
    EpisodeSample,
    TrainerError,
    describe_failure,
    play_episodes,
    require,
    resolve_dataset,
    resolve_tasks,
    sample_turns,
)

if TYPE_CHECKING:
    from ares_gateway.episodes.tasks import Task

log = logging.getLogger(__name__)

#: How openenv installs here: the extra's packages, then openenv itself without its pins.
INSTALL = ("python3 -m pip install 'ares-gateway[openenv]' && python3 -m pip install --no-deps "
           "'openenv==0.10.0'")

require("openenv.core.harness", "openenv", install=INSTALL)

from openenv.core.harness import (  # noqa: E402  (after the extra's check)
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    TrainingTrace,
    TrainingTurn,
    VerifyResult,
)

from ares_gateway.policies.tito import TitoPolicy  # noqa: E402
from ares_gateway.tokens import ChatRenderer  # noqa: E402

__all__ = ["INSTALL", "AresSession", "AresSessionFactory"]


class _Loop:
    """The factory's event loop on a thread of its own: the sessions' episodes, the gateway and the
    engine live on it; OpenEnv's synchronous session calls wait on it from TRL's pool threads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ares-openenv-sessions",
                                       daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout: float = 120.0) -> None:
        """Cancel what still runs (each episode removes its sandbox as it ends), wait for it, then stop."""
        if self.loop.is_running():
            async def drain() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=timeout)

            try:
                self.submit(drain()).result(timeout=timeout + 10)
            except Exception as exc:  # stop regardless; say what may be left
                log.warning("the session loop did not drain: %s: %s", type(exc).__name__, exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()


class AresSession(ResourceSession):  # type: ignore[misc]  # openenv ships no type information
    """One episode, running from creation; OpenEnv's loop-owning ``TrainableSession`` (see the module
    docstring). Made by :meth:`AresSessionFactory.create`."""

    def __init__(self, factory: AresSessionFactory, task: Task, episode_id: str) -> None:
        self.factory = factory
        self.task = task
        self.episode_id = episode_id
        self._task: asyncio.Task[Any] | None = None
        self._future = factory._loop.submit(self._run())
        self._episode: EpisodeSample | None = None

    async def _run(self) -> EpisodeSample:
        self._task = asyncio.current_task()
        return await self.factory._play(self.task)

    # ----------------------------------------------------- loop-owning session
    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """Wait for the episode to end; 0 when it ended by itself, 1 otherwise (a limit, an error).
        ``TimeoutError`` when ``timeout_s`` passes first (the episode goes on until :meth:`close`)."""
        try:
            episode = self._future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the episode of {self.task.name!r} did not end within {timeout_s} s") from None
        self._episode = episode
        return 0 if episode.exit_reason == "completed" else 1

    @property
    def episode(self) -> EpisodeSample:
        """The played episode (waits for it)."""
        if self._episode is None:
            self.wait_for_completion()
        assert self._episode is not None
        return self._episode

    def fetch_training_trace(self) -> Any:
        """OpenEnv's ``TrainingTrace`` of the episode: one turn per model answer of its main line."""
        e = self.episode
        if e.sample is None:
            return TrainingTrace(turns=[])
        decode = self.factory.renderer().tokenizer.decode
        turns = []
        for k, t in enumerate(sample_turns(e.sample)):
            meta: dict[str, Any] = {"session_id": e.session_id, "turn": k}
            if t.policy_version is not None:
                meta["policy_version"] = t.policy_version
            turns.append(TrainingTurn(
                node_id=f"{e.session_id or self.episode_id}:{k}",
                prompt_token_ids=t.prompt_ids, completion_token_ids=t.completion_ids,
                per_token_logps=t.logprobs, loss_mask=[0] * len(t.prompt_ids) + [1] * len(t.completion_ids),
                response={
                    "choices": [{"message": {"role": "assistant", "content": decode(t.completion_ids)}}]},
                metadata=meta,
            ))
        return TrainingTrace(turns=turns)

    def verify(self, transcript: list[Any], final_state: Any | None = None) -> Any:
        """The verifier's reward (already computed when the episode ended) and the episode's facts."""
        e = self.episode
        facts = e.facts()
        if e.sample is None:
            if e.error is None:
                e.error = "the episode recorded no model turn"
            e.reward = 0.0
            facts = e.facts()
            log.warning("episode without a sample (reward 0): %s", describe_failure(e))
        return VerifyResult(env_reward=float(e.reward), done=True,
                            metrics={**facts, "episode_failed": e.sample is None})

    def close(self, timeout: float = 120.0) -> None:
        """Stop the episode if it still runs and wait until it has ended (its sandbox removed)."""
        if self._future.done():
            return

        async def stop() -> None:
            task = self._task
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=timeout)

        try:
            self.factory._loop.submit(stop()).result(timeout=timeout + 10)
        except Exception as exc:  # the loop is gone or the episode would not end: say so
            log.warning("the episode of %r did not end on close: %s: %s", self.task.name, type(exc).__name__,
                        exc)

    # --------------------------------------------------------- resource session
    def initial_messages(self) -> list[dict[str, Any]]:
        """The task's name as the one user message (the agent gets the task's own instruction)."""
        return [{"role": "user", "content": self.task.name}]

    def list_tools(self) -> list[Any]:
        """None: the agent owns its tools, inside its sandbox."""
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """Refused: a loop-owning session's agent calls its own tools in its sandbox."""
        return ToolResult(
            error=f"tool {name!r}: an ares-gateway session's agent runs its own tools in its sandbox; "
                  "use the session in TRL's loop-owning mode (no harness_adapter)")


class AresSessionFactory(ResourceSessionFactory):  # type: ignore[misc]  # openenv ships no type information
    """OpenEnv's ``ResourceSessionFactory``: each session one real agent episode (see the module docstring).

    Args:
        dataset: the task dataset the prompts name (a registered name such as ``"examples"``, a folder,
            or a :class:`~ares_gateway.episodes.tasks.Dataset`); an empty one is an error.
        engine: the gateway engine every turn is sampled by (:mod:`ares_gateway.engines`): the trainer's
            vLLM server (``VLLMEngine(url=...)``), or any other.
        tokenizer: what the gateway renders with (the trained model's ``.gguf`` file or Hugging Face folder;
            default: the embedded SmolLM2 GGUF).
        renderer: a ``renderers`` name (default: by model name, else the model's chat template).
        episode: what each episode runs (:class:`~ares_gateway.episodes.config.EpisodeConfig`; default:
            ``mini-swe-agent`` in a ``local`` sandbox, 20 LLM calls). mini-swe-agent gets
            ``action_format="text"`` by itself for a model without a tool-call format.
        run: how each session's episode runs (:class:`~ares_gateway.episodes.config.RunConfig`): ``out``
            (each episode's run files go to ``out/<task>-<id>/``), ``retries``; one episode per session.
        max_tokens: the most tokens one answer may have.
        sampling: the training policy TRL's worker passes (``temperature`` and the no-op ``top_p`` /
            ``top_k`` / ``min_p`` / ``repetition_penalty`` OpenEnv's ``training_sampling`` allows).
    """

    def __init__(
        self,
        dataset: Any = "examples",
        *,
        engine: Any,
        tokenizer: str | None = None,
        renderer: str | None = None,
        episode: EpisodeConfig | None = None,
        run: RunConfig | None = None,
        max_tokens: int = 512,
        sampling: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if engine is None:
            raise TrainerError("AresSessionFactory needs engine=: the gateway engine that samples every turn "
                               "(the trainer's vLLM server: VLLMEngine(url=...))")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.dataset = resolve_dataset(dataset)
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer_name = renderer
        self.episode, self.run = configs_from(
            "AresSessionFactory", episode, run, settings,
            episode_default={"harness": "mini-swe-agent", "sandbox": "local", "step_limit": 20})
        self.max_tokens = max_tokens
        sp = dict(sampling or {})
        top_k = int(sp.get("top_k") or 0)
        self.temperature = float(sp.get("temperature", 1.0))
        self.top_p = float(sp.get("top_p", 1.0))
        self.top_k = max(0, top_k)
        self._renderer: ChatRenderer | None = None
        self._policy: TitoPolicy | None = None
        self._lock = threading.Lock()
        self._loop = _Loop()

    def renderer(self) -> ChatRenderer:
        """The chat renderer every turn is rendered with (loaded once)."""
        with self._lock:
            if self._renderer is None:
                from ares_gateway.tokens.tokenizer import default_model_path

                self._renderer = ChatRenderer(self.tokenizer or default_model_path(),
                                              renderer=self.renderer_name)
            return self._renderer

    def policy(self) -> TitoPolicy:
        """The policy every session's turns go through (made once)."""
        renderer = self.renderer()
        with self._lock:
            if self._policy is None:
                self._policy = TitoPolicy(self.engine, renderer=renderer, max_tokens=self.max_tokens,
                                          temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
            return self._policy

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> AresSession:
        """Start one episode of the task ``task`` names; its session."""
        (resolved,) = resolve_tasks(self.dataset, [task])
        return AresSession(self, resolved, episode_id or uuid.uuid4().hex)

    async def _play(self, task: Task) -> EpisodeSample:
        policy = self.policy()
        options = {**policy.harness_options(self.episode.harness), **self.episode.harness_options}
        out = f"{self.run.out}/{task.name}-{uuid.uuid4().hex[:8]}" if self.run.out else None
        (episode,) = await play_episodes(
            [task], policy=policy, episode=dataclasses.replace(self.episode, harness_options=options),
            run=dataclasses.replace(self.run, concurrency=1, attempts=1, out=out))
        return episode

    def close(self) -> None:
        """Stop the factory's event loop (end the sessions first)."""
        self._loop.close()
