"""Terminus-2 (harbor's ``Terminus2`` agent, PyPI ``harbor``; Python >= 3.12 inside the sandbox).

Terminus-2 is not a CLI: harbor runs its LLM loop in Python and drives a tmux session through its
environment's ``exec``. A small driver (``harnesses/data/terminus2_driver.py``, uploaded per run) gives
it an environment whose ``exec`` is a local subprocess, so agent, tmux and shell all run in the
sandbox, and points litellm at the session (``openai/<label>``, ``api_base`` = session URL + ``/v1``,
``OPENAI_API_KEY`` = the token): non-streaming ``POST /v1/chat/completions`` with only
``model`` and ``messages``. Replies are JSON ``{"analysis", "plan", "commands": [{"keystrokes",
"duration"}], "task_complete"}``; ``task_complete: true`` must be confirmed twice. tmux runs on a
private socket (``TMUX_TMPDIR`` in the run's state dir) that is killed with the run.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from sandbox import Sandbox

from .base import (
    BaseHarness,
    HarnessContext,
    HarnessLaunchError,
    Prepared,
    pip_install_step,
    pip_version_command,
)

PYPI_PACKAGE = "harbor"
DRIVER = "terminus2_driver.py"
#: First words of the prompts of Terminus-2's context summarization sub-agents.
SUMMARY_MARKERS = (
    "You are about to hand off your work to another AI agent",
    "You are picking up work from a previous AI agent",
    "The next agent has a few questions for you",
)
#: Interpreters tried, in order, for the virtual environment (the first that is >= 3.12 wins).
PYTHON_CANDIDATES = (
    "/opt/ares-agents/python/3.12/bin/python3",  # provisioned by .ci/provision-agents.sh, in the agents image
    "python3.13", "python3.12", "python3",
)


def terminus2_is_side_call(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
    """Terminus-2's summarization sub-agents (summary, questions, answers) are side calls."""
    messages = body.get("messages") or []
    if not messages or not isinstance(messages[-1], dict):
        return False
    content = messages[-1].get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content or "").lstrip()
    return text.startswith(SUMMARY_MARKERS)


class Terminus2Harness(BaseHarness):
    name = "terminus-2"
    default_version = "0.26.0"
    probe = "bin/python"

    def __init__(
        self,
        *,
        python: str | None = None,
        max_turns: int | None = None,
        context_tokens: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.python = python
        self.max_turns = max_turns
        #: The context window Terminus-2 assumes (it summarizes when fewer than 8000 tokens are free).
        self.context_tokens = context_tokens

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        q = shlex.quote(prefix)
        candidates = (self.python,) if self.python else PYTHON_CANDIDATES
        find_python = (
            "for c in " + " ".join(shlex.quote(c) for c in candidates) + "; do "
            "if \"$c\" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then "
            "echo \"$c\"; exit 0; fi; done; "
            "echo 'no Python >= 3.12 with venv found (tried: " + " ".join(candidates) + ")' >&2; exit 127"
        )
        return [
            ("check tmux", "command -v tmux >/dev/null || { [ \"$(id -u)\" = 0 ] && command -v apt-get >/dev/null && "
                           "apt-get update -qq && apt-get install -y -qq --no-install-recommends tmux >/dev/null; } "
                           "|| { echo 'tmux is needed (apt-get install tmux)' >&2; exit 127; }"),
            ("find Python >= 3.12", find_python),
            ("create the virtual environment", f"py=$({find_python}) && rm -rf {q} && \"$py\" -m venv {q}"),
            pip_install_step(prefix, PYPI_PACKAGE, self.version),
        ]

    def version_command(self, prefix: str) -> str:
        return pip_version_command(prefix, PYPI_PACKAGE) + " && command -v tmux >/dev/null"

    async def write_config(self, sandbox: Sandbox, ctx: HarnessContext) -> None:
        prep = self._prepared[sandbox.id]
        source = resources.files("harnesses.data").joinpath(DRIVER).read_text()
        # Written by the run user itself (an upload would belong to the container's root).
        r = await sandbox.exec(
            ["sh", "-c", f"mkdir -p {prep.state_dir}/logs && printf %s {shlex.quote(source)} >{prep.state_dir}/{DRIVER}"],
            user=prep.user, cwd="/", timeout=30,
        )
        if not r.ok:
            raise HarnessLaunchError(self.name, "writing the Terminus-2 driver", r.stderr.strip()[-500:])

    def agent_env(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": ctx.token,
            "TMUX_TMPDIR": prep.state_dir,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def agent_command(self, ctx: HarnessContext, prep: Prepared, prompt: str) -> str:
        st = prep.state_dir
        args = [
            f"{prep.install.prefix if prep.install else ''}/bin/python", f"{st}/{DRIVER}",
            "--instruction-file", f"{st}/instruction.txt",
            "--model", f"openai/{ctx.model}",
            "--api-base", ctx.openai_base_url,
            "--logs-dir", f"{st}/logs",
            "--workdir", ctx.workdir,
            "--session-id", ctx.session_id,
        ]
        if self.max_turns is not None:
            args += ["--max-turns", str(self.max_turns)]
        if self.context_tokens is not None:
            args += ["--context-tokens", str(self.context_tokens)]
        return f"printf %s {shlex.quote(prompt)} >{st}/instruction.txt && " + shlex.join(args)

    def cleanup_command(self, prep: Prepared) -> str | None:
        return f"TMUX_TMPDIR={shlex.quote(prep.state_dir)} tmux kill-server 2>/dev/null"

    def artifact_paths(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {
            "trajectory.json": f"{prep.state_dir}/logs/trajectory.json",
            "context.json": f"{prep.state_dir}/logs/context.json",
            "pane.log": f"{prep.state_dir}/logs/terminus_2.pane",
        }

    @staticmethod
    def is_side_call(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
        return terminus2_is_side_call(body, headers)
