"""A scripted policy for tests and demos: "run this shell command", then "finish", in each agent's format.

It reads the raw request body (as the agent sent it) and answers with a canonical completion as a
plain dict ``{"text", "tool_calls": [{"id", "name", "arguments"}], "finish_reason"}``, which the
gateway accepts (``Completion.model_validate(d)``, or ``{"completion": d}`` on ``/respond``).

=============== =====================================================
==========================================
agent           run a command                                         finish
=============== =====================================================
==========================================
claude-code     ``Bash`` tool_use ``{"command", "description"}``      a final text
codex           ``exec_command`` function call ``{"cmd",               a final text
                "yield_time_ms"}`` (or ``shell`` ``{"command": [...]}``);
                while it runs, empty ``write_stdin`` polls
mini-swe-agent  ``bash`` tool call ``{"command"}`` (text mode: a      ``echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
                ``mswea_bash_command`` fenced block)
terminus-2      JSON ``{"analysis", "plan", "commands": [{"keystrokes", ``task_complete: true`` (asked twice:
the
                "duration"}], "task_complete": false}``, the command  finish step answers every later request)
                then a line printing an end marker; until the marker
                shows, waits (empty keystrokes, growing durations)
=============== =====================================================
==========================================

A command runs to its end however long it takes (up to the agent's own per-command limit, which the
harnesses set from the run's time budget): Claude Code's ``Bash`` and mini-swe-agent's ``bash`` block
until the command exits; Codex's ``exec_command`` returns "Process running with session ID N" after
``yield_time_ms``, and the policy then polls that session with empty ``write_stdin`` calls (without
taking the next step) until the tool output reports an exit code; Terminus-2 types into a live
shell and reads the screen after ``duration`` seconds (60 s at most), so the policy types a marker
line after the command and waits until the marker's output is on the screen (in the latest
observation, or, once Terminus-2 has summarized its history, in the handoff's terminal screen).

Side calls (detected with the harness's own ``is_side_call``, or the ``x-ares-side-call`` header) get
a sensible answer without advancing the script: a title object for Claude Code's title request
(filled from its JSON schema), a short summary otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MINI_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: How long Codex's ``exec_command`` waits before it yields a still-running command (its maximum).
CODEX_EXEC_YIELD_MS = 30_000
#: How long one empty ``write_stdin`` poll asks to wait; Codex caps it at
#: ``background_terminal_max_timeout``, which the codex harness sets to the run's time budget, and
#: the poll returns as soon as the command exits.
CODEX_POLL_YIELD_MS = 3_600_000
#: Seconds each Terminus-2 wait asks for, in turn, while a command runs (the last repeats; Terminus-2
#: caps a duration at 60 s). Short enough that the next step follows soon after the command ends.
TERMINUS_WAITS = (5.0, 10.0, 15.0, 30.0)
_CODEX_RUNNING = re.compile(r"Process running with session ID (\d+)")
SideCallDetector = Callable[[Mapping[str, Any], Mapping[str, str]], bool]


@dataclass(frozen=True)
class RunCommand:
    """Ask the agent to run ``command`` in its shell."""

    command: str
    duration: float = 1.0  # Terminus-2 waits this long before reading the screen


@dataclass(frozen=True)
class Finish:
    """Tell the agent the task is done."""

    message: str = "Done."


@dataclass(frozen=True)
class CallTool:
    """Call one of the agent's own tools by name (e.g. Claude Code's ``Agent`` to start a sub-agent)."""

    name: str
    arguments: Mapping[str, Any]


Step = RunCommand | Finish | CallTool


class ScriptedPolicy:
    """Answers one agent's requests with a fixed script of steps, in that agent's own action format.

    ``policy(body, headers)`` returns a canonical completion dict. ``main_turns`` counts the main-line
    requests answered so far, ``side_turns`` the side calls.
    """

    AGENTS = ("claude-code", "codex", "mini-swe-agent", "terminus-2")

    def __init__(
        self,
        agent: str,
        script: Sequence[Step],
        *,
        side_call_detector: SideCallDetector | None = None,
        title: str = "Scripted task",
    ) -> None:
        if agent not in self.AGENTS:
            raise ValueError(
                f"no scripted action format for agent {agent!r}; known: {', '.join(self.AGENTS)}")
        if not script:
            raise ValueError("the script needs at least one step")
        self.agent = agent
        self.script = list(script)
        self.title = title
        if side_call_detector is None:
            from . import registry

            side_call_detector = registry.get_class(agent).is_side_call  # type: ignore[attr-defined]
        self._is_side_call = side_call_detector
        self.main_turns = 0
        self.side_turns = 0
        #: Main-line requests answered with a wait for a running command (Codex polls, Terminus-2 waits).
        self.wait_turns = 0
        self._step = 0  # the index of the next step (waits do not advance it)
        self._marker: str | None = None  # Terminus-2: the output that says the last command ended
        self._waits = 0  # waits for the current Terminus-2 command so far

    def is_side_call(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> bool:
        headers = headers or {}
        if any(k.lower() == "x-ares-side-call" and v.lower() in ("1", "true", "yes") for k,
               v in headers.items()):
            return True
        return bool(self._is_side_call(body, headers))

    def __call__(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        if self.is_side_call(body, headers):
            self.side_turns += 1
            return self.side_answer(body)
        self.main_turns += 1
        n = self.main_turns
        wait = self._wait_for_command(body, n)
        if wait is not None:
            self.wait_turns += 1
            return wait
        step = self.script[min(self._step, len(self.script) - 1)]
        self._step += 1
        if isinstance(step, RunCommand):
            return self.run_command(body, step, n)
        if isinstance(step, CallTool):
            prefix = "toolu_ares" if self.agent == "claude-code" else "call_ares"
            return _tool_call(f"{prefix}_{n:04d}", step.name, step.arguments)
        return self.finish(body, step, n)

    # ------------------------------------------------------------------ formats

    def run_command(self, body: Mapping[str, Any], step: RunCommand, n: int) -> dict[str, Any]:
        cmd = step.command
        if self.agent == "claude-code":
            args = {"command": cmd, "description": "Run the scripted command"}
            return _tool_call(f"toolu_ares_{n:04d}", "Bash", args)
        if self.agent == "codex":
            names = _tool_names(body)
            if "exec_command" in names or not names:
                return _tool_call(f"call_ares_{n:04d}", "exec_command",
                                  {"cmd": cmd, "yield_time_ms": CODEX_EXEC_YIELD_MS})
            if "shell_command" in names:
                return _tool_call(f"call_ares_{n:04d}", "shell_command", {"command": cmd})
            return _tool_call(f"call_ares_{n:04d}", "shell", {"command": ["bash", "-lc", cmd]})
        if self.agent == "mini-swe-agent":
            if not _tool_names(body):  # text-based config: one fenced block per reply
                return _text(f"THOUGHT: run the scripted command.\n\n```mswea_bash_command\n{cmd}\n```")
            return _tool_call(f"call_ares_{n:04d}", "bash", {"command": cmd})
        keystrokes = cmd if cmd.endswith("\n") else cmd + "\n"
        # The marker line runs when the command has ended; its output differs from its typed text.
        self._marker, self._waits = f"ares-step-{n:04d}-done", 0
        keystrokes += f"printf 'ares-step-%s-done\\n' {n:04d}\n"
        return _text(json.dumps({
            "analysis": "Following the script.",
            "plan": f"Run: {cmd}",
            "commands": [{"keystrokes": keystrokes, "duration": step.duration}],
            "task_complete": False,
        }))

    def _wait_for_command(self, body: Mapping[str, Any], n: int) -> dict[str, Any] | None:
        """A wait for the command the last step started when it still runs, else ``None``."""
        if self.agent == "codex":
            output = _last_codex_output(body)
            match = _CODEX_RUNNING.search(output or "")
            if match is None or "Process exited with code" in (output or ""):
                return None
            return _tool_call(f"call_ares_{n:04d}", "write_stdin", {
                "session_id": int(match.group(1)), "chars": "", "yield_time_ms": CODEX_POLL_YIELD_MS})
        if self.agent == "terminus-2" and self._marker is not None:
            if self._marker in _terminus_observations(body):
                self._marker = None
                return None
            duration = TERMINUS_WAITS[min(self._waits, len(TERMINUS_WAITS) - 1)]
            self._waits += 1
            return _text(json.dumps({
                "analysis": "The command is still running.",
                "plan": f"Wait {duration:g} s more for it to finish.",
                "commands": [{"keystrokes": "", "duration": duration}],
                "task_complete": False,
            }))
        return None

    def finish(self, body: Mapping[str, Any], step: Finish, n: int) -> dict[str, Any]:
        if self.agent == "mini-swe-agent":
            if not _tool_names(body):
                return _text(f"THOUGHT: done.\n\n```mswea_bash_command\necho {MINI_SUBMIT}\n```")
            return _tool_call(f"call_ares_{n:04d}", "bash", {"command": f"echo {MINI_SUBMIT}"})
        if self.agent == "terminus-2":
            return _text(json.dumps({
                "analysis": step.message,
                "plan": "The task is complete.",
                "commands": [],
                "task_complete": True,
            }))
        return _text(step.message)

    def side_answer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        schema = _output_schema(body)
        if schema is not None:
            return _text(json.dumps(_fill_schema(schema, self.title)))
        return _text(f"{self.title}: the scripted run so far executed its commands as asked.")


def _text(text: str) -> dict[str, Any]:
    return {"text": text, "tool_calls": [], "finish_reason": "stop"}


def _tool_call(call_id: str, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "text": None,
        "tool_calls": [{"id": call_id, "name": name, "arguments": json.dumps(dict(args))}],
        "finish_reason": "tool_calls",
    }


def _last_codex_output(body: Mapping[str, Any]) -> str | None:
    """The text of a Responses request's last input item when it is a tool's output."""
    items = body.get("input")
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return None
    last = items[-1]
    if last.get("type") not in ("function_call_output", "custom_tool_call_output"):
        return None
    output = last.get("output")
    if isinstance(output, list):  # content items
        return " ".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return output if isinstance(output, str) else None


def _terminus_observations(body: Mapping[str, Any]) -> str:
    """The text of a Terminus-2 chat request's user messages after the first (the task prompt).

    Usually the command's output is in the last one (the terminal output since the last action),
    but when Terminus-2 summarizes its history (context nearly full) it replaces the history with
    [task prompt, the questions prompt, the questions] and the observation with a handoff prompt
    ("Here are the answers the other agent provided. ..."): the screen is then only in the
    questions prompt's "Current Terminal Screen". Every step's marker is unique and its typed
    text differs from its output, so the marker anywhere in these messages means the command ended.
    """
    texts: list[str] = []
    for message in (body.get("messages") or [])[1:]:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                texts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
            else:
                texts.append(str(content or ""))
    return "\n".join(texts)


def _tool_names(body: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
        if isinstance(name, str):
            names.add(name)
        for inner in tool.get("tools") or []:  # Responses "namespace" tools
            if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                names.add(inner["name"])
    return names


def _output_schema(body: Mapping[str, Any]) -> dict[str, Any] | None:
    oc = body.get("output_config")
    if isinstance(oc, dict) and isinstance(oc.get("format"), dict):
        schema = oc["format"].get("schema")
        if isinstance(schema, dict):
            return schema
    return None


def _fill_schema(schema: Mapping[str, Any], title: str) -> Any:
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: _fill_schema(v if isinstance(v, dict) else {}, title) for k, v in props.items()}
    if kind == "array":
        return []
    if kind in ("integer", "number"):
        return 0
    if kind == "boolean":
        return False
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    return title
