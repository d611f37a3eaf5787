"""The ``scripted`` and ``oracle`` policies: fixed scripts in each agent's own action format.

Both wrap :class:`harnesses.scripted.ScriptedPolicy`, one per session, so one policy object can
answer many concurrent episodes. A session is bound to its agent (and task) with :meth:`bind`
before its requests are answered; ``ares-gateway run`` and :func:`ares_gateway.episodes.rollouts.run_rollouts`
do that for every episode.

* ``scripted``: run ``commands`` (in order), then finish. With no commands the agent is told to
  finish at once (a trivial agent run: two requests for mini-swe-agent, one for Claude Code).
* ``oracle``: play the task's reference solution through the agent's own shell tool, then finish.
  The command comes from the task (:meth:`OracleTask.oracle_command`; for a Harbor task,
  :mod:`ares_gateway.episodes.oracle`): the policy knows no task format.

>>> policy = make_policy("oracle")
>>> policy.bind(session_id, agent="mini-swe-agent", task=task)
>>> completion = await policy(parked_request)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import CanonicalRequest, Completion
from ares_gateway.policies.base import OracleTask, PolicyError, PolicyRequest
from harnesses.scripted import Finish, RunCommand, ScriptedPolicy, Step


class SessionScriptedPolicy:
    """A scripted policy per bound session (see the module docstring). ``mode`` is ``scripted`` or
    ``oracle``."""

    def __init__(
        self,
        mode: str = "scripted",
        *,
        commands: Sequence[str] = (),
        finish: str = "Done.",
        script: Sequence[Step] | None = None,
    ) -> None:
        if mode not in ("scripted", "oracle"):
            raise ValueError(f"mode must be 'scripted' or 'oracle', got {mode!r}")
        if mode == "oracle" and (commands or script):
            raise ValueError("the oracle plays the task's solution: give no commands or script")
        self.mode = mode
        self.finish_message = finish
        self._script: list[Step] | None = list(script) if script is not None else None
        self._commands = list(commands)
        self._sessions: dict[str, ScriptedPolicy] = {}

    def __repr__(self) -> str:
        return f"SessionScriptedPolicy(mode={self.mode!r}, sessions={len(self._sessions)})"

    def script_for(self, task: OracleTask | None) -> list[Step]:
        """The steps one episode plays."""
        if self.mode == "oracle":
            if task is None:
                raise ValueError(
                    "the oracle needs the session's task: bind(session_id, agent=..., task=task)")
            return [RunCommand(task.oracle_command()), Finish(self.finish_message)]
        if self._script is not None:
            return list(self._script)
        return [*(RunCommand(c) for c in self._commands), Finish(self.finish_message)]

    def bind(self, session_id: str, *, agent: str, task: OracleTask | None = None) -> None:
        """Answer ``session_id``'s requests in ``agent``'s action format (the oracle plays ``task``)."""
        self._sessions[session_id] = ScriptedPolicy(agent, self.script_for(task))

    def unbind(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def session_policy(self, session_id: str) -> ScriptedPolicy | None:
        return self._sessions.get(session_id)

    async def __call__(self, request: PolicyRequest, /) -> Completion:
        if not isinstance(request, ParkedRequest):
            raise PolicyError("the scripted policy answers gateway requests (it needs the session id)",
                              status=500)
        policy = self._sessions.get(request.session_id)
        if policy is None:
            raise PolicyError(
                f"session {request.session_id!r} is not bound: call policy.bind(session_id, agent=...) first",
                status=500,
            )
        headers = {"x-ares-side-call": "1"} if request.side_call else {}
        raw = request.request.raw if isinstance(request.request, CanonicalRequest) else {}
        answer: dict[str, Any] = policy(raw, headers)
        return Completion.model_validate(answer)


def make_scripted(**options: Any) -> SessionScriptedPolicy:
    """``make_policy("scripted", commands=[...], finish="...")``; ``mode="oracle"`` gives the oracle."""
    return SessionScriptedPolicy(options.pop("mode", "scripted"), **options)


def make_oracle(**options: Any) -> SessionScriptedPolicy:
    """``make_policy("oracle")``."""
    return SessionScriptedPolicy("oracle", **options)
