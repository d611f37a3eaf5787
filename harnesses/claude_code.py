"""Claude Code (npm ``@anthropic-ai/claude-code``, a native binary inside the npm package).

Redirect: ``ANTHROPIC_BASE_URL`` = the session base URL (the CLI appends ``/v1/messages``), the token
as ``ANTHROPIC_AUTH_TOKEN`` (sent as ``Authorization: Bearer``), every model tier pinned to the
model label. Run: ``claude -p PROMPT --output-format stream-json --verbose
--dangerously-skip-permissions`` (allowed as a non-root user, or as root with ``IS_SANDBOX=1``,
which is set too). The stream-json log (stdout) is kept as the ``stream.jsonl`` artifact.

Long commands: the Bash tool's default and maximum timeout (``BASH_DEFAULT_TIMEOUT_MS``,
``BASH_MAX_TIMEOUT_MS``; 2 and 10 minutes by default) are both set to
:meth:`~harnesses.base.BaseHarness.command_limit` (the run's time budget unless ``command_timeout``
is given), and ``CLAUDE_CODE_DISABLE_BACKGROUND_TASKS=1``: with background tasks on, 2.1.332 refuses
a command that starts with ``sleep N`` (N >= 25 s: "Blocked: standalone sleep ...", pointing at
``run_in_background``), and in ``-p`` mode nothing waits for a backgrounded command once the agent's turn
ends.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from .base import BaseHarness, HarnessContext, Prepared, header_value, npm_install_steps

NPM_PACKAGE = "@anthropic-ai/claude-code"


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                out.append(block["text"])
    return out


#: How a sub-agent's system prompt introduces itself (2.1.332), and how far into a system block it may.
_SUBAGENT_INTRO = "You are an agent for Claude Code"
_INTRO_WINDOW = 1024


def claude_code_is_side_call(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
    """Claude Code requests that are not the agent's main line.

    * the title request: no tools and an ``output_config.format`` of type ``json_schema``;
    * a conversation summary (``/compact`` or auto-compaction): the last user message asks to
      "create a detailed summary of the conversation";
    * a sub-agent (the ``Agent``/``Task`` tool): its requests carry the ``x-claude-code-agent-id``
      header and a system block that opens (within its first KiB) with "You are an agent for Claude
      Code" (seen with 2.1.332).
    """
    if header_value(headers, "x-claude-code-agent-id"):
        return True
    tools = body.get("tools") or []
    output_config = body.get("output_config")
    if not tools and isinstance(output_config, dict):
        fmt = output_config.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            return True
    messages = body.get("messages") or []
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "user":
        last = " ".join(_texts(messages[-1].get("content"))).lower()
        if "detailed summary of the conversation" in last:
            return True
    # Only where a block opens: a sub-agent's prompt starts with its introduction (after at most the
    # identity line), while the main prompt's later parts carry text the agent can write (project
    # instructions, environment), which must not turn its turns into side calls. Searching a
    # window, not the whole 10-25 KB prompt, also keeps this check from growing with it.
    return any(_SUBAGENT_INTRO in text[:_INTRO_WINDOW] for text in _texts(body.get("system")))


class ClaudeCodeHarness(BaseHarness):
    name = "claude-code"
    default_version = "2.1.332"
    probe = "bin/claude"

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        return npm_install_steps(prefix, NPM_PACKAGE, self.version)

    def agent_env(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        model = ctx.model
        return {
            "ANTHROPIC_BASE_URL": ctx.base_url.rstrip("/"),
            "ANTHROPIC_AUTH_TOKEN": ctx.token,
            "ANTHROPIC_API_KEY": "",
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "CLAUDE_CODE_SUBAGENT_MODEL": model,
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_BUG_COMMAND": "1",
            "IS_SANDBOX": "1",
            "API_TIMEOUT_MS": "900000",
            "BASH_DEFAULT_TIMEOUT_MS": str(self.command_limit(prep) * 1000),
            "BASH_MAX_TIMEOUT_MS": str(self.command_limit(prep) * 1000),
            "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1",
            "CLAUDE_CONFIG_DIR": posixpath.join(prep.state_dir, "claude-config"),
        }

    def agent_command(self, ctx: HarnessContext, prep: Prepared, prompt: str) -> str:
        return (
            f"claude -p {shlex.quote(prompt)} --output-format stream-json --verbose "
            f"--dangerously-skip-permissions --model {shlex.quote(ctx.model)}"
        )

    def artifact_paths(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {"stream.jsonl": f"{prep.state_dir}/stdout.log"}

    # The function itself (not a wrapper): a detector that already ran it for this protocol can tell.
    is_side_call = staticmethod(claude_code_is_side_call)
