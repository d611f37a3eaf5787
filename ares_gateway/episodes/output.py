"""What a run writes and shows: results.json, episodes.jsonl, trajectories, turn logs, agent logs,
TensorBoard scalars, the live progress bar, and the final table.

Outputs in a run's ``out`` directory::

    results.json                      run settings, summary (mean reward, pass@k), one entry per episode
    episodes.jsonl                    the same entries, appended as episodes finish
    trajectories/<task>.<attempt>.jsonl   training samples (token-recorded turns only)
    turns/<task>.<attempt>.jsonl          the raw turn log (request as sent, completion, timing)
    logs/<task>.<attempt>/            the agent's stdout.log / stderr.log, its own artifacts, verifier.log
    workspaces/<task>.<attempt>.tar   the agent's final workdir, as graded (episodes.workspaces)
    tb/                               TensorBoard event files (episode reward, turns, durations, latency)

Everything here runs where the run is driven (the scheduler's process), whichever executor ran the
episodes: an episode comes back as an :class:`~ares_gateway.episodes.driver.EpisodeRecord` and is
written here.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ares_gateway.episodes.failures import classify
from ares_gateway.episodes.result import EpisodeResult
from ares_gateway.episodes.stats import StatTracker
from ares_gateway.episodes.usage import run_usage

if TYPE_CHECKING:
    from rich.table import Table  # imported where a table is made (start-up time)

__all__ = [
    "FAILED_REASONS",
    "EpisodeResult",
    "Progress",
    "RunOutputs",
    "RunSummary",
    "episode_key",
    "episode_line",
    "log_episode",
    "pass_at_k",
    "results_table",
    "summary_lines",
    "write_failed_run",
]

#: Exit reasons counted as failures in the progress bar (the run could not judge the agent); which are
#: the infrastructure's and which the agent's: :mod:`ares_gateway.episodes.failures`.
FAILED_REASONS = frozenset({"agent_error", "install_error", "sandbox_error", "error", "infra_error"})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one task: ``n`` attempts of which ``c`` passed."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class RunSummary:
    """What a run did: finished episodes, the ones cancelled, mean reward and pass@k."""

    episodes: list[EpisodeResult]
    planned: int
    attempts: int
    cancelled: list[str] = field(default_factory=list)
    interrupted: bool = False
    duration: float = 0.0
    success_threshold: float = 1.0
    out: Path | None = None

    @property
    def mean_reward(self) -> float | None:
        if not self.episodes:
            return None
        return sum(e.reward for e in self.episodes) / len(self.episodes)

    @property
    def pass_at_k(self) -> dict[str, float]:
        """``pass@k`` for k = 1..attempts over tasks whose every attempt finished (reward >= threshold
        passes)."""
        by_task: dict[str, list[EpisodeResult]] = {}
        for e in self.episodes:
            by_task.setdefault(e.task, []).append(e)
        complete = {t: eps for t, eps in by_task.items() if len(eps) == self.attempts}
        if not complete:
            return {}
        out = {}
        for k in range(1, self.attempts + 1):
            scores = [pass_at_k(len(eps), sum(e.reward >= self.success_threshold for e in eps), k)
                      for eps in complete.values()]
            out[f"pass@{k}"] = sum(scores) / len(scores)
        return out

    @property
    def exit_reasons(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.episodes:
            counts[e.exit_reason] = counts.get(e.exit_reason, 0) + 1
        return counts

    @property
    def networks(self) -> dict[str, int]:
        """How many episodes' sandboxes were networked each way (``EpisodeResult.network``)."""
        counts: dict[str, int] = {}
        for e in self.episodes:
            if e.network:
                counts[e.network] = counts.get(e.network, 0) + 1
        return counts

    @property
    def infra_failures(self) -> int:
        """Episodes that ended as ``infra_error`` (every try failed by the infrastructure; not trained on)."""
        return sum(1 for e in self.episodes if e.exit_reason == "infra_error")

    @property
    def agent_failures(self) -> int:
        """Episodes the agent failed (:func:`~ares_gateway.episodes.failures.classify`); never retried."""
        return sum(1 for e in self.episodes if classify(e) == "agent")

    @property
    def retries(self) -> int:
        """Infrastructure failures retried, over all episodes."""
        return sum(e.retries for e in self.episodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "planned": self.planned,
            "finished": len(self.episodes),
            "cancelled": list(self.cancelled),
            "interrupted": self.interrupted,
            "mean_reward": self.mean_reward,
            **self.pass_at_k,
            "success_threshold": self.success_threshold,
            "exit_reasons": self.exit_reasons,
            "infra_failures": self.infra_failures,
            "agent_failures": self.agent_failures,
            "retries": self.retries,
            "networks": self.networks,
            "usage": run_usage(e.usage for e in self.episodes),
            "duration_seconds": round(self.duration, 3),
            "episodes_per_minute": (
                round(len(self.episodes) / self.duration * 60, 3) if self.duration > 0 else None
            ),
        }


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _safe(name: str) -> str:
    return _SAFE.sub("_", name)[:120] or "task"


