"""TRL's ``GRPOTrainer``: each completion is one real agent episode, sampled by the model being trained.

::

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from ares_gateway import EpisodeConfig
    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    rollouts = rollout_func("examples",
                            episode=EpisodeConfig("mini-swe-agent", sandbox="local", step_limit=8))
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward_from_episode],
                          train_dataset=Dataset.from_dict({"prompt": ["fix-median-bug", ...]}),
                          args=GRPOConfig(num_generations=2, ...), rollout_func=rollouts)
    trainer.train()

**The contract.** TRL calls ``rollouts(prompts, trainer)`` once per generation batch with the batch's
prompts (each already repeated ``num_generations`` times by its sampler). Each prompt names a task of
the dataset (a string, or chat messages whose last content is the name); each entry runs one
episode: the harness CLI in a fresh sandbox, every LLM call it makes rendered by the gateway and
sampled token-in/token-out from ``trainer.model`` itself
(:class:`~ares_gateway.engines.transformers.TransformersEngine`,
no copy: step N+1's episodes sample the weights step N produced), rewarded by the task's verifier.

Per entry it returns what TRL wants: ``prompt_ids`` (the first turn's prompt), ``completion_ids``
(everything after it: the model's answers and, between them, the agent's tool outputs and the next
turns' headers), ``logprobs`` (the sampler's, 0.0 where not sampled), ``env_mask`` (1 on tokens the model
sampled, 0 on every tool output / observation token), and as extra keys the episode's ``reward``,
``task``, ``session_id``, ``exit_reason``, ``turns``, ``error``, ``other_samples``, ``foreign_samples``,
``sampled_tokens`` and
``mean_logprob`` (over the sampled tokens) and ``truncated`` (the completion was cut to
``max_completion_tokens``), which TRL passes to the reward functions (it keeps
``logprobs`` and ``env_mask`` from them); :func:`reward_from_episode` returns the verifier's reward and logs
the facts as
TRL completion-table columns.

**One sample an episode.** An episode's turns can give several samples (the agent rewrote its
history, made side calls, or one of its tool commands sent requests with the session's credentials);
TRL gets the main line, the harness CLI's own conversation (:func:`~ares_gateway.trainers.main_sample`),
the count of the others is ``other_samples``, of them the foreign ones (conversations that do not
extend the session's first request) ``foreign_samples``.

**On a Ray cluster** (``rollout_func(..., run=RunConfig(executor=RayExecutor(per_node=4)))``): the
episodes run on the cluster's nodes, their turns are still sampled here, by ``trainer.model``: the
engine is served over HTTP (:class:`~ares_gateway.engines.engine_server.EngineServer`, SGLang's
``/generate``, on ``engine_host``) and each node's gateway gets a
:class:`~ares_gateway.trainers._served.RemoteTitoPolicy` over it (same tokenizer, renderer and sampling).
The batch is the local path's, entry for entry.

**Policy versions.** Without an executor every call's episodes run on one gateway of the rollout
function's, which stamps each turn with the version of the weights that sampled it: the trainer's
``global_step``; with an executor, its gateways (each node's, on Ray) are set to that step at each call.
Each entry carries them (:data:`VERSION_KEYS`, see :meth:`AresRollouts.__call__`).

**Overlap** (``rollout_func(..., overlap=True)``): when TRL calls for a generation batch, its episodes
were started at the previous call, and ran while the trainer trained on that call's batch; the call
waits for what is still running, and starts the next batch's episodes before it returns. The next
batch's prompts are the trainer's own: its sampler (TRL's seeded ``RepeatSampler``) is replayed by a
second one built the same way; episodes are matched to prompts by task, and a call whose prompts are
not the predicted ones runs the missing episodes then, and stops predicting. The first call runs its
episodes itself. A ``TrainerCallback`` (added to the trainer at the first call) fences each optimizer
step: ``on_pre_optimizer_step`` pauses sampling on the gateway (drain: the turns being sampled finish
with the old weights, every other request waits), ``on_optimizer_step`` resumes it with the version
``global_step + 1``, and labels the engine's weights with it (``set_weight_version``), so each turn
carries the version the engine itself reports. So an episode that ran across an update has turns of two
versions, and a call's entries are at most one version old (``staleness`` 1); TRL (without vLLM) applies
no off-policy correction to them. ``max_staleness=K`` masks (``env_mask`` 0, logprobs 0.0) the sampled
tokens of versions older than the trainer's step at the call minus ``K``: ``max_staleness=0`` trains only
what the current weights sampled. The engine samples the model in the trainer's mode (switching the shared
module to
``eval()`` would race the trainer's thread), so overlap refuses a model with dropout.

**A failed episode** (the agent failed, the engine failed) is an entry with reward 0 and its error;
one with nothing sampled is a one-token completion masked out (``env_mask`` 0), so the training step goes
on. One the infrastructure failed on every try (``exit_reason`` ``infra_error``: its sandbox did not
start, its agent could not be installed) is excluded: the same masked stand-in, whatever it recorded,
with the reward :func:`~ares_gateway.trainers.play_episodes` gave it (its group's mean judged reward: it
moves no GRPO baseline), never a reward-0 sample; with ``drop_group_on_infra_error`` its whole group is
(every member masked, reward 0). Each entry is built by :func:`~ares_gateway.trainers.trainer_entry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ares_gateway.episodes.config import EpisodeConfig, RunConfig, configs_from
from ares_gateway.trainers.episodes import (
    EpisodeSample,
    TokenizerMismatchError,
    TrainerError,
    describe_failure,
    exclude_infra_errors,
    play_episodes,
    require,
    resolve_dataset,
    resolve_tasks,
    task_name_of,
    tokenizer_mismatch,
    trainer_entry,
)
from trajectory import check_max_staleness

if TYPE_CHECKING:
    from ares_gateway.core.fence import PauseReport
    from ares_gateway.engines.transformers import TransformersEngine
    from ares_gateway.episodes.tasks import Task
    from ares_gateway.gateway import Gateway
    from ares_gateway.policies.base import Policy
    from ares_gateway.policies.tito import TitoPolicy
    from ares_gateway.trainers._served import ServedEngine

log = logging.getLogger(__name__)

__all__ = ["EPISODE_KEYS", "VERSION_KEYS", "AresRollouts", "TokenizerMismatchError", "reward_from_episode",
           "rollout_func"]

T = TypeVar("T")

#: The extra keys each rollout returns per completion (TRL hands them to the reward functions).
EPISODE_KEYS = ("reward", "task", "session_id", "exit_reason", "turns", "error", "other_samples",
                "foreign_samples", "sampled_tokens", "mean_logprob", "truncated")

#: The extra keys saying which weights sampled each completion (see :meth:`AresRollouts.__call__`).
VERSION_KEYS = ("policy_versions", "first_version", "last_version", "mixed_versions", "staleness")

class _Loop:
    """One event loop (uvloop where installed, as the CLI runs) on a thread of its own: TRL calls the
    rollout function synchronously, the gateway and the sandboxes live across its calls."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ares-trl-rollouts", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            # Interrupted (Ctrl-C in the trainer): cancel the episodes, each removes its sandbox.
            fut.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()


