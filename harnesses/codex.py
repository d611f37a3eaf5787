"""Codex CLI (npm ``@openai/codex``; a native binary inside the npm package).

Codex speaks only the Responses API and ignores ``OPENAI_BASE_URL``. It is redirected with a private
``CODEX_HOME`` (in the agent's home, not under /tmp: there Codex refuses to create its helper
binaries) holding a ``config.toml`` with a custom model provider (``wire_api = "responses"``,
``base_url`` = session URL + ``/v1``, ``env_key``), so it never tries the WebSocket transport of the
built-in provider. The model label should be one Codex does not catalogue (the default
``ares-policy`` is not), which keeps the standard Responses dialect. Run: ``codex exec
--skip-git-repo-check --dangerously-bypass-approvals-and-sandbox --json PROMPT </dev/null``.
Its session log (``$CODEX_HOME/sessions/.../rollout-*.jsonl``) is kept as ``rollout.jsonl`` and its
JSON event stream (stdout) as ``events.jsonl``.

Long commands: Codex's ``exec_command`` returns after ``yield_time_ms`` (10 s by default, 30 s at
most) with a session id while the command keeps running; the model then waits with empty
``write_stdin`` polls, each at most ``background_terminal_max_timeout`` (5 min by default). The run
sets that ceiling (``-c background_terminal_max_timeout=MS``) to
:meth:`~harnesses.base.BaseHarness.command_limit` (the run's time budget unless ``command_timeout``
is given), so one poll may wait for a command as long as the episode may run. Codex itself refuses
some commands whatever the approval and sandbox settings (0.171: any ``rm -f``/``rm -rf`` outside a
here-document, "rm -f style commands are not permitted"); the refusal is the tool's output.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from sandbox import Sandbox

from .base import BaseHarness, HarnessContext, HarnessLaunchError, Prepared, header_value, npm_install_steps

NPM_PACKAGE = "@openai/codex"
TOKEN_ENV = "ARES_GATEWAY_TOKEN"
_COMPACT_MARKERS = ("handoff summary", "summarize the conversation", "context checkpoint compaction")


def codex_is_side_call(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
    """Codex requests that are not the main line.

    * sub-agent work (review, compaction) is announced by the ``x-openai-subagent`` header;
    * a compaction request: the last input item asks for a summary / hand-off of the conversation.
    """
    if header_value(headers, "x-openai-subagent"):
        return True
    items = body.get("input")
    if isinstance(items, list) and items:
        last = items[-1]
        if isinstance(last, dict) and last.get("role") == "user":
            content = last.get("content")
            parts = content if isinstance(content, list) else [{"text": content}]
            text = " ".join(str(p.get("text", "")) for p in parts if isinstance(p, dict)).lower()
            return any(marker in text for marker in _COMPACT_MARKERS)
    return False


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


class CodexHarness(BaseHarness):
    name = "codex"
    default_version = "0.171.0"
    probe = "bin/codex"

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        return npm_install_steps(prefix, NPM_PACKAGE, self.version)

    def codex_home(self, prep: Prepared) -> str:
        return posixpath.join(prep.state_dir, "codex-home")

    def config_toml(self, ctx: HarnessContext) -> str:
        return "\n".join(
            [
                f"model = {_toml_str(ctx.model)}",
                'model_provider = "ares"',
                'approval_policy = "never"',
                'sandbox_mode = "danger-full-access"',
                "check_for_update_on_startup = false",
                "",
                "[model_providers.ares]",
                'name = "ares-gateway"',
                f"base_url = {_toml_str(ctx.openai_base_url)}",
                f"env_key = {_toml_str(TOKEN_ENV)}",
                'wire_api = "responses"',
                "request_max_retries = 6",
                "stream_max_retries = 6",
                "stream_idle_timeout_ms = 900000",
                "",
                "[features]",
                "plugins = false",
                "apps = false",
                "remote_models = false",
                "",
                "[analytics]",
                "enabled = false",
                "",
                "[feedback]",
                "enabled = false",
                "",
            ]
        )

    async def write_config(self, sandbox: Sandbox, ctx: HarnessContext) -> None:
        prep = self._prepared[sandbox.id]
        home = self.codex_home(prep)
        r = await sandbox.exec(
            ["sh", "-c", f"mkdir -p {shlex.quote(home)} && printf %s {shlex.quote(self.config_toml(ctx))} "
                         f">{shlex.quote(home)}/config.toml"],
            user=prep.user, cwd="/", timeout=30,
        )
        if not r.ok:
            raise HarnessLaunchError(self.name, "writing config.toml", r.stderr.strip()[-500:])

    def agent_env(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {
            "CODEX_HOME": self.codex_home(prep),
            TOKEN_ENV: ctx.token,
            "OPENAI_API_KEY": ctx.token,
            "CODEX_DISABLE_UPDATE_CHECK": "1",
            "RUST_LOG": "warn",
        }

    def agent_command(self, ctx: HarnessContext, prep: Prepared, prompt: str) -> str:
        return (
            "codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox --json "
            f"-c background_terminal_max_timeout={self.command_limit(prep) * 1000} "
            f"--model {shlex.quote(ctx.model)} -C {shlex.quote(ctx.workdir)} {shlex.quote(prompt)}"
        )

    def artifact_paths(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {
            "events.jsonl": f"{prep.state_dir}/stdout.log",
            "rollout.jsonl": f"{self.codex_home(prep)}/sessions/*/*/*/rollout-*.jsonl",
        }

    # The function itself (not a wrapper): a detector that already ran it for this protocol can tell.
    is_side_call = staticmethod(codex_is_side_call)
