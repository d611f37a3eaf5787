"""What a run's episodes run and how the run runs them: :class:`EpisodeConfig` and :class:`RunConfig`.

Every entry point that plays task episodes takes these two values: :func:`~ares_gateway.episodes.rollouts.
run_rollouts`, the streaming :class:`~ares_gateway.episodes.stream.RolloutSource`, the trainer adapters
(:func:`~ares_gateway.trainers.trl.rollout_func`, :func:`~ares_gateway.trainers.episodes.play_episodes`,
verl's, SkyRL's and OpenEnv's) and ``ares-gateway run``, which builds them from its flags::

    episode = EpisodeConfig("mini-swe-agent", sandbox="docker", step_limit=30)
    run = RunConfig(concurrency=8, attempts=4, out="runs/x")
    summary = await run_rollouts(tasks, policy=policy, episode=episode, run=run)

Each setting is declared and checked once (:class:`EpisodeConfig` in
:mod:`~ares_gateway.episodes.episode_spec`, beside the planned episode that holds it; re-exported here);
a bad value is a ``ValueError`` when the config is made, before any sandbox starts. Both are frozen:
derive a variant with :func:`dataclasses.replace`.

The entry points still take the settings as flat keyword arguments (``harness=``, ``concurrency=``, ...)
for one release, with a ``DeprecationWarning`` (:func:`configs_from`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ares_gateway.episodes.episode_spec import EpisodeConfig
from ares_gateway.episodes.failures import DEFAULT_RETRIES, DEFAULT_RETRY_BACKOFF, check_retries
from ares_gateway.episodes.warm import check_warm

if TYPE_CHECKING:
    from ares_gateway.episodes.executor import Executor

__all__ = ["EpisodeConfig", "RunConfig", "check_count", "configs_from"]


def check_count(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is an integer (not a bool) of at least ``minimum``
    (or ``None``, with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}"
                         + (" or None" if allow_none else "") + f", got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    """How a run plays its episodes: how many at once, how often each task, where, what it writes.

    Args:
        concurrency: episodes at once.
        attempts: episodes of each task (pass@k's k).
        out: the run's output folder (results.json, episodes.jsonl, trajectories, logs, TensorBoard);
            ``None``: nothing written.
        executor: where the episodes run (:class:`~ares_gateway.episodes.executor.LocalExecutor` of
            ``concurrency`` slots by default; a :class:`~ares_gateway.episodes.ray.RayExecutor` runs them
            on a Ray cluster).
        warm: how many of the next episodes are set up ahead (sandbox started, agent installed) while
            earlier ones run (:mod:`~ares_gateway.episodes.warm`); an ``executor`` takes its own.
        retries: how many times an episode the infrastructure failed is run again on a fresh sandbox
            (:mod:`~ares_gateway.episodes.failures`); the first after ``retry_backoff`` seconds, each next
            one after twice as long.
        save_workspaces: keep each episode's final workdir, as graded, under ``OUT/workspaces/`` (with
            ``out``; ``ares-gateway reverify OUT`` grades them again). ``None``: the entry point's default,
            on for :func:`~ares_gateway.episodes.rollouts.run_rollouts` and ``run``, off for the trainer
            adapters (a training run plays many episodes, each archive may be as large as the grading
            cap, and a trainer's calls may share one ``out``).
        stats / stats_period: the scalar tracker (``tensorboard`` under ``OUT/tb``, ``logging``,
            ``null``; ``None``: the entry point's default, ``tensorboard`` for a run, ``null`` for the
            trainer adapters) and how often it flushes, in seconds (0: at once).
        success_threshold: the reward at or above which an episode counts as solved (pass@k).
    """

    concurrency: int = 4
    attempts: int = 1
    out: str | os.PathLike[str] | None = None
    executor: Executor | None = None
    warm: int = 0
    retries: int = DEFAULT_RETRIES
    retry_backoff: float = DEFAULT_RETRY_BACKOFF
    save_workspaces: bool | None = None
    stats: str | None = None
    stats_period: float = 10.0
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        check_count("concurrency", self.concurrency)
        check_count("attempts", self.attempts)
        check_retries(self.retries, self.retry_backoff)
        if check_warm(self.warm) and self.executor is not None:
            raise ValueError(
                "warm with an executor: pass warm= to the executor instead, which sets up its own episodes "
                "ahead (pass warm= to it (RayExecutor(warm=...), LocalExecutor(warm=...)); RunConfig's warm "
                "is for the default executor)")
        if not self.stats_period >= 0:
            raise ValueError(f"stats_period must be 0 or more seconds (0: every scalar at once), "
                             f"got {self.stats_period!r}")

    def resolved(self, *, save_workspaces: bool, stats: str) -> RunConfig:
        """This config with the entry point's defaults for what it left ``None``."""
        return dataclasses.replace(
            self, save_workspaces=save_workspaces if self.save_workspaces is None else self.save_workspaces,
            stats=stats if self.stats is None else self.stats)


_EPISODE_FIELDS = frozenset(f.name for f in fields(EpisodeConfig))
_RUN_FIELDS = frozenset(f.name for f in fields(RunConfig))


def configs_from(where: str, episode: EpisodeConfig | None, run: RunConfig | None,
                 settings: Mapping[str, Any], *,
                 episode_default: Mapping[str, Any] | None = None) -> tuple[EpisodeConfig, RunConfig]:
    """``episode`` and ``run`` (default: ``RunConfig()``) with the flat keyword arguments ``settings`` of
    the entry point ``where`` applied over them (each such argument warns: it is deprecated), and
    ``episode_default`` (the entry point's own defaults) where no ``episode`` is given.

    Raises ``TypeError`` for a name that is neither config's field, and for no harness at all."""
    unknown = sorted(set(settings) - _EPISODE_FIELDS - _RUN_FIELDS)
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    if settings:
        warnings.warn(
            f"{where}({', '.join(f'{k}=' for k in settings)}) is deprecated: pass episode=EpisodeConfig(...) "
            "and run=RunConfig(...) (ares_gateway.EpisodeConfig, ares_gateway.RunConfig)",
            DeprecationWarning, stacklevel=3)
    ep_settings = {k: v for k, v in settings.items() if k in _EPISODE_FIELDS}
    run_settings = {k: v for k, v in settings.items() if k in _RUN_FIELDS}
    if episode is None:
        merged = {**dict(episode_default or {}), **ep_settings}
        if "harness" not in merged:
            raise TypeError(f"{where}() needs episode=EpisodeConfig(harness=...): which agent CLI to run")
        episode = EpisodeConfig(**merged)
    elif ep_settings:
        episode = dataclasses.replace(episode, **ep_settings)
    base = run if run is not None else RunConfig()
    if run_settings:
        base = dataclasses.replace(base, **run_settings)
    return episode, base
