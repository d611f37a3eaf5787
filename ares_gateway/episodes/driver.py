"""One episode, from a fresh sandbox to its result and samples: what every executor runs per episode.

:func:`drive_episode` runs an :class:`EpisodeSpec` (task, attempt, harness, sandbox, limits) against a
started gateway with a policy: a :class:`~ares_gateway.GatewayEnv` over a fresh sandbox, driven by the
policy in process, or (an external policy, ``/poll``) the agent started and waited for while the
requests stay parked. It returns an :class:`EpisodeRecord`: the :class:`EpisodeResult` row, the
training samples, the turn log and the agent's logs, plain data that crosses process boundaries
(the Ray executor sends it back to the driver, which writes it, :mod:`ares_gateway.episodes.output`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ares_gateway.core.answers import ErrorAnswer
from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.errors import InvalidAnswerError
from ares_gateway.episodes.env import GatewayEnv, step_info
from ares_gateway.episodes.episode import EpisodeSetupError, TaskEpisode, one_line
from ares_gateway.episodes.episode_spec import EpisodeSpec
from ares_gateway.episodes.failures import INFRA_ERROR
from ares_gateway.episodes.result import EpisodeResult
from ares_gateway.episodes.tasks import Task
from ares_gateway.episodes.usage import episode_usage
from ares_gateway.episodes.warm import Warmed, WarmPool
from ares_gateway.episodes.workspaces import workspace_file
from ares_gateway.gateway import Gateway
from ares_gateway.policies.base import (
    EpisodeReporter,
    Policy,
    PolicyError,
    SessionBound,
    call_policy,
    is_external,
)
from ares_gateway.telemetry import EpisodeSpan
from harnesses import BaseHarness, registry

log = logging.getLogger(__name__)

__all__ = ["EpisodeRecord", "EpisodeSpec", "drive_episode"]


@dataclass
class EpisodeRecord:
    """One finished episode: its row of ``results.json`` (:class:`EpisodeResult`: reward, exit reason,
    turns, error, versions, timings) and what it produced, where it was kept: its training samples, its
    turn log and the agent's logs. What every executor returns, what the run writes, what a rollout
    source hands out (with ``policy_version``, ``stale_tokens`` and ``all_stale`` set, and the turn log
    and logs left in OUT)."""

    result: EpisodeResult
    #: Its :class:`trajectory.Sample` list (main line, side calls, segments); from a rollout source with
    #: ``max_staleness``, stale responses masked.
    samples: list[Any] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    #: The rollout source's policy version when it handed the episode out (what staleness was judged
    #: against); ``None`` elsewhere.
    policy_version: int | None = None
    #: Trained tokens masked as stale (0 without ``max_staleness``).
    stale_tokens: int = 0
    #: It had trained tokens and every one was stale: nothing of it is left to train.
    all_stale: bool = False

    @property
    def task(self) -> str:
        return self.result.task

    @property
    def attempt(self) -> int:
        return self.result.attempt

    @property
    def reward(self) -> float:
        return self.result.reward

    @property
    def exit_reason(self) -> str:
        return self.result.exit_reason

    @property
    def infra_error(self) -> bool:
        """It failed by the infrastructure on every try (``infra_error``): it has no samples, and its
        reward (0.0) is no verdict on the policy; leave it out of its group's baseline."""
        return self.result.exit_reason == INFRA_ERROR

    @property
    def first_version(self) -> int | None:
        return self.result.first_version

    @property
    def last_version(self) -> int | None:
        return self.result.last_version

    @property
    def mixed_versions(self) -> bool:
        """A sample's trained tokens carry more than one version (the episode spanned a weight update)."""
        return any(s.metadata.get("mixed_versions") for s in self.samples)

    @property
    def trained_tokens(self) -> int:
        return sum(int(s.loss_mask.sum()) for s in self.samples)


