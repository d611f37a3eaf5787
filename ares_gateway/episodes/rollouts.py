"""Many task episodes at once: bounded concurrency, K attempts, results, live progress, outputs.

:func:`run_rollouts` is what ``ares-gateway run`` and ``ares-gateway demo`` call::

    summary = await run_rollouts(tasks, harness="mini-swe-agent", policy=make_policy("oracle"),
                                 sandbox="local", concurrency=4, attempts=2, out="runs/x")
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

from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec
from ares_gateway.episodes.executor import Executor, LocalExecutor
from ares_gateway.episodes.failures import DEFAULT_RETRIES, DEFAULT_RETRY_BACKOFF, check_retries
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
    "EpisodeResult",
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
    harness: str,
    policy: Policy,
    sandbox: str = "auto",
    concurrency: int = 4,
    attempts: int = 1,
    out: str | os.PathLike[str] | None = None,
    step_limit: int | None = None,
    time_limit: float | None = None,
    image: str | None = None,
    model: str = "ares-policy",
    harness_options: Mapping[str, Any] | None = None,
    stats: str = "tensorboard",
    stats_period: float = 10.0,
    console: Any = None,
    stop: asyncio.Event | None = None,
    gateway: Gateway | None = None,
    executor: Executor | None = None,
    run_info: Mapping[str, Any] | None = None,
    success_threshold: float = 1.0,
    on_episode: Callable[[EpisodeResult], None] | None = None,
    on_samples: Callable[[EpisodeResult, list[Any]], None] | None = None,
    retries: int = DEFAULT_RETRIES,
    retry_backoff: float = DEFAULT_RETRY_BACKOFF,
    save_workspaces: bool = True,
    warm: int = 0,
) -> RunSummary:
    """Run ``attempts`` episodes of every task with at most ``concurrency`` at once (see the module
    docstring).

    ``policy`` answers every request in process (``scripted`` / ``oracle`` policies are bound to each
    episode's session, agent and task); an external one (``http``) leaves them for ``/poll``.
    ``executor`` runs the episodes (default: a :class:`LocalExecutor` of ``concurrency`` slots on
    ``gateway``, a started gateway, or by default its own on 127.0.0.1 with the harness's side-call
    detector). ``console`` (a ``rich.console.Console``) shows the live progress bar and a line per
    finished episode. Setting ``stop`` stops launching, cancels what runs (each episode removes its
    sandbox) and returns what finished. ``on_samples(result, samples)`` is called with each episode's
    :class:`trajectory.Sample` list as it finishes (the trainer adapters take their samples here,
    without files). An episode that failed by the infrastructure (:mod:`~ares_gateway.episodes.failures`)
    is run again on a fresh sandbox, at most ``retries`` times, the first after ``retry_backoff`` seconds
    and each next one after twice as long; if every try failed it ends as ``infra_error``.
    ``save_workspaces`` (with ``out``): each episode's final workdir, as graded, is kept as
    ``OUT/workspaces/<task>.<attempt>.tar`` (:mod:`~ares_gateway.episodes.workspaces`; ``ares-gateway
    reverify OUT`` grades them again). ``warm``: how many of the next episodes are set up ahead (their
    sandboxes started, the agent installed) while earlier ones run (:mod:`~ares_gateway.episodes.warm`;
    an executor passed in takes its own ``warm``).
    """
    check_retries(retries, retry_backoff)
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    if executor is not None and gateway is not None:
        raise ValueError("pass gateway= or executor=, not both (an executor brings its own gateways)")
    if executor is not None and warm:
        raise ValueError("pass warm= to the executor (LocalExecutor(warm=...), RayExecutor(warm=...)), "
                         "not to run_rollouts with executor=")
    executor = executor if executor is not None else LocalExecutor(concurrency=concurrency, gateway=gateway,
                                                                   warm=warm)
    stop = stop or asyncio.Event()
    options = dict(harness_options or {})
    keep = _absolute(out) if out is not None and save_workspaces else None
    plan = [EpisodeSpec(task, attempt, harness, options, sandbox=sandbox, image=image, model=model,
                        step_limit=step_limit, time_limit=time_limit,
                        workspace=(str(keep / workspace_file(task.name, attempt))
                                   if keep is not None else None))
            for attempt in range(attempts) for task in tasks]
    run = {
        "harness": harness, "sandbox": sandbox, "concurrency": concurrency, "attempts": attempts,
        "step_limit": step_limit, "time_limit": time_limit, "tasks": [t.name for t in tasks],
        "policy": type(policy).__name__, "executor": executor.kind, "retries": retries,
        "save_workspaces": keep is not None, "image": image, "warm": getattr(executor, "warm", 0),
        **dict(run_info or {}),
    }
    writer = RunWriter(executor, run, out=out, planned=len(plan), attempts=attempts,
                       success_threshold=success_threshold, stats=stats, stats_period=stats_period,
                       console=console, title=f"{harness}: {len(tasks)} task(s)", on_episode=on_episode,
                       on_samples=on_samples)
    state = ScheduleState()
    try:
        await executor.start(harness=harness, tasks=tasks, policy=policy, time_limit=time_limit,
                             sandbox=sandbox, image=image)
        expect = getattr(executor, "expect", None)
        if expect is not None:
            expect(plan)
        writer.started()
        await schedule(plan, executor, concurrency=concurrency, stop=stop, on_record=writer.record,
                       on_tick=writer.refresh, tick=0.5 if console is not None else None, state=state,
                       retries=retries, retry_backoff=retry_backoff)
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
