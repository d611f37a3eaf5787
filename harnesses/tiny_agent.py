"""``tiny-agent``: a minimal chat-completions agent (python3 standard library only) as a harness.

It exists for benchmarks and fast tests, where a real CLI's start-up (mini-swe-agent imports litellm
for ~10 s) would hide what is being measured: it starts in milliseconds, sends non-streaming
``POST {OPENAI_BASE_URL}/chat/completions`` with one ``bash`` tool, runs each tool call with the shell,
and exits when the reply has no tool call or a command prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
first (mini-swe-agent's convention, so the ``scripted`` / ``oracle`` policies drive it in
mini-swe-agent's format). Registered like the other harnesses (``registry.create("tiny-agent")``,
presets ``{dataset}-tiny-agent`` or ``{dataset}-tiny``).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .base import BaseHarness, HarnessContext, Prepared

VERSION = "1.0.0"

SCRIPT = r'''#!/usr/bin/env python3
import json, os, subprocess, sys, urllib.request
if sys.argv[1:] == ["--version"]:
    print("tiny-agent __VERSION__"); sys.exit(0)
base = os.environ["OPENAI_BASE_URL"].rstrip("/")
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
max_turns = int(os.environ.get("TINY_AGENT_MAX_TURNS", "50"))
tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "system", "content": "You are a tiny agent: use the bash tool; answer without a tool call when done."},
            {"role": "user", "content": sys.argv[1]}]
for _ in range(max_turns):
    body = json.dumps({"model": os.environ.get("TINY_AGENT_MODEL", "ares-policy"), "messages": messages,
                       "tools": tools}).encode()
    req = urllib.request.Request(base + "/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=3600) as resp:
        msg = json.load(resp)["choices"][0]["message"]
    messages.append({k: v for k, v in msg.items() if v is not None})
    calls = msg.get("tool_calls") or []
    if not calls:
        sys.exit(0)
    for call in calls:
        command = json.loads(call["function"]["arguments"] or "{}").get("command", "")
        p = subprocess.run(command, shell=True, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.stdout.lstrip().startswith("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"):
            sys.exit(0)
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": (p.stdout + p.stderr)[-10000:] + "\n[exit code %d]" % p.returncode})
print("tiny-agent: turn limit reached", file=sys.stderr)
sys.exit(3)
'''.replace("__VERSION__", VERSION)  # noqa: E501 (an embedded script, kept as it runs)


class TinyAgentHarness(BaseHarness):
    name = "tiny-agent"
    default_version = VERSION
    probe = "bin/tiny-agent"
    #: The scripted / oracle policies answer it in this agent's action format.
    scripted_format: ClassVar[str] = "mini-swe-agent"

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        q = shlex.quote(prefix)
        return [
            ("write tiny-agent", f"mkdir -p {q}/bin && cat > {q}/bin/tiny-agent <<'ARES_TINY_EOF'\n{SCRIPT}"
                                 f"ARES_TINY_EOF\nchmod 755 {q}/bin/tiny-agent")]

    def agent_env(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {"OPENAI_BASE_URL": ctx.openai_base_url, "OPENAI_API_KEY": ctx.token,
                "TINY_AGENT_MODEL": ctx.model}

    def agent_command(self, ctx: HarnessContext, prep: Prepared, prompt: str) -> str:
        return f"python3 \"$(command -v tiny-agent)\" {shlex.quote(prompt)}"

    @staticmethod
    def is_side_call(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
        return False