def renamed_names(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``, which exported ``RolloutEpisode``: the name, renamed for one
    release (a streamed episode is the :class:`EpisodeRecord` every executor returns), gives
    :class:`EpisodeRecord` with a ``DeprecationWarning``; any other is the usual ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name == "RolloutEpisode":
            warnings.warn("RolloutEpisode is EpisodeRecord now: import ares_gateway.EpisodeRecord",
                          DeprecationWarning, stacklevel=2)
            return EpisodeRecord
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


async def drive_episode(spec: EpisodeSpec, *, policy: Policy, gateway: Gateway,
                        warm: WarmPool | None = None) -> EpisodeRecord:
    """Run one episode of ``spec`` against the started ``gateway``, answered by ``policy`` (see the module
    docstring). The sandbox is removed whatever happens, cancellation included. With ``warm``, the
    episode takes the sandbox the pool set up for it, if any (:mod:`~ares_gateway.episodes.warm`). With
    the gateway's OpenTelemetry on, the episode is a span and its LLM calls its children
    (:mod:`ares_gateway.telemetry`)."""
    telemetry = gateway.telemetry
    if telemetry is None:
        return await _drive(spec, policy, gateway, None, warm)
    with telemetry.episode(task=spec.task.name, attempt=spec.attempt, harness=spec.episode.harness) as span:
        record = await _drive(spec, policy, gateway, span, warm)
        r = record.result
        span.finish(reward=r.reward, exit_reason=r.exit_reason, turns=r.turns, error=r.error)
        return record


async def _drive(spec: EpisodeSpec, policy: Policy, gateway: Gateway,
                 span: EpisodeSpan | None, warm: WarmPool | None) -> EpisodeRecord:
    t0 = time.monotonic()
    warmed = await warm.take(spec) if warm is not None else None
    harness = warmed.episode.harness if warmed is not None else spec.new_harness()
    if is_external(policy):
        return await _passive_episode(gateway, spec, harness, t0, span, warmed)
    config = spec.episode
    env = GatewayEnv.for_task(spec.task, config, harness=harness, gateway=gateway,
                              save_workspace=spec.workspace, prepared=warmed)
    sid = ""
    binder = policy if isinstance(policy, SessionBound) else None
    failures: list[dict[str, Any]] = []
    try:
        ts = await env.reset()
        assert env.session is not None
        sid = env.session.session_id
        if span is not None:
            span.bind(sid)
        if binder is not None and not ts.last():
            h: Any = env.episode.harness if env.episode is not None else registry.get_class(config.harness)
            # A harness may speak another agent's action format (tiny-agent: mini-swe-agent's).
            binder.bind(sid, agent=h.scripted_format or h.name, task=spec.task)
        while not ts.last():
            assert ts.observation is not None
            request = ts.observation
            try:
                # In the weight-update fence: a drain waits for the policy's call, an abort re-runs it.
                ts = await env.step(
                    await gateway.fence.generate(request, partial(_answer, policy, request, failures))
                )
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
        result = _result(spec.task, spec.attempt, outcome, answered, samples, sid, time.monotonic() - t0,
                         ts.info, failures=failures)
        if isinstance(policy, EpisodeReporter):
            result.fidelity = policy.episode_report(sid, samples)
        return EpisodeRecord(result, samples, turns, dict(env.logs))
    finally:
        if binder is not None and sid:
            binder.unbind(sid)
        await env.close()


async def _answer(policy: Policy, request: ParkedRequest,
                  failures: list[dict[str, Any]] | None = None) -> Any:
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
        answer = ErrorAnswer(
            502, f"the policy failed: {type(exc).__name__}: {one_line(str(exc)) or '(no message)'}"
        )
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


async def _passive_episode(gw: Gateway, spec: EpisodeSpec, harness: BaseHarness, t0: float,
                           span: EpisodeSpan | None = None, warmed: Warmed | None = None) -> EpisodeRecord:
    """An episode whose requests an external policy answers: start the agent, wait for it or a limit."""
    task, attempt, config = spec.task, spec.attempt, spec.episode
    step_limit, time_limit = config.step_limit, config.time_limit
    if warmed is not None:
        session, ep = warmed.session, warmed.episode
    else:
        session = await gw.create_session(
            metadata={"task": task.name, "harness": harness.name, "attempt": attempt}
        )
        ep = TaskEpisode(task, harness, sandbox=config.sandbox, image=config.image, model=config.model,
                         gateway=gw, save_workspace=spec.workspace)
    sid = session.session_id
    if span is not None:
        span.bind(sid)
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
    info = step_info(outcome)
    await gw.end_session(sid, reward=outcome.reward, truncated=outcome.truncated,
                   **{k: v for k, v in info.items() if k != "truncated"})
    samples = gw.trajectory(sid)
    turns = gw.turn_log(sid)
    result = _result(task, attempt, outcome, turns, samples, sid, time.monotonic() - t0, info)
    with contextlib.suppress(Exception):
        await gw.delete_session(sid)
    return EpisodeRecord(result, samples, turns, dict(ep.logs))


def _result(task: Task, attempt: int, outcome: EpisodeResult, turns: list[dict[str, Any]],
            samples: list[Any], sid: str, duration: float, info: Mapping[str, Any], *,
            failures: Sequence[Mapping[str, Any]] = ()) -> EpisodeResult:
    latencies = [float(t["latency"]) for t in turns if t.get("latency") is not None]
    versions = [v for t in turns if isinstance(v := t.get("policy_version"), int)]
    error = outcome.error or outcome.verifier_error
    if failures:
        # The policy's failure comes first: it is usually why the agent then failed or gave up.
        last = failures[-1]["error"]
        said = (f"the policy failed on {len(failures)} of {len(failures) + len(turns)} request(s) "
                f"(last: {last['status']} {last['message']})")
        error = f"{said}; then {error}" if error else said
    # The episode's own result, completed with what the gateway recorded and the run's names.
    return dataclasses.replace(
        outcome,
        attempt=attempt,
        turns=len(turns) + len(failures),
        duration=duration,
        error=one_line(error),
        reward_parts=dict(outcome.reward_parts),
        retry_errors=list(outcome.retry_errors),
        samples=len(samples),
        session_id=sid,
        answer_latency=sum(latencies) / len(latencies) if latencies else None,
        usage=episode_usage(turns),
        grading_setup_seconds=round(outcome.grading_setup_seconds, 3),
        first_version=versions[0] if versions else None,
        last_version=versions[-1] if versions else None,
        task_dir=str(task.path),
        workspace=workspace_file(task.name, attempt) if outcome.workspace is not None else None,
    )