def _live_mode_engine(model: Any) -> Any:
    """A :class:`~ares_gateway.engines.transformers.TransformersEngine` that samples ``model`` in the
    mode the trainer keeps it in. Under overlap the trainer trains on its own thread while turns are
    sampled: switching the shared module to ``eval()`` and back would race the trainer, which reads
    ``model.training`` to choose its train or eval path. Dropout is refused up front instead
    (:func:`_check_no_dropout`), so the trainer's mode samples the same distribution."""
    from ares_gateway.engines.transformers import TransformersEngine

    class LiveModeEngine(TransformersEngine):
        @contextlib.contextmanager
        def _evaluating(self) -> Iterator[Any]:
            import torch

            old_threads = torch.get_num_threads()
            if self.threads:
                torch.set_num_threads(self.threads)
            try:
                with torch.inference_mode():
                    yield torch
            finally:
                if self.threads:
                    torch.set_num_threads(old_threads)

    return LiveModeEngine(model)


def _check_no_dropout(model: Any) -> None:
    import torch

    active = [name or "the model" for name,
              m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    attention = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if active or attention > 0:
        where = ", ".join(active[:3]) + (" ..." if len(active) > 3 else "")
        what = f"dropout in {where}" if active else f"attention_dropout {attention} in its config"
        raise TrainerError(
            "overlap samples turns while the trainer trains, with the model in the trainer's mode, and "
            "the model has "
            f"{what}: pass GRPOConfig(disable_dropout=True)"
            + (" and set model.config.attention_dropout = 0.0"
                                                                 if attention > 0 else "")
            + ", or rollout_func(overlap=False)"
        )


class _Background:
    """The next training call's episodes, started on the rollouts' loop while the trainer trains."""

    def __init__(self, tasks: list[Task], step: int) -> None:
        self.tasks = tasks
        self.step = step
        self.launched = time.monotonic()
        self.finished: float | None = None
        self.task: asyncio.Task[list[EpisodeSample]] | None = None


class _Schedule:
    """The prompts of TRL's training calls to come, replayed from the trainer's own sampler.

    ``GRPOTrainer`` draws its generation batches from a ``RepeatSampler`` (seeded: ``args.seed``) that
    yields each batch ``repeat_count`` times in a row (once per step that reuses it); it calls the
    rollout function on the first of each. A second sampler built the same way yields the same order,
    epoch after epoch, as long as it is iterated as often as the trainer's."""

    def __init__(self, trainer: Any, size: int) -> None:
        self.sampler = trainer._get_train_sampler()
        self.dataset = trainer.train_dataset
        self.size = size
        self.repeat = max(1, int(getattr(self.sampler, "repeat_count", 1)))
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[list[Any]]:
        while True:
            indexes = list(iter(self.sampler))
            if not indexes:
                return
            batches = [indexes[i:i + self.size] for i in range(0, len(indexes), self.size)]
            for b in batches[::self.repeat]:
                if len(b) == self.size:
                    yield [self.dataset[i]["prompt"] for i in b]

    def next(self) -> list[Any] | None:
        return next(self._batches, None)


async def _await(task: asyncio.Task[T]) -> T:
    return await task


async def _cancelled(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class AresRollouts:
    """The callable :func:`rollout_func` returns; see the module docstring for what it does.

    Attributes:
        last_episodes: the latest call's :class:`~ares_gateway.trainers.EpisodeSample` list, in prompt order.
        calls: one dict per call: ``seconds`` (the call's wall time), ``generation_s`` (the engine's
            busy time during the call), ``episodes``, ``failed`` (without a sample, reward 0), ``excluded``
            (``infra_error`` or, with ``drop_group_on_infra_error``, its group's: masked stand-ins),
            ``stale_tokens`` (sampled tokens masked by ``max_staleness``), ``mean_reward``, ``version`` (the
            trainer's step, the weights' version, at the call); with ``overlap`` also ``prefetched`` (entries
            from episodes started before the call), ``ran_now`` (entries whose episodes ran in the call),
            ``discarded`` (started episodes the call had no entry for), ``waited_s`` (the call's wait for the
            started episodes) and ``overlap_s`` (seconds those episodes ran while the trainer trained).
        fences: with ``overlap``, one dict per optimizer step: ``asked_at`` / ``paused_at`` /
            ``resumed_at`` (``time.monotonic``), ``drain_s``, ``in_flight`` (generations the pause waited
            for), ``version`` (the weights' version the resume set).
        fence_callback: with ``overlap``, the ``transformers.TrainerCallback`` that fences each optimizer
            step (added to the trainer at the first call by itself).
    """

    def __init__(self, dataset: Any, *, episode: EpisodeConfig, run: RunConfig, tokenizer: str | None = None,
                 renderer: str | None = None, sampling: Mapping[str, Any] | None = None,
                 check_tokenizer: bool = True, max_completion_tokens: int | None = None,
                 engine_host: str = "127.0.0.1", engine_port: int = 0,
                 engine_server_options: Mapping[str, Any] | None = None, overlap: bool = False,
                 fence_timeout: float | None = 600.0, max_staleness: int | None = None,
                 drop_group_on_infra_error: bool = False) -> None:
        executor = run.executor
        if max_completion_tokens is not None and max_completion_tokens < 1:
            raise ValueError(
                f"max_completion_tokens must be at least 1 (or None: no cap), got {max_completion_tokens}")
        if overlap and executor is not None:
            raise ValueError(
                "overlap runs the episodes in this process, on the rollouts' own gateway, whose fence it "
                "closes for each optimizer step: leave executor unset, or pass overlap=False")
        if fence_timeout is not None and not fence_timeout > 0:
            raise ValueError(
                f"fence_timeout must be positive seconds (or None: no limit), got {fence_timeout}")
        check_max_staleness(max_staleness)
        if max_staleness is not None and executor is not None:
            # Turns sampled on an executor's workers carry no version the rollouts set: all would be stale.
            raise ValueError(
                "max_staleness judges each turn by the version the rollouts' own gateway stamps on it, "
                "and episodes on an executor carry none: leave executor unset, or max_staleness None")
        if run.attempts != 1:
            raise ValueError(f"a rollout function plays one episode per prompt (got attempts="
                             f"{run.attempts}): TRL repeats each prompt num_generations times")
        self.episode = episode
        self.run = run
        self.max_staleness = max_staleness
        self.drop_group_on_infra_error = drop_group_on_infra_error
        self.max_completion_tokens = max_completion_tokens
        self.dataset = resolve_dataset(dataset)
        self.tokenizer = tokenizer
        self.renderer_name = renderer
        self.sampling = dict(sampling or {})
        self.check_tokenizer = check_tokenizer
        self.overlap = overlap
        self.fence_timeout = fence_timeout
        # Episodes in other processes reach the engine over HTTP (served at the first call).
        self.served: ServedEngine | None = None
        if executor is not None and executor.kind != "local":
            from ares_gateway.trainers._served import ServedEngine

            self.served = ServedEngine(host=engine_host, port=engine_port,
                                       server_options=engine_server_options)
        self.last_episodes: list[EpisodeSample] = []
        self.calls: list[dict[str, Any]] = []
        self.fences: list[dict[str, Any]] = []
        self.fence_callback: Any = None
        #: The gateway every call's episodes run on (without an executor): it stamps each turn with the
        #: trainer's step, and its fence pauses sampling around optimizer steps under ``overlap``.
        self.gateway: Gateway | None = None
        self.policy: TitoPolicy | None = None
        self.engine: TransformersEngine | None = None
        self._model_id: int | None = None
        self._loop: _Loop | None = None
        self._lock = threading.Lock()
        self._next: _Background | None = None
        self._schedule: _Schedule | None = None
        self._schedule_started = False
        self._predicted: list[str] | None = None
        self._paused: dict[str, Any] | None = None
        from sandbox import janitor

        janitor.install()  # from the trainer's (main) thread: Ctrl-C removes the episodes' sandboxes

    # ----------------------------------------------------------------- TRL
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func(prompts, trainer)``: one episode per prompt, TRL's dict of lists back.

        Besides :data:`EPISODE_KEYS`, each entry has :data:`VERSION_KEYS`: ``policy_versions``
        (``[start, end, version]`` per sampled span, positions in ``completion_ids``), ``first_version``
        and ``last_version`` (of its first and last sampled span), ``mixed_versions`` (its sampled tokens
        came from more than one version of the weights) and ``staleness`` (the trainer's step at this
        call minus the oldest version in it: 0 on-policy). A version is the trainer's ``global_step``
        when the turn was sampled (``None`` where unknown, as on a Ray executor)."""
        with self._lock:
            t0 = time.perf_counter()
            tasks = resolve_tasks(self.dataset, prompts)
            policy = self._policy_for(trainer)
            if self._loop is None:
                self._loop = _Loop()
            step = getattr(getattr(trainer, "state", None), "global_step", None)
            version = step if isinstance(step, int) and step >= 0 else None
            engine = self.engine
            assert engine is not None  # _policy_for made it
            if not self.overlap:
                # The trainer updated the weights since the last call (a fused optimizer leaves no trace the
                # engine could see): no KV cache of the old weights may be reused. (Under overlap the fence
                # drops them at each optimizer step, when no turn is sampled.)
                engine.reset()
            busy0 = engine.busy_s
            if self.run.executor is None:
                self._loop.run(self._open_gateway(version))
            options = {**policy.harness_options(self.episode.harness), **self.episode.harness_options}
            episode_policy: Policy = policy
            if self.served is not None:
                source = self.tokenizer or _default_tokenizer()
                episode_policy = self._loop.run(self.served.policy_for(
                    self.engine, tokenizer=source, renderer=self.renderer_name, sampling=self.sampling))
            info: dict[str, Any] = {}
            training = bool(getattr(getattr(trainer, "model", None), "training", True))
            if self.overlap and training:
                self._install_fence(trainer)
                episodes, info = self._overlapped(tasks, prompts, trainer, step, episode_policy, options,
                                                  version)
            else:
                episodes = self._loop.run(
                    self._play(tasks, episode_policy, options, self._out(step), version))
            # A group's episodes may come from two plays (started ahead, and run now): judge it whole.
            exclude_infra_errors(episodes, drop_group=self.drop_group_on_infra_error)
            self.last_episodes = episodes
            batch = self._batch(episodes, prompts, trainer, version)
            failed = [e for e in episodes if e.sample is None and not e.excluded]
            for e in failed:
                log.warning("episode without a sample (reward 0): %s", describe_failure(e))
            excluded = [e for e in episodes if e.excluded]
            for e in excluded:
                if e.infra_error:
                    log.warning("episode excluded from training (masked, reward %.3g): %s", e.reward,
                                describe_failure(e))
            self.calls.append({
                "step": step, "version": version, "seconds": time.perf_counter() - t0,
                "generation_s": engine.busy_s - busy0, "episodes": len(episodes), "failed": len(failed),
                "excluded": len(excluded), "stale_tokens": sum(e.stale_tokens for e in episodes),
                "mean_reward": sum(e.reward for e in episodes) / max(1, len(episodes)), **info,
            })
            return batch

    def close(self) -> None:
        """Stop the rollouts' event loop: cancel episodes started for a call that did not come (each
        removes its sandbox), close the gateway and the engine."""
        if self._loop is not None:
            if self.gateway is not None and self._paused is not None:
                # An optimizer step failed inside the fence: resume, so the cancelled episodes end as usual.
                self._paused = None
                with contextlib.suppress(Exception):
                    self._loop.run(self._resume_now(None))
            self._cancel_next()
            if self.gateway is not None:
                self._loop.run(self.gateway.close())
                self.gateway = None
            if self.served is not None:
                self._loop.run(self.served.aclose())
            if self.policy is not None:
                self._loop.run(self.policy.aclose())
            self._loop.close()
            self._loop = None

    # ------------------------------------------------------------ overlap
    def _overlapped(self, tasks: list[Task], prompts: list[Any], trainer: Any, step: int | None,
                    policy: Policy, options: Mapping[str, Any], version: int | None = None,
                    ) -> tuple[list[EpisodeSample], dict[str, Any]]:
        """This call's episodes: those started at the last call for it (matched by task: episodes of one
        task are alike), the rest run now; then the next call's episodes are started."""
        assert self._loop is not None
        ready: dict[str, list[EpisodeSample]] = {}
        waited = 0.0
        ran = 0.0
        bg, self._next = self._next, None
        if bg is not None and bg.task is not None:
            w0 = time.perf_counter()
            for done in self._loop.run(_await(bg.task)):
                ready.setdefault(done.task, []).append(done)
            waited = time.perf_counter() - w0
            ran = (bg.finished or time.monotonic()) - bg.launched
        got: list[EpisodeSample | None] = []
        missing: list[int] = []
        for i, t in enumerate(tasks):
            pool = ready.get(t.name)
            taken = pool.pop(0) if pool else None
            got.append(taken)
            if taken is None:
                missing.append(i)
        discarded = sum(len(v) for v in ready.values())
        if discarded:
            log.info(
                "overlap: %d started episode(s) had no entry in this call (the prompts were not the ones "
                "predicted) and are dropped", discarded)
        if missing:
            now = self._loop.run(
                self._play([tasks[i] for i in missing], policy, options, self._out(step), version))
            for i, e in zip(missing, now, strict=True):
                got[i] = e
        self._check_schedule(trainer, prompts)
        self._launch_next(trainer, policy, options)
        episodes = [e for e in got if e is not None]
        return episodes, {"prefetched": len(tasks) - len(missing), "ran_now": len(missing),
                          "discarded": discarded, "waited_s": waited, "overlap_s": max(0.0, ran - waited)}

    def _check_schedule(self, trainer: Any, prompts: list[Any]) -> None:
        """Follow the trainer's sampler; stop predicting (overlap then runs nothing ahead) where this
        call's prompts are not the ones predicted for it (a resumed run, another sampler)."""
        names = [task_name_of(p) for p in prompts]
        if not self._schedule_started:
            self._schedule_started = True
            try:
                self._schedule = _Schedule(trainer, len(prompts))
            except Exception as exc:  # not a GRPOTrainer's sampler: nothing to replay
                log.warning("overlap: cannot replay the trainer's prompt order (%s): no episodes run ahead",
                            exc)
                return
            first = self._schedule.next()
            self._predicted = [task_name_of(p) for p in first] if first is not None else None
        if self._schedule is None:
            return
        if self._predicted != names:
            log.warning(
                "overlap: the trainer's prompts %s are not the predicted %s: no episodes run ahead from now "
                "on", names, self._predicted)
            self._schedule = None
            self._predicted = None
            return
        upcoming = self._schedule.next()
        self._predicted = [task_name_of(p) for p in upcoming] if upcoming is not None else None

    def _launch_next(self, trainer: Any, policy: Policy, options: Mapping[str, Any]) -> None:
        assert self._loop is not None
        if self._schedule is None or self._predicted is None:
            return
        args = trainer.args
        every = int(getattr(args, "steps_per_generation", 1) or 1) * int(getattr(trainer, "num_iterations", 1)
                                                                         or 1)
        accumulation = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
        micro = int(getattr(trainer, "_step", 0)) + every
        max_steps = int(getattr(trainer.state, "max_steps", 0) or 0)
        if max_steps > 0 and micro >= max_steps * accumulation:
            return  # the last call of the run: nothing comes after it
        try:
            tasks = resolve_tasks(self.dataset, self._predicted)
        except TrainerError:
            return  # the call for them says what is wrong
        bg = _Background(tasks, micro // accumulation)
        bg.task = self._loop.run(self._spawn(bg, policy, options))
        self._next = bg

    async def _spawn(self, bg: _Background, policy: Policy,
                     options: Mapping[str, Any]) -> asyncio.Task[list[EpisodeSample]]:
        # Judged against the trainer's step at the call that takes them (bg.step), not at this one.
        task = asyncio.ensure_future(self._play(bg.tasks, policy, options, self._out(bg.step), bg.step))

        def finished(_: Any) -> None:
            bg.finished = time.monotonic()

        task.add_done_callback(finished)
        return task

    def _cancel_next(self) -> None:
        bg, self._next = self._next, None
        if bg is not None and bg.task is not None and self._loop is not None:
            self._loop.run(_cancelled(bg.task))

    def _install_fence(self, trainer: Any) -> None:
        handler = getattr(trainer, "callback_handler", None)
        if handler is None:
            return
        if self.fence_callback is None:
            self.fence_callback = _fence_callback(self)
        if self.fence_callback not in handler.callbacks:
            handler.add_callback(self.fence_callback)

    def _pause(self) -> None:
        """Before an optimizer step (the trainer's thread): no turn is sampled until :meth:`_resume`."""
        if self.gateway is None or self._loop is None or self._paused is not None:
            return
        asked = time.monotonic()
        report, paused_at = self._loop.run(self._pause_now())
        self._paused = {"asked_at": asked, "paused_at": paused_at, "drain_s": report.drain_seconds,
                        "in_flight": report.in_flight}

    def _resume(self, version: int | None) -> None:
        """After an optimizer step: the weights of ``version`` are loaded; sampling goes on."""
        paused, self._paused = self._paused, None
        if paused is None or self._loop is None:
            return
        if self.engine is not None:
            self.engine.reset()  # nothing is sampled now: the old weights' KV caches go
        set_to, resumed_at = self._loop.run(self._resume_now(version))
        self.fences.append({**paused, "resumed_at": resumed_at, "version": set_to})

    async def _pause_now(self) -> tuple[PauseReport, float]:
        assert self.gateway is not None
        report = await self.gateway.pause_sampling("drain", timeout=self.fence_timeout)
        return report, time.monotonic()  # on the loop: nothing is sampled from here

    async def _resume_now(self, version: int | None) -> tuple[int | None, float]:
        gw = self.gateway
        assert gw is not None
        if version is not None and gw.policy_version is not None and version < gw.policy_version:
            version = None  # never lower: the gateway keeps its version
        label = version if version is not None else gw.policy_version
        set_label = getattr(self.engine, "set_weight_version", None)
        if set_label is not None and label is not None:
            # The new weights' label, set while nothing is sampled: each turn reports the engine's own
            # version.
            set_label(label)
        at = time.monotonic()  # on the loop, before sampling may start again
        gw.resume_sampling(version)
        return gw.policy_version, at

    async def _open_gateway(self, version: int | None) -> None:
        if self.gateway is None:
            from ares_gateway.episodes.episode import episode_gateway

            longest = max([self.episode.time_limit or 0.0, *(t.config.agent_timeout for t in self.dataset)])
            gw = episode_gateway(self.episode.harness, time_limit=longest)
            await gw.start()
            self.gateway = gw
        current = self.gateway.policy_version
        if version is not None and (current is None or version > current):
            self.gateway.set_policy_version(version)

    async def _play(self, tasks: Sequence[Task], policy: Policy, options: Mapping[str, Any],
                    out: str | None, version: int | None = None) -> list[EpisodeSample]:
        """The episodes of ``tasks``; ``version``: the trainer's step at the call that trains on them, the
        current version their stale responses are judged against (``max_staleness``)."""
        executor = self.run.executor
        if executor is None:
            from ares_gateway.episodes.executor import LocalExecutor

            executor = LocalExecutor(concurrency=self.run.concurrency, gateway=self.gateway,
                                     warm=self.run.warm)
        elif version is not None and hasattr(executor, "set_policy_version"):
            # The executor's gateways (each node's, on Ray) stamp the turns with the trainer's step too.
            current = executor.policy_version
            if current is None or version > current:
                await executor.set_policy_version(version)
        return await play_episodes(
            tasks, policy=policy, episode=dataclasses.replace(self.episode, harness_options=options),
            run=dataclasses.replace(self.run, out=out, executor=executor, warm=0),
            max_staleness=self.max_staleness, policy_version=version,
            drop_group_on_infra_error=self.drop_group_on_infra_error,
        )

    def _out(self, step: int | None) -> str | None:
        out = self.run.out
        return f"{out}/step-{step}" if out and step is not None else (str(out) if out is not None else None)

    # ----------------------------------------------------------- internals
    def _policy_for(self, trainer: Any) -> TitoPolicy:
        model = trainer.model
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
        if self.policy is not None and self._model_id == id(model):
            return self.policy
        from ares_gateway.engines.transformers import TransformersEngine
        from ares_gateway.policies.tito import TitoPolicy

        source = self.tokenizer or _default_tokenizer()
        if self.overlap:
            _check_no_dropout(model)
            self.engine = _live_mode_engine(model)
        else:
            self.engine = TransformersEngine(model)
        self.policy = TitoPolicy(self.engine, tokenizer=source, renderer=self.renderer_name, **self.sampling)
        self._model_id = id(model)
        if self.check_tokenizer:
            self._check_tokenizer(getattr(trainer, "processing_class", None), source)
        return self.policy

    def _check_tokenizer(self, theirs: Any, source: str) -> None:
        if theirs is None or not hasattr(theirs, "encode"):
            return
        assert self.policy is not None  # _policy_for made it
        mismatch = tokenizer_mismatch(self.policy.renderer.tokenizer, theirs)
        if mismatch is not None:
            text, a, b = mismatch
            raise TokenizerMismatchError(
                f"the trainer's tokenizer and the gateway's ({source}) give different ids for {text[:40]!r} "
                f"({b[:12]}... vs {a[:12]}...): pass rollout_func(tokenizer=...) the model's own "
                ".gguf file or Hugging Face folder"
            )

    def _batch(self, episodes: Sequence[EpisodeSample], prompts: Sequence[Any], trainer: Any,
               version: int | None = None) -> dict[str, list[Any]]:
        assert self.policy is not None  # _policy_for made it
        tok = getattr(trainer, "processing_class", None)
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = self.policy.renderer.tokenizer.eos_token_id or 0
        batch: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                        *EPISODE_KEYS, *VERSION_KEYS)}
        encode = self.policy.renderer.tokenizer.encode
        for e in episodes:
            # The one place an episode becomes an entry: a failed one's masked stand-in, an excluded one's
            # (infra_error) with the reward play_episodes gave it, a completion cut to max_completion_tokens.
            entry = trainer_entry(e, eos_id=int(eos), encode=encode,
                                  max_response_tokens=self.max_completion_tokens)
            batch["prompt_ids"].append(entry.prompt_ids)
            batch["completion_ids"].append(entry.response_ids)
            batch["logprobs"].append(entry.logprobs)
            batch["env_mask"].append(entry.loss_mask)
            batch["truncated"].append(entry.truncated)
            batch["sampled_tokens"].append(entry.sampled_tokens)
            batch["mean_logprob"].append(entry.mean_logprob)
            spans: list[list[Any]] = []
            s = e.sample
            if entry.sampled and s is not None:
                n, cut = s.prompt_length, len(entry.response_ids)
                # The sample's spans are positions in its tokens; TRL's are in completion_ids, cut alike.
                spans = [[max(0, a - n), min(cut, b - n), v] for a, b,
                         v in s.metadata.get("policy_versions") or []
                         if a - n < cut and b > n]
            versions = [v for _, _, v in spans]
            known = [v for v in versions if v is not None]
            batch["policy_versions"].append(spans)
            batch["first_version"].append(versions[0] if versions else None)
            batch["last_version"].append(versions[-1] if versions else None)
            # None (no version known) counts as one of its own, as in the sample's metadata.
            batch["mixed_versions"].append(len(set(versions)) > 1)
            batch["staleness"].append(version - min(known) if version is not None and known else None)
            for k, v in e.facts().items():
                batch[k].append(v)
        return batch


