"""What one episode runs: :class:`EpisodeConfig` (the agent, its sandbox, its limits) and
:class:`EpisodeSpec` (one planned episode: a task, an attempt, and the run's :class:`EpisodeConfig`).

How a run runs its episodes (concurrency, attempts, output, executor) is
:class:`~ares_gateway.episodes.config.RunConfig`; both configs are re-exported from
:mod:`ares_gateway.episodes.config` and the package root.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ares_gateway.episodes.tasks import Task
from harnesses import BaseHarness, registry

__all__ = ["EpisodeConfig", "EpisodeSpec"]


@dataclass(frozen=True)
class EpisodeConfig:
    """What each episode runs, besides its task: the agent, its sandbox and its limits.

    Args:
        harness: the agent CLI (a :mod:`harnesses` registry name: ``mini-swe-agent``, ``claude-code``, ...).
        harness_options: more options for the harness (its constructor's keyword arguments).
        sandbox: the sandbox backend (``auto``: Docker where its engine answers, else ``local``).
        image: the image every episode's sandbox starts from (default: the task's own).
        model: the model name the agent is told to use (the policy answers whatever it asks).
        step_limit: LLM calls per episode (``None``: no limit).
        time_limit: seconds per episode (``None``: the task's own).
    """

    harness: str
    harness_options: Mapping[str, Any] = field(default_factory=dict)
    sandbox: str = "auto"
    image: str | None = None
    model: str = "ares-policy"
    step_limit: int | None = None
    time_limit: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.harness, str) or not self.harness:
            raise ValueError(
                f"harness must be a harness name such as 'mini-swe-agent', got {self.harness!r}")
        if not isinstance(self.sandbox, str) or not self.sandbox:
            raise ValueError(
                f"sandbox must be a backend name such as 'local' or 'docker', got {self.sandbox!r}")
        if self.step_limit is not None and (isinstance(self.step_limit, bool) or not isinstance(
                self.step_limit, int) or self.step_limit < 1):
            raise ValueError(f"step_limit must be a whole number of LLM calls, at least 1 (or None), "
                             f"got {self.step_limit!r}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(
                f"time_limit must be positive seconds (or None: the task's own), got {self.time_limit!r}")
        # A private copy: the caller's mapping may change after, and a frozen config must not.
        object.__setattr__(self, "harness_options", dict(self.harness_options or {}))

    def new_harness(self) -> BaseHarness:
        """A fresh harness for one episode: :attr:`harness` made with :attr:`harness_options`."""
        return registry.create(self.harness, **dict(self.harness_options))


@dataclass(frozen=True)
class EpisodeSpec:
    """One planned episode: which task, which attempt, and what it runs (:class:`EpisodeConfig`)."""

    task: Task
    attempt: int
    episode: EpisodeConfig
    #: Where the agent's final workdir is saved before its tests run (``OUT/workspaces/<task>.<attempt>.tar``,
    #: :mod:`~ares_gateway.episodes.workspaces`); ``None``: not saved.
    workspace: str | None = None

    @property
    def key(self) -> str:
        """``<task>.<attempt>``: the episode's name in the run's outputs."""
        return f"{self.task.name}.{self.attempt}"

    def new_harness(self) -> BaseHarness:
        return self.episode.new_harness()