def episode_key(task: str, attempt: int) -> str:
    """``<task>.<attempt>`` with the task's name made safe for a file name: how an episode's files are
    named in the run directory (``turns/``, ``trajectories/``, ``logs/``, ``workspaces/``)."""
    return f"{_safe(task)}.{attempt}"


class RunOutputs:
    """Writes a run's files (see the module docstring); every write is small and synchronous."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
            (root / "episodes.jsonl").touch()

    def episode(self, result: EpisodeResult, samples: list[Any], turns: list[dict[str, Any]],
                logs: Mapping[str, str]) -> None:
        if self.root is None:
            return
        key = episode_key(result.task, result.attempt)
        traj = self.root / "trajectories"
        traj.mkdir(exist_ok=True)
        with open(traj / f"{key}.jsonl", "w", encoding="utf-8") as fh:
            for sample in samples:
                fh.write(json.dumps(sample.to_dict()) + "\n")
        turns_dir = self.root / "turns"
        turns_dir.mkdir(exist_ok=True)
        with open(turns_dir / f"{key}.jsonl", "w", encoding="utf-8") as fh:
            for turn in turns:
                fh.write(json.dumps(turn, default=str) + "\n")
        if logs:
            log_dir = self.root / "logs" / key
            log_dir.mkdir(parents=True, exist_ok=True)
            for name, text in logs.items():
                (log_dir / _safe(name)).write_text(text, encoding="utf-8")
        with open(self.root / "episodes.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(result.to_dict()) + "\n")

    def results(self, run: Mapping[str, Any], summary: RunSummary, *, error: str | None = None) -> None:
        if self.root is None:
            return
        doc: dict[str, Any] = {"run": dict(run), "summary": summary.to_dict(),
                               "episodes": [e.to_dict() for e in summary.episodes]}
        if error is not None:
            doc["error"] = error  # the run stopped before its episodes (a failed start-up check)
        tmp = self.root / "results.json.tmp"
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.root / "results.json")


class Progress:
    """The live progress bar (rich) and the per-episode lines; a no-op without a console.

    On a console that is no terminal (output to a file or a pipe, as in CI) a live bar would show
    nothing until the end, so progress is a plain line instead, printed whenever what it says
    changes (an episode started or finished) and at least every ``heartbeat`` seconds.
    """

    def __init__(self, console: Any, total: int, title: str, *, heartbeat: float = 30.0) -> None:
        self.console = console
        self.total = total
        self.title = title
        self.heartbeat = heartbeat
        self._bar: Any = None
        self._id: Any = None
        self._plain = console is not None and not console.is_terminal
        self._last_state: tuple[Any, ...] | None = None
        self._last_at = 0.0
        self._started = time.monotonic()
        if console is None or self._plain:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("running {task.fields[running]} · failed {task.fields[failed]} · "
                       "mean reward {task.fields[mean]} · {task.fields[tps]} turns/s"),
            TimeElapsedColumn(),
            console=console,
        )
        self._id = self._bar.add_task(title, total=total, running=0, failed=0, mean="-", tps="0.0")
        self._bar.start()

    def update(self, *, done: int, running: int, failed: int, mean: float | None, turns_per_s: float) -> None:
        if self._plain:
            state = (done, running, failed, mean)
            now = time.monotonic()
            if state != self._last_state or now - self._last_at >= self.heartbeat:
                self._last_state, self._last_at = state, now
                elapsed = int(now - self._started)
                self.line(f"{self.title}: {done}/{self.total} done · running {running} · failed {failed} "
                          f"· mean reward {'-' if mean is None else f'{mean:.3f}'} · {turns_per_s:.1f} "
                          "turns/s · "
                          f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}")
            return
        if self._bar is None:
            return
        self._bar.update(self._id, completed=done, running=running, failed=failed,
                         mean="-" if mean is None else f"{mean:.3f}", tps=f"{turns_per_s:.1f}")

    def line(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def write_failed_run(out: str | os.PathLike[str], run: Mapping[str, Any], *, planned: int, attempts: int,
                     error: str) -> None:
    """``results.json`` (and an empty ``episodes.jsonl``) of a run that stopped before any episode, with
    its one-line ``error``; what ``ares-gateway run`` writes when a start-up check fails."""
    RunOutputs(Path(out)).results(
        run, RunSummary(episodes=[], planned=planned, attempts=attempts), error=error
    )


def results_table(summary: RunSummary) -> Table:
    """A rich Table of the episodes (task, attempt, reward, turns, duration, exit reason)."""
    from rich.table import Table

    table = Table(title="episodes", show_lines=False)
    for name, justify in (("task", "left"), ("attempt", "right"), ("reward", "right"), ("turns", "right"),
                          ("duration", "right"), ("exit reason", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for e in sorted(summary.episodes, key=lambda e: (e.task, e.attempt)):
        reason = e.exit_reason + (f": {e.error[:300]}" if e.error else "")
        table.add_row(e.task, str(e.attempt), f"{e.reward:.3f}", str(e.turns), f"{e.duration:.1f}s", reason)
    for key in summary.cancelled:
        task, _, attempt = key.rpartition(".")
        table.add_row(task, attempt, "-", "-", "-", "cancelled")
    return table


def summary_lines(summary: RunSummary) -> list[str]:
    mean = summary.mean_reward
    lines = [
        f"episodes: {len(summary.episodes)} finished of {summary.planned}"
        + (f", {len(summary.cancelled)} cancelled (interrupted)" if summary.interrupted else "")
        + f" in {summary.duration:.1f}s",
        "mean reward: " + ("-" if mean is None else f"{mean:.3f}"),
    ]
    pk = summary.pass_at_k
    if pk:
        lines.append(", ".join(f"{k}: {v:.3f}" for k, v in pk.items())
                     + f" (reward >= {summary.success_threshold:g} passes)")
    if summary.infra_failures or summary.retries:
        lines.append(f"infrastructure failures: {summary.infra_failures} episode(s) failed every try (not "
                     f"trained on), {summary.retries} retried")
    if summary.exit_reasons:
        lines.append(
            "exit reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.exit_reasons.items()))
        )
    if any(n != "relay" for n in summary.networks):  # say so when a sandbox could reach more than its session
        lines.append("networks: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.networks.items())))
    return lines


def log_episode(tracker: StatTracker, step: int, e: EpisodeResult, summary: RunSummary) -> None:
    """One finished episode's scalars for TensorBoard (or another tracker)."""
    tracker.log(step, **{  # type: ignore[arg-type]
        "episode/reward": e.reward,
        "episode/turns": e.turns,
        "episode/duration_s": e.duration,
        "episode/setup_s": e.setup_seconds,
        "episode/agent_s": e.agent_seconds,
        "episode/verify_s": e.verify_seconds,
        "episode/truncated": e.truncated,
        "episode/failed": e.exit_reason in FAILED_REASONS,
        "gateway/answer_latency_s": e.answer_latency,
        **{f"usage/{k}": v for k, v in (e.usage or {}).items()},
        "run/mean_reward": summary.mean_reward,
    })


def episode_line(e: EpisodeResult) -> str:
    """The progress line of one finished episode (rich markup)."""
    from rich.markup import escape

    mark = (
        "[green]✓[/]" if e.reward >= 1.0
        else ("[red]✗[/]" if e.exit_reason in FAILED_REASONS else "[yellow]·[/]")
    )
    text = (f"{mark} {escape(e.task)} #{e.attempt}: reward {e.reward:.3f}, {e.turns} turns, "
            f"{e.duration:.1f}s, {e.exit_reason}")
    if e.error:
        text += f" ({escape(e.error[:300])})"
    return text
