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

import os
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
#: The host environment variable naming the interpreter (a path inside the sandbox) to build the venv with.
PYTHON_ENV = "ARES_TERMINUS2_PYTHON"
#: Interpreters tried, in order, for the virtual environment: the first that is >= 3.12 and has
#: ``venv`` and ``ensurepip`` wins. Shell words, expanded inside the sandbox: ``$INSTALL_ROOT`` is the
#: harness's install root, ``$REAL_HOME`` the run user's home from the passwd database (the local
#: sandbox sets ``HOME`` to the workdir and ``PATH`` to the system directories only, which hides
#: pyenv's and uv's interpreters); globs sort by name, so the lowest matching version comes first.
PYTHON_CANDIDATES = (
    '"$INSTALL_ROOT"/python/*/bin/python3',  # provisioned by .ci/provision-agents.sh, in the agents image
    "python3.12", "python3.13", "python3.14", "python3",  # on PATH
    "/usr/local/bin/python3.1[2-9]", "/usr/bin/python3.1[2-9]",
    '"${PYENV_ROOT:-/nonexistent}"/versions/*/bin/python3',
    '"$HOME"/.pyenv/versions/*/bin/python3', '"$REAL_HOME"/.pyenv/versions/*/bin/python3',
    "/root/.pyenv/versions/*/bin/python3",
    '"$HOME"/.local/share/uv/python/*/bin/python3', '"$REAL_HOME"/.local/share/uv/python/*/bin/python3',
    "/root/.local/share/uv/python/*/bin/python3",
    "/opt/conda/bin/python3", "/usr/local/python/*/bin/python3",
)
#: What to do when no interpreter is found (the install step's error says it).
NO_PYTHON_HELP = (
    "Terminus-2 (harbor) needs a Python >= 3.12 with venv where the agent runs. Install one "
    "(apt-get install python3.12-venv, `uv python install 3.12` or `pyenv install 3.12`), or run "
    "`bash .ci/provision-agents.sh`, which copies one to /opt/ares-agents/python/3.12 (local sandboxes "
    f"see it; the agents image has it), or name one with {PYTHON_ENV}=/path/to/python3.12 "
    "(a path inside the sandbox) or Terminus2Harness(python=...)."
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
        python_candidates: Sequence[str] = PYTHON_CANDIDATES,
        max_turns: int | None = None,
        context_tokens: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        #: The interpreter for the venv (a path or command inside the sandbox); default: the
        #: ``ARES_TERMINUS2_PYTHON`` environment variable, else the first of ``PYTHON_CANDIDATES``.
        self.python = python or os.environ.get(PYTHON_ENV) or None
        #: Shell words tried in order when no interpreter is named (see ``PYTHON_CANDIDATES``).
        self.python_candidates = tuple(python_candidates)
        self.max_turns = max_turns
        #: The context window Terminus-2 assumes (it summarizes when fewer than 8000 tokens are free).
        self.context_tokens = context_tokens

    def find_python_command(self) -> str:
        """A shell command printing the interpreter for the venv, or failing (exit 127) with what to do."""
        if self.python:
            candidates = shlex.quote(self.python)
            tried = self.python
        else:
            candidates = " ".join(self.python_candidates)
            tried = ", ".join(
                c.replace('"', "").replace("$INSTALL_ROOT",
                                           self.install_root).replace("${PYENV_ROOT:-/nonexistent}",
                                                                                      "$PYENV_ROOT")
                for c in self.python_candidates
            )
        check = "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))"
        return (
            f"INSTALL_ROOT={shlex.quote(self.install_root)}; "
            'REAL_HOME=$(getent passwd "$(id -u)" 2>/dev/null | cut -d: -f6); '
            'REAL_HOME=${REAL_HOME:-/nonexistent}; '
            f"for c in {candidates}; do "
            'case "$c" in */*) [ -x "$c" ] || continue ;; *) c=$(command -v "$c" 2>/dev/null) || '
            'continue ;; esac; '
            f"if \"$c\" -c {shlex.quote(check)} 2>/dev/null; then echo \"$c\"; exit 0; fi; done; "
            f"echo {shlex.quote(f'no Python >= 3.12 with venv found (tried: {tried}). {NO_PYTHON_HELP}')} "
            ">&2; exit 127"
        )

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        q = shlex.quote(prefix)
        find_python = self.find_python_command()
        return [
            ("check tmux",
             "command -v tmux >/dev/null || { [ \"$(id -u)\" = 0 ] && command -v apt-get >/dev/null && "
                           "apt-get update -qq && apt-get install -y -qq --no-install-recommends tmux "
                           ">/dev/null; } || { echo 'tmux is needed (apt-get install tmux)' >&2; "
                           "exit 127; }"),
            ("find Python >= 3.12", find_python),
            ("create the virtual environment",
             f"py=$({find_python}) && echo \"using $py\" && rm -rf {q} && \"$py\" -m venv {q}"),
            pip_install_step(prefix, PYPI_PACKAGE, self.version),
        ]

    def version_command(self, prefix: str) -> str:
        return pip_version_command(prefix, PYPI_PACKAGE) + " && command -v tmux >/dev/null"

    async def write_config(self, sandbox: Sandbox, ctx: HarnessContext) -> None:
        prep = self._prepared[sandbox.id]
        source = resources.files("harnesses.data").joinpath(DRIVER).read_text()
        # Written by the run user itself (an upload would belong to the container's root).
        r = await sandbox.exec(
            ["sh", "-c",
             f"mkdir -p {prep.state_dir}/logs && printf %s {shlex.quote(source)} >{prep.state_dir}/{DRIVER}"],
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

    # The function itself (not a wrapper): a detector that already ran it for this protocol can tell.
    is_side_call = staticmethod(terminus2_is_side_call)
