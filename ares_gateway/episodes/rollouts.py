"""Many task episodes at once: bounded concurrency, K attempts, results, live progress, outputs.

:func:`run_rollouts` is what ``ares-gateway run`` and ``ares-gateway demo`` call::

    summary = await run_rollouts(tasks, harness="mini-swe-agent", policy=make_policy("oracle"),
                                 sandbox="local", concurrency=4, attempts=2, out="runs/x")
    summary.mean_reward, summary.pass_at_k

Each episode is a :class:`~ares_gateway.GatewayEnv` over a fresh sandbox, driven by the policy in
process (``upstream``, ``scripted``, ``oracle``, any async callable); with the ``http`` policy the
requests stay parked for an external trainer on ``/poll`` and the episode waits for the agent.

Outputs in ``out``::

    results.json                      run settings, summary (mean reward, pass@k), one entry per episode
    episodes.jsonl                    the same entries, appended as episodes finish
    trajectories/<task>.<attempt>.jsonl   training samples (token-recorded turns only)
    turns/<task>.<attempt>.jsonl          the raw turn log (request as sent, completion, timing)
    logs/<task>.<attempt>/            the agent's stdout.log / stderr.log, its own artifacts, verifier.log
    tb/                               TensorBoard event files (episode reward, turns, durations, latency)

Stopping (:class:`asyncio.Event` ``stop``, which the CLI sets on Ctrl-C): no new episode is launched,
running episodes are cancelled (each removes its sandbox), and the results of finished ones are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ares_gateway.core.answers import ErrorAnswer
from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.errors import InvalidAnswerError
from ares_gateway.episodes.env import GatewayEnv
from ares_gateway.episodes.episode import (
    EpisodeOutcome,
    EpisodeSetupError,
    TaskEpisode,
    harness_side_call_detector,
    one_line,
)
from ares_gateway.episodes.stats import StatTracker, make_tracker
from ares_gateway.episodes.tasks import Task
from ares_gateway.gateway import Gateway
from ares_gateway.policies.base import PolicyError, call_policy, is_external
from harnesses import BaseHarness, registry
from harnesses.base import INSTALL_ROOT

log = logging.getLogger(__name__)

#: Exit reasons counted as failures in the progress bar (the run could not judge the agent).
FAILED_REASONS = frozenset({"agent_error", "install_error", "sandbox_error", "error"})


@dataclass
class EpisodeResult:
    """One finished episode, as written to ``results.json``."""

    task: str
    attempt: int
    reward: float
    turns: int
    duration: float
    exit_reason: str
    truncated: bool = False
    error: str | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    session_id: str = ""
    setup_seconds: float = 0.0
    agent_seconds: float = 0.0
    verify_seconds: float = 0.0
    answer_latency: float | None = None  # mean seconds a request of this episode waited for its answer
    #: The policy's per-episode report, where it has one (``tito``: turns, trained tokens, fresh renders,
    #: main-line drift; :meth:`~ares_gateway.policies.tito.TitoPolicy.episode_report`).
    fidelity: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return f"{self.task}.{self.attempt}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
        """``pass@k`` for k = 1..attempts over tasks whose every attempt finished (reward >= threshold passes)."""
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
            "duration_seconds": round(self.duration, 3),
            "episodes_per_minute": round(len(self.episodes) / self.duration * 60, 3) if self.duration > 0 else None,
        }


async def ensure_local_install(harness: str, *, version: str | None = None, quiet: bool = False) -> str:
    """Make the harness's CLI available to local sandboxes once, before many episodes start.

    Returns the install root to give the harness: ``/opt/ares-agents`` when it holds the pinned
    version or is writable (installed there now), else a per-user cache directory (which local
    sandboxes see read-only). The harness's own install steps do the work (in a non-isolated local
    sandbox as this user, as ``python3 -m harnesses.provision`` does); without this each isolated
    local sandbox would install its own copy. A failed install raises the harness's
    :class:`~harnesses.HarnessInstallError`, whose message names the step and its output.
    """
    probe = registry.create(harness, version=version)
    root = await asyncio.to_thread(_install_root, probe.name, probe.version)
    if root is not None:
        return root
    candidates = _install_candidates()
    root = next((r for r in candidates if _writable(r)), candidates[-1])
    if not quiet:
        print(f"installing {probe.name} {probe.version} under {root} (once; later runs reuse it) ...", flush=True)
    await _install_here(probe.name, probe.version, root)
    return root


async def _install_here(name: str, version: str, root: str) -> None:
    import uuid

    from harnesses import HarnessContext
    from sandbox import LocalSandbox, SandboxSpec

    async with LocalSandbox(SandboxSpec(), isolate=False) as sb:
        h = registry.create(name, version=version, user=None, install_root=root)
        ctx = HarnessContext(workdir=sb.workdir, session_id="install-" + uuid.uuid4().hex[:8],
                             base_url="http://127.0.0.1:9", token="unused")
        await h.prepare(sb, ctx)
        await h.install(sb)


def _install_candidates() -> list[str]:
    return [INSTALL_ROOT, os.path.join(os.path.expanduser("~"), ".cache", "ares-gateway", "agents")]


def _install_root(name: str, version: str) -> str | None:
    for root in _install_candidates():
        if os.path.isfile(os.path.join(root, name, version, ".ares-complete")):
            return root
    return None


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _safe(name: str) -> str:
    return _SAFE.sub("_", name)[:120] or "task"


class _Outputs:
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
        key = _safe(result.task) + f".{result.attempt}"
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


class _Progress:
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
                self.line(f"{self.title}: {done}/{self.total} done · running {running} · failed {failed} · "
                          f"mean reward {'-' if mean is None else f'{mean:.3f}'} · {turns_per_s:.1f} turns/s · "
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
    _Outputs(Path(out)).results(run, RunSummary(episodes=[], planned=planned, attempts=attempts), error=error)


def results_table(summary: RunSummary) -> Any:
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
    if summary.exit_reasons:
        lines.append("exit reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.exit_reasons.items())))
    return lines


async def run_rollouts(
    tasks: Sequence[Task],
    *,
    harness: str,
    policy: Any,
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
    run_info: Mapping[str, Any] | None = None,
    success_threshold: float = 1.0,
    on_episode: Callable[[EpisodeResult], None] | None = None,
    on_samples: Callable[[EpisodeResult, list[Any]], None] | None = None,
) -> RunSummary:
    """Run ``attempts`` episodes of every task with at most ``concurrency`` at once (see the module docstring).

    ``policy`` answers every request in process (``scripted`` / ``oracle`` policies are bound to each
    episode's session, agent and task); an external one (``http``) leaves them for ``/poll``.
    ``gateway`` (optional) is a started gateway to use; by default one is started on 127.0.0.1 with
    the harness's side-call detector. ``console`` (a ``rich.console.Console``) shows the live progress
    bar and a line per finished episode. Setting ``stop`` stops launching, cancels what runs (each
    episode removes its sandbox) and returns what finished. ``on_samples(result, samples)`` is called
    with each in-process episode's :class:`trajectory.Sample` list as it finishes (the trainer adapters
    take their samples here, without files).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    stop = stop or asyncio.Event()
    root = Path(out) if out is not None else None
    outputs = _Outputs(root)
    tracker: StatTracker = make_tracker("null")
    if stats != "null" and not (stats == "tensorboard" and root is None):
        tracker = make_tracker(stats, logdir=root / "tb" if root is not None else None, period=stats_period)
    plan = [(task, attempt) for attempt in range(attempts) for task in tasks]
    summary = RunSummary(episodes=[], planned=len(plan), attempts=attempts, success_threshold=success_threshold,
                         out=root)
    run = {
        "harness": harness, "sandbox": sandbox, "concurrency": concurrency, "attempts": attempts,
        "step_limit": step_limit, "time_limit": time_limit, "tasks": [t.name for t in tasks],
        "policy": type(policy).__name__, **dict(run_info or {}),
    }
    progress = _Progress(console, len(plan), f"{harness}: {len(tasks)} task(s)")
    started = time.monotonic()
    own_gateway = gateway is None
    if gateway is None:
        longest = max([time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
        # A control API no one can use without credentials (issue 17); in-process policies need none.
        gateway = Gateway(port=0, request_timeout=longest + 120.0, side_call_detector=harness_side_call_detector(harness),
                          admin_token=secrets.token_urlsafe(32))
        await gateway.start()
    gw = gateway
    external = is_external(policy)
    if external:
        describe = getattr(policy, "describe", None)
        progress.line(describe(gw.url, admin_token_set=bool(gw.config.admin_token)) if describe
                      else f"requests wait on {gw.url}/poll")
    failed = 0
    answered_at_start = gw.metrics.answered_total

    def refresh(running: int) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        progress.update(done=len(summary.episodes), running=running, failed=failed, mean=summary.mean_reward,
                        turns_per_s=(gw.metrics.answered_total - answered_at_start) / elapsed)

    def new_harness() -> BaseHarness:
        return registry.create(harness, **dict(harness_options or {}))

    async def episode(task: Task, attempt: int) -> EpisodeResult:
        t0 = time.monotonic()
        if external:
            return await _passive_episode(gw, task, attempt, new_harness(), outputs, sandbox=sandbox, image=image,
                                          model=model, step_limit=step_limit, time_limit=time_limit, t0=t0)
        env = GatewayEnv.for_task(task, harness=new_harness(), sandbox=sandbox, gateway=gw, image=image, model=model,
                                  step_limit=step_limit, time_limit=time_limit)
        bind = getattr(policy, "bind", None)
        sid = ""
        failures: list[dict[str, Any]] = []
        try:
            ts = await env.reset()
            assert env.session is not None
            sid = env.session.session_id
            if bind is not None and not ts.last():
                h: Any = env.episode.harness if env.episode is not None else registry.get_class(harness)
                # A harness may speak another agent's action format (tiny-agent: mini-swe-agent's).
                bind(sid, agent=getattr(h, "scripted_format", None) or getattr(h, "name", harness), task=task)
            while not ts.last():
                assert ts.observation is not None
                request = ts.observation
                try:
                    ts = await env.step(await _answer(policy, request, failures))
                except InvalidAnswerError as exc:
                    # The policy's answer is unusable; the request still waits: the agent gets an error.
                    log.warning("policy gave an invalid answer to %s: %s", request.id, one_line(str(exc)))
                    answer = ErrorAnswer(502, f"the policy gave an invalid answer: {one_line(str(exc))}")
                    failures.append(_failed_turn(request, answer, 0.0))
                    ts = await env.step(answer)
            outcome = env.outcome
            assert outcome is not None
            samples = env.trajectory()
            answered = env.turn_log()
            # Failed policy calls are turns too (the agent got an error answer): in the turn log, in time order.
            turns = sorted([*answered, *failures], key=lambda t: float(t.get("timestamp") or 0.0))
            result = _result(task, attempt, outcome, answered, samples, sid, time.monotonic() - t0, ts.info,
                             failures=failures)
            report = getattr(policy, "episode_report", None)
            if report is not None:
                result.fidelity = report(sid, samples)
            outputs.episode(result, samples, turns, outcome.logs)
            if on_samples is not None:
                on_samples(result, samples)
            return result
        finally:
            unbind = getattr(policy, "unbind", None)
            if unbind is not None and sid:
                unbind(sid)
            await env.close()

    pending = list(plan)
    running: dict[asyncio.Task[Any], str] = {}
    stop_wait = asyncio.create_task(stop.wait())
    tick = 0.5 if console is not None else None
    try:
        while (pending or running) and not stop.is_set():
            while pending and len(running) < concurrency and not stop.is_set():
                task, attempt = pending.pop(0)
                t = asyncio.create_task(episode(task, attempt), name=f"ares-episode-{task.name}.{attempt}")
                running[t] = f"{task.name}.{attempt}"
            refresh(len(running))
            done, _ = await asyncio.wait({*running, stop_wait}, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is stop_wait:
                    continue
                key = running.pop(t)  # type: ignore[call-overload]
                task_name, _, attempt_s = key.rpartition(".")
                try:
                    result = t.result()
                except asyncio.CancelledError:
                    summary.cancelled.append(key)
                    continue
                except Exception as exc:  # a policy or runner failure: recorded, the run goes on
                    log.warning("episode %s failed: %s: %s", key, type(exc).__name__, one_line(str(exc)))
                    log.debug("the episode's traceback", exc_info=True)
                    result = EpisodeResult(task_name, int(attempt_s), 0.0, 0, 0.0, "error",
                                           error=one_line(f"{type(exc).__name__}: {exc}"))
                    outputs.episode(result, [], [], {})
                summary.episodes.append(result)
                if result.exit_reason in FAILED_REASONS:
                    failed += 1
                _log_episode(tracker, len(summary.episodes), result, summary)
                progress.line(_episode_line(result))
                if on_episode is not None:
                    on_episode(result)
    except asyncio.CancelledError:
        stop.set()
        raise
    finally:
        stop_wait.cancel()
        if running:
            summary.interrupted = True
            for t in running:
                t.cancel()
            # Each cancelled episode removes its own sandbox (GatewayEnv / TaskEpisode close in finally).
            results = await asyncio.gather(*running, return_exceptions=True)
            for t, res in zip(list(running), results, strict=True):
                if isinstance(res, EpisodeResult):
                    summary.episodes.append(res)
                else:
                    summary.cancelled.append(running[t])
        if pending and stop.is_set():
            summary.interrupted = True
            summary.cancelled.extend(f"{t.name}.{a}" for t, a in pending)
        summary.duration = time.monotonic() - started
        refresh(0)
        progress.stop()
        final: dict[str, Any] = {"run/mean_reward": summary.mean_reward,
                                 "run/episodes_per_minute": summary.to_dict()["episodes_per_minute"]}
        tracker.log(len(summary.episodes), **final)
        tracker.close()
        outputs.results(run, summary)
        if own_gateway:
            await gw.close()
    return summary


async def _answer(policy: Any, request: ParkedRequest, failures: list[dict[str, Any]] | None = None) -> Any:
    """The policy's answer; a failing policy gives the agent an error answer, as PolicyServer does, and
    the failure is appended to ``failures`` as a turn-log entry (see :func:`_failed_turn`)."""
    started = time.monotonic()
    try:
        return await call_policy(policy, request)
    except asyncio.CancelledError:
        raise
    except PolicyError as exc:
        log.warning("policy failed on %s: %s", request.id, exc)
        answer = exc.to_answer()
    except Exception as exc:
        # One line at WARNING (the episode's error names it too); the traceback for --log-level DEBUG.
        log.warning("policy raised on %s: %s: %s", request.id, type(exc).__name__, one_line(str(exc)))
        log.debug("the policy's traceback", exc_info=True)
        answer = ErrorAnswer(502, f"the policy failed: {type(exc).__name__}: {one_line(str(exc)) or '(no message)'}")
    if failures is not None:
        failures.append(_failed_turn(request, answer, time.monotonic() - started))
    return answer


def _failed_turn(request: ParkedRequest, answer: ErrorAnswer, latency: float) -> dict[str, Any]:
    """A turn-log entry for a request the policy failed on: the request as the agent sent it and, in
    place of a completion, ``error`` (the status and message the agent was answered with)."""
    return {
        "request_id": request.id,
        "protocol": request.protocol.value,
        "side_call": request.side_call,
        "timestamp": request.timestamp,
        "latency": latency,
        "request": request.request.raw,
        "error": {"status": answer.status, "message": answer.message},
    }


async def _passive_episode(
    gw: Gateway, task: Task, attempt: int, harness: BaseHarness, outputs: _Outputs, *, sandbox: str,
    image: str | None, model: str, step_limit: int | None, time_limit: float | None, t0: float,
) -> EpisodeResult:
    """An episode whose requests an external policy answers: start the agent, wait for it or a limit."""
    session = await gw.create_session(metadata={"task": task.name, "harness": harness.name, "attempt": attempt})
    sid = session.session_id
    ep = TaskEpisode(task, harness, sandbox=sandbox, image=image, model=model, gateway=gw)
    limit = time_limit if time_limit is not None else task.config.agent_timeout
    try:
        try:
            await ep.start(session, time_budget=limit + 30.0)
        except EpisodeSetupError:
            outcome = await ep.finish()
        else:
            assert ep.agent is not None
            truncation = None
            launched = time.monotonic()
            while not ep.agent.done():
                await asyncio.wait({ep.agent}, timeout=0.5)
                if ep.agent.done():
                    break
                if time.monotonic() - launched >= limit:
                    truncation = "time_limit"
                    break
                if step_limit is not None and gw.sessions.get(sid).turns >= step_limit:
                    truncation = "step_limit"
                    break
            outcome = await ep.finish(truncation=truncation)
    finally:
        await ep.close()
    info = outcome.info()
    await gw.end_session(sid, reward=outcome.reward, truncated=outcome.truncated,
                   **{k: v for k, v in info.items() if k != "truncated"})
    samples = gw.trajectory(sid)
    turns = gw.turn_log(sid)
    result = _result(task, attempt, outcome, turns, samples, sid, time.monotonic() - t0, info)
    outputs.episode(result, samples, turns, outcome.logs)
    with contextlib.suppress(Exception):
        await gw.delete_session(sid)
    return result


def _result(task: Task, attempt: int, outcome: EpisodeOutcome, turns: list[dict[str, Any]], samples: list[Any],
            sid: str, duration: float, info: Mapping[str, Any], *,
            failures: Sequence[Mapping[str, Any]] = ()) -> EpisodeResult:
    latencies = [float(t["latency"]) for t in turns if t.get("latency") is not None]
    error = outcome.error or outcome.verifier_error
    if failures:
        # The policy's failure comes first: it is usually why the agent then failed or gave up.
        last = failures[-1]["error"]
        said = (f"the policy failed on {len(failures)} of {len(failures) + len(turns)} request(s) "
                f"(last: {last['status']} {last['message']})")
        error = f"{said}; then {error}" if error else said
    return EpisodeResult(
        task=task.name,
        attempt=attempt,
        reward=outcome.reward,
        turns=len(turns) + len(failures),
        duration=duration,
        exit_reason=outcome.exit_reason,
        truncated=outcome.truncated,
        error=one_line(error),
        reward_parts=dict(outcome.reward_parts),
        samples=len(samples),
        session_id=sid,
        setup_seconds=outcome.setup_seconds,
        agent_seconds=outcome.agent_seconds,
        verify_seconds=outcome.verify_seconds,
        answer_latency=sum(latencies) / len(latencies) if latencies else None,
    )


def _log_episode(tracker: StatTracker, step: int, e: EpisodeResult, summary: RunSummary) -> None:
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
        "run/mean_reward": summary.mean_reward,
    })


def _episode_line(e: EpisodeResult) -> str:
    from rich.markup import escape

    mark = "[green]✓[/]" if e.reward >= 1.0 else ("[red]✗[/]" if e.exit_reason in FAILED_REASONS else "[yellow]·[/]")
    text = (f"{mark} {escape(e.task)} #{e.attempt}: reward {e.reward:.3f}, {e.turns} turns, {e.duration:.1f}s, "
            f"{e.exit_reason}")
    if e.error:
        text += f" ({escape(e.error[:300])})"
    return text
