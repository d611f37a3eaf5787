"""Many task episodes at once: bounded concurrency, K attempts, results, live progress, outputs.

:func:`run_rollouts` is what ``ares-gateway run`` and ``ares-gateway demo`` call::

    summary = await run_rollouts(tasks, policy=make_policy("oracle"),
                                 episode=EpisodeConfig("mini-swe-agent", sandbox="local"),
                                 run=RunConfig(concurrency=4, attempts=2, out="runs/x"))
    summary.mean_reward, summary.pass_at_k

It composes three parts, each in its own module:

* the **scheduler** (:mod:`~ares_gateway.episodes.scheduler`): which planned episode runs when, at most
  ``concurrency`` at once, and stopping;
* an **executor** (:mod:`~ares_gateway.episodes.executor`): where each episode runs and how, through the
  **episode driver** (:mod:`~ares_gateway.episodes.driver`: a :class:`~ares_gateway.GatewayEnv` over a
  fresh sandbox driven by the policy in process, or, with the ``http`` policy, the agent started while
  its requests stay parked for an external trainer on ``/poll``); :class:`LocalExecutor` by default;
* **output** (:mod:`~ares_gateway.episodes.output`): results.json, episodes.jsonl, trajectories, turn
  logs, agent logs, TensorBoard, the progress bar; written by :class:`RunWriter` as each episode's record
  comes back (the streaming rollout source, :mod:`~ares_gateway.episodes.stream`, writes through it too).

Stopping (:class:`asyncio.Event` ``stop``, which the CLI sets on Ctrl-C): no new episode is launched,
running episodes are cancelled (each removes its sandbox), and the results of finished ones are written.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ares_gateway.episodes.config import EpisodeConfig, RunConfig, configs_from
from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec
from ares_gateway.episodes.executor import Executor, LocalExecutor, start_executor
from ares_gateway.episodes.installs import ensure_local_install
from ares_gateway.episodes.output import (
    FAILED_REASONS,
    EpisodeResult,
    Progress,
    RunOutputs,
    RunSummary,
    episode_line,
    log_episode,
    pass_at_k,
    results_table,
    summary_lines,
    write_failed_run,
)
from ares_gateway.episodes.scheduler import ScheduleState, schedule
from ares_gateway.episodes.stats import StatTracker, make_tracker
from ares_gateway.episodes.tasks import Task
from ares_gateway.episodes.workspaces import workspace_file
from ares_gateway.gateway import Gateway
from ares_gateway.policies.base import Policy

__all__ = [
    "FAILED_REASONS",
    "EpisodeConfig",
    "EpisodeResult",
    "RunConfig",
    "RunSummary",
    "RunWriter",
    "ensure_local_install",
    "pass_at_k",
    "results_table",
    "run_rollouts",
    "summary_lines",
    "write_failed_run",
]

async def run_rollouts(
    tasks: Sequence[Task],
    *,
    policy: Policy,
    episode: EpisodeConfig | None = None,
    run: RunConfig | None = None,
    console: Any = None,
    stop: asyncio.Event | None = None,
    gateway: Gateway | None = None,
    run_info: Mapping[str, Any] | None = None,
    on_episode: Callable[[EpisodeResult], None] | None = None,
    on_samples: Callable[[EpisodeResult, list[Any]], None] | None = None,
    **settings: Any,
) -> RunSummary:
    """Run ``run.attempts`` episodes of every task, each as ``episode`` says, at most ``run.concurrency``
    at once (see the module docstring and :mod:`~ares_gateway.episodes.config`).

    ``policy`` answers every request in process (``scripted`` / ``oracle`` policies are bound to each
    episode's session, agent and task); an external one (``http``) leaves them for ``/poll``.
    ``run.executor`` runs the episodes (default: a :class:`LocalExecutor` of ``run.concurrency`` slots on
    ``gateway``, a started gateway, or by default its own on 127.0.0.1 with the harness's side-call
    detector). ``console`` (a ``rich.console.Console``) shows the live progress bar and a line per
    finished episode. Setting ``stop`` stops launching, cancels what runs (each episode removes its
    sandbox) and returns what finished. ``on_samples(result, samples)`` is called with each episode's
    :class:`trajectory.Sample` list as it finishes (the trainer adapters take their samples here,
    without files). An episode that failed by the infrastructure (:mod:`~ares_gateway.episodes.failures`)
    is run again on a fresh sandbox, at most ``run.retries`` times; if every try failed it ends as
    ``infra_error``. ``run_info``: more keys for ``results.json``'s run settings.

    ``settings``: the fields of :class:`EpisodeConfig` and :class:`RunConfig` as keyword arguments
    (``harness=``, ``concurrency=``, ...), deprecated.
    """
    episode, run = configs_from("run_rollouts", episode, run, settings)
    run = run.resolved(save_workspaces=True, stats="tensorboard")
    if run.executor is not None and gateway is not None:
        raise ValueError("pass gateway= or executor=, not both (an executor brings its own gateways)")
    executor = run.executor if run.executor is not None else LocalExecutor(
        concurrency=run.concurrency, gateway=gateway, warm=run.warm)
    stop = stop or asyncio.Event()
    keep = _absolute(run.out) if run.out is not None and run.save_workspaces else None
    plan = [EpisodeSpec(task, attempt, episode, workspace=(
                str(keep / workspace_file(task.name, attempt)) if keep is not None else None))
            for attempt in range(run.attempts) for task in tasks]
    settings_row = {
        "harness": episode.harness, "sandbox": episode.sandbox, "concurrency": run.concurrency,
        "attempts": run.attempts, "step_limit": episode.step_limit, "time_limit": episode.time_limit,
        "tasks": [t.name for t in tasks], "policy": type(policy).__name__, "executor": executor.kind,
        "retries": run.retries, "save_workspaces": keep is not None, "image": episode.image,
        "warm": getattr(executor, "warm", 0), **dict(run_info or {}),
    }
    writer = RunWriter(executor, settings_row, out=run.out, planned=len(plan), attempts=run.attempts,
                       success_threshold=run.success_threshold, stats=run.stats or "null",
                       stats_period=run.stats_period, console=console,
                       title=f"{episode.harness}: {len(tasks)} task(s)", on_episode=on_episode,
                       on_samples=on_samples)
    state = ScheduleState()
    try:
        await start_executor(executor, tasks=tasks, policy=policy, episode=episode)
        expect = getattr(executor, "expect", None)
        if expect is not None:
            expect(plan)
        writer.started()
        await schedule(plan, executor, concurrency=run.concurrency, stop=stop, on_record=writer.record,
                       on_tick=writer.refresh, tick=0.5 if console is not None else None, state=state,
                       retries=run.retries, retry_backoff=run.retry_backoff)
    finally:
        writer.finish(state)
        await executor.close()
    return writer.summary


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(path))


class RunWriter:
    """What a run writes and shows as its episodes come back, in one place for :func:`run_rollouts` and
    the streaming rollout source (:class:`~ares_gateway.episodes.stream.RolloutSource`): the OUT
    directory (:class:`~ares_gateway.episodes.output.RunOutputs`), the stats tracker (TensorBoard under
    ``OUT/tb``, the fences' drain and pause times included), the progress bar and the
    :class:`RunSummary`. Used as: :meth:`started` once the executor has started, :meth:`record` per
    finished episode, :meth:`finish` once (writes ``results.json``; also after a failed start)."""

    def __init__(self, executor: Executor, run: Mapping[str, Any], *, out: str | os.PathLike[str] | None,
                 planned: int, attempts: int, success_threshold: float = 1.0, stats: str = "tensorboard",
                 stats_period: float = 10.0, console: Any = None, title: str = "",
                 on_episode: Callable[[EpisodeResult], None] | None = None,
                 on_samples: Callable[[EpisodeResult, list[Any]], None] | None = None) -> None:
        root = Path(out) if out is not None else None
        self.executor = executor
        self.run = dict(run)
        self.outputs = RunOutputs(root)
        self.tracker: StatTracker = make_tracker("null")
        if stats != "null" and not (stats == "tensorboard" and root is None):
            self.tracker = make_tracker(stats, logdir=root / "tb" if root is not None else None,
                                        period=stats_period)
        self.summary = RunSummary(episodes=[], planned=planned, attempts=attempts,
                                  success_threshold=success_threshold, out=root)
        self.progress = Progress(console, planned, title)
        self.on_episode = on_episode
        self.on_samples = on_samples
        self.failed = 0
        self._started = time.monotonic()
        self._answered_at_start = 0
        self._fenced_gateway: Any = None
        self._finished = False

    def started(self) -> None:
        """The executor has started: count turns from here, say where requests wait, and listen to the
        weight-update fence of its gateway (where it has one in this process)."""
        self._answered_at_start = self.executor.turns_answered()
        gw = getattr(self.executor, "gateway", None)
        if gw is not None and hasattr(gw, "fence_listeners"):
            gw.fence_listeners.append(self._fenced)
            self._fenced_gateway = gw
        for line in self.executor.describe():
            self.progress.line(line)

    def refresh(self, running: int) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        self.progress.update(done=len(self.summary.episodes), running=running, failed=self.failed,
                             mean=self.summary.mean_reward,
                             turns_per_s=(self.executor.turns_answered() - self._answered_at_start) / elapsed)

    def record(self, rec: EpisodeRecord) -> None:
        """One finished episode: its files, the callbacks, the summary, its scalars and progress line."""
        result = rec.result
        self.outputs.episode(result, rec.samples, rec.turns, rec.logs)
        if self.on_samples is not None:
            self.on_samples(result, rec.samples)
        self.summary.episodes.append(result)
        if result.exit_reason in FAILED_REASONS:
            self.failed += 1
        log_episode(self.tracker, len(self.summary.episodes), result, self.summary)
        self.progress.line(episode_line(result))
        if self.on_episode is not None:
            self.on_episode(result)

    def _fenced(self, kind: str, scalars: dict[str, float]) -> None:
        # A weight-update fence during the run: its drain and pause times, at the run's episode count.
        self.tracker.log(len(self.summary.episodes), **scalars)

    def finish(self, state: ScheduleState) -> None:
        """The run is over: the cancelled episodes, the final scalars, ``results.json`` (once)."""
        if self._finished:
            return
        self._finished = True
        if self._fenced_gateway is not None:
            self._fenced_gateway.fence_listeners.remove(self._fenced)
            self._fenced_gateway = None
        summary = self.summary
        summary.cancelled.extend(state.cancelled)
        summary.interrupted = state.interrupted
        summary.duration = time.monotonic() - self._started
        self.refresh(0)
        self.progress.stop()
        final: dict[str, Any] = {"run/mean_reward": summary.mean_reward,
                                 "run/episodes_per_minute": summary.to_dict()["episodes_per_minute"]}
        self.tracker.log(len(summary.episodes), **final)
        self.tracker.close()
        self.outputs.results(self.run, summary)