_FENCE_CALLBACK: Any = None


def _fence_callback(rollouts: AresRollouts) -> Any:
    """A ``transformers.TrainerCallback`` that pauses ``rollouts``' sampling around each optimizer step."""
    global _FENCE_CALLBACK
    if _FENCE_CALLBACK is None:
        from transformers import TrainerCallback

        class AresSamplingFence(TrainerCallback):  # type: ignore[misc]
            """Pauses the episodes' sampling (drain) before each optimizer step and resumes it after,
            with the new weights' version (``global_step + 1``: the trainer counts the step after this)."""

            def __init__(self, owner: AresRollouts) -> None:
                self.owner = owner

            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.owner._pause()

            def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.owner._resume(int(state.global_step) + 1)

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.owner._cancel_next()  # episodes for a call that will not come

        _FENCE_CALLBACK = AresSamplingFence
    return _FENCE_CALLBACK(rollouts)


def _default_tokenizer() -> str:
    from ares_gateway.tokens.tokenizer import default_model_path

    return default_model_path()


def rollout_func(
    dataset: Any,
    *,
    episode: EpisodeConfig | None = None,
    run: RunConfig | None = None,
    tokenizer: str | None = None,
    renderer: str | None = None,
    max_tokens: int = 512,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    check_tokenizer: bool = True,
    max_completion_tokens: int | None = None,
    engine_host: str = "127.0.0.1",
    engine_port: int = 0,
    engine_server_options: Mapping[str, Any] | None = None,
    overlap: bool = False,
    fence_timeout: float | None = 600.0,
    max_staleness: int | None = None,
    drop_group_on_infra_error: bool = False,
    **settings: Any,
) -> AresRollouts:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` (see the module docstring).

    Args:
        dataset: the task dataset the prompts name (a registered name such as ``"examples"``, a folder, or
            a :class:`~ares_gateway.episodes.tasks.Dataset`); an empty one is an error.
        episode: what each episode runs (:class:`~ares_gateway.episodes.config.EpisodeConfig`; default:
            ``mini-swe-agent`` in a ``local`` sandbox, 20 LLM calls). mini-swe-agent gets
            ``action_format="text"`` by itself for a model without a tool-call format.
        run: how the episodes run (:class:`~ares_gateway.episodes.config.RunConfig`): ``concurrency``,
            ``out`` (each call's run files go to ``out/step-N/``), ``executor``, ``warm``, ``retries``;
            ``attempts`` stays 1 (TRL repeats each prompt ``num_generations`` times). An ``executor``
            whose ``kind`` is not ``"local"`` (:class:`~ares_gateway.episodes.ray.RayExecutor`) runs the
            episodes elsewhere: the engine is then served over HTTP and the executor's workers sample
            ``trainer.model`` through it; ``concurrency`` still caps the episodes at once (give it nodes x
            ``per_node``). With an ``executor``, give it its own ``warm``.
        tokenizer: the model's ``.gguf`` file or Hugging Face folder the gateway renders with (default:
            the embedded SmolLM2 GGUF); checked against ``trainer.processing_class`` on the first call.
        renderer: a ``renderers`` name (default: by model name, else the model's chat template).
        max_tokens / temperature / top_p / top_k / seed: sampling of each turn. Keep ``temperature=1.0``
            and no top-k/top-p for the logprobs to be the model's own (what GRPO's ratio assumes).
        check_tokenizer: refuse a trainer whose tokenizer gives other ids than the gateway's.
        max_completion_tokens: cut each completion (ids, logprobs, mask) to this many tokens (``None``: whole
            episodes; TRL does not cut what a rollout function returns). A cut entry has ``truncated`` True.
        engine_host / engine_port: where the engine is served for such an executor (default: 127.0.0.1, a
            free port). On a real cluster give the trainer machine's address that the nodes reach.
        engine_server_options: more :class:`~ares_gateway.engines.engine_server.EngineServer` options (its
            limits).
        overlap: run the next training call's episodes while the trainer trains on this call's (see the
            module docstring): each optimizer step is fenced (no turn sampled while the weights change) and
            entries sampled before an update have ``staleness`` 1. Needs the model without dropout
            (``GRPOConfig(disable_dropout=True)``) and no ``executor``.
        fence_timeout: under ``overlap``, the seconds a pause may wait for the turns being sampled before an
            optimizer step (``None``: no limit); longer is a ``DrainTimeoutError`` from the step.
        max_staleness: mask (``env_mask`` 0, logprobs 0.0) each sampled response whose weights' version is
            more than this many versions behind the trainer's step at the call that trains on it, and leave
            its span out of ``policy_versions`` (``None``: no bound; ``0``: only the current weights' tokens
            are trained). Meaningful with ``overlap`` (without it every turn of a call is sampled at the
            call's step); needs no ``executor`` (the versions are the rollouts' own gateway's).
        drop_group_on_infra_error: exclude every episode of a group (the call's episodes of one task) that
            holds an ``infra_error`` one: all masked, reward 0 (no advantage); default: only that episode,
            with its group's mean judged reward.
    """
    require("torch", "trl")
    require("transformers", "trl")
    episode, run = configs_from(
        "rollout_func", episode, run, settings,
        episode_default={"harness": "mini-swe-agent", "sandbox": "local", "step_limit": 20})
    return AresRollouts(
        dataset, episode=episode, run=run, tokenizer=tokenizer, renderer=renderer,
        sampling={"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                  "seed": seed},
        check_tokenizer=check_tokenizer, max_completion_tokens=max_completion_tokens,
        engine_host=engine_host, engine_port=engine_port, engine_server_options=engine_server_options,
        overlap=overlap, fence_timeout=fence_timeout, max_staleness=max_staleness,
        drop_group_on_infra_error=drop_group_on_infra_error,
    )


def reward_from_episode(completions: Sequence[Any] | None = None, *, reward: Sequence[float] | None = None,
                        log_extra: Callable[[str, list[Any]], None] | None = None,
                        **facts: Any) -> list[float]:
    """A TRL reward function: each completion's episode reward (the task verifier's), as the rollout
    returned it. Logs ``task``, ``session_id``, ``exit_reason``, ``turns``, ``error``, ``other_samples``,
    ``foreign_samples``, ``first_version``, ``last_version`` and ``staleness`` as completion-table columns."""
    if reward is None:
        raise TrainerError("reward_from_episode needs the rollout's 'reward' column: use it with "
                           "ares_gateway.trainers.trl.rollout_func")
    if log_extra is not None:
        for key in ("task", "session_id", "exit_reason", "turns", "error", "other_samples", "foreign_samples",
                    "first_version", "last_version", "staleness"):
            if key in facts:
                log_extra(key, list(facts[key]))
    return [float(r) for r in reward]
