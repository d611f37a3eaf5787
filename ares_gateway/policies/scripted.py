"""The ``scripted`` and ``oracle`` policies: fixed scripts in each agent's own action format.

Both wrap :class:`harnesses.scripted.ScriptedPolicy`, one per session, so one policy object can
answer many concurrent episodes. A session is bound to its agent (and task) with :meth:`bind`
before its requests are answered; ``ares-gateway run`` and :func:`ares_gateway.episodes.rollouts.run_rollouts`
do that for every episode.

* ``scripted``: run ``commands`` (in order), then finish. With no commands the agent is told to
  finish at once (a trivial agent run: two requests for mini-swe-agent, one for Claude Code).
* ``oracle``: play the task's ``solution/solve.sh`` through the agent's own shell tool (one command
  that recreates ``solution/`` in a temporary directory and runs ``solve.sh`` in the agent's working
  directory, as Harbor's oracle does), then finish.

>>> policy = make_policy("oracle")
>>> policy.bind(session_id, agent="mini-swe-agent", task=task)
>>> completion = await policy(parked_request)
"""

from __future__ import annotations

import base64
import secrets
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import CanonicalRequest, Completion
from ares_gateway.episodes.tasks import Task
from ares_gateway.policies.base import PolicyError, PolicyRequest
from harnesses.scripted import Finish, RunCommand, ScriptedPolicy, Step

#: Solutions larger than this are refused: they are sent as one shell command through the agent.
MAX_SOLUTION_BYTES = 256 * 1024


def oracle_command(task: Task) -> str:
    """One shell command that recreates the task's ``solution/`` in a temporary directory and runs
    ``solve.sh`` from the current directory (the agent's workdir), with ``[solution] env``.

    Text files travel as quoted here-documents (readable in the trajectory), others base64-encoded.
    """
    if task.solution_dir is None:
        raise PolicyError(f"task {task.name!r} has no solution/solve.sh: the oracle has nothing to play", status=500)
    files = sorted(p for p in Path(task.solution_dir).rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    if total > MAX_SOLUTION_BYTES:
        raise PolicyError(
            f"task {task.name!r}: solution/ holds {total} bytes; the oracle sends at most {MAX_SOLUTION_BYTES}",
            status=500,
        )
    # No `exit` anywhere: some agents (Terminus-2) type commands into a long-lived shell.
    lines = ['d=$(mktemp -d /tmp/ares-oracle.XXXXXX) || { d=/tmp/ares-oracle-$$; mkdir -p "$d"; }']
    for path in files:
        rel = path.relative_to(task.solution_dir).as_posix()
        target = f'"$d"/{shlex.quote(rel)}'
        if "/" in rel:
            lines.append(f'mkdir -p "$(dirname {target})"')
        data = path.read_bytes()
        text = _as_text(data)
        if text is not None:
            eof = f"ARES_ORACLE_EOF_{secrets.token_hex(4)}"
            body = text if text.endswith("\n") else text + "\n"
            lines.append(f"cat > {target} <<'{eof}'\n{body}{eof}")
        else:
            lines.append(f"printf '%s' {base64.b64encode(data).decode()} | base64 -d > {target}")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(task.config.solution_env.items()))
    run = 'if command -v bash >/dev/null 2>&1; then bash "$d/solve.sh"; else sh "$d/solve.sh"; fi'
    lines.append(f"( {exports}{run} ); status=$?")
    # `rm -r`, not `rm -rf`: Codex refuses any command holding an `rm -f` (whatever its settings).
    lines.append('rm -r "$d" </dev/null 2>/dev/null; echo "[oracle] solution/solve.sh exited with status $status"')
    return "\n".join(lines)


def _as_text(data: bytes) -> str | None:
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class SessionScriptedPolicy:
    """A scripted policy per bound session (see the module docstring). ``mode`` is ``scripted`` or ``oracle``."""

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

    def script_for(self, task: Task | None) -> list[Step]:
        """The steps one episode plays."""
        if self.mode == "oracle":
            if task is None:
                raise ValueError("the oracle needs the session's task: bind(session_id, agent=..., task=task)")
            return [RunCommand(oracle_command(task)), Finish(self.finish_message)]
        if self._script is not None:
            return list(self._script)
        return [*(RunCommand(c) for c in self._commands), Finish(self.finish_message)]

    def bind(self, session_id: str, *, agent: str, task: Task | None = None) -> None:
        """Answer ``session_id``'s requests in ``agent``'s action format (the oracle plays ``task``)."""
        self._sessions[session_id] = ScriptedPolicy(agent, self.script_for(task))

    def unbind(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def session_policy(self, session_id: str) -> ScriptedPolicy | None:
        return self._sessions.get(session_id)

    async def __call__(self, request: PolicyRequest, /) -> Completion:
        if not isinstance(request, ParkedRequest):
            raise PolicyError("the scripted policy answers gateway requests (it needs the session id)", status=500)
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
