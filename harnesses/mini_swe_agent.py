"""mini-swe-agent (PyPI ``mini-swe-agent``, v2), in its own virtual environment in the sandbox.

It calls models through litellm: ``mini -m openai/<label>`` with ``OPENAI_API_BASE`` = session URL +
``/v1`` and ``OPENAI_API_KEY`` = the token sends non-streaming ``POST /v1/chat/completions`` (the
``openai/`` prefix is stripped on the wire). ``MSWEA_COST_TRACKING=ignore_errors`` keeps it from
failing on an unknown model's cost, ``LITELLM_LOCAL_MODEL_COST_MAP=True`` from fetching the cost map.
Run: ``mini -m openai/<label> -c mini.yaml -c environment.timeout=N -t TASK -y --exit-immediately
-o traj.json </dev/null``; the trajectory file is kept as ``trajectory.json``. Every request is main
line (mini has no side calls).

One command may run ``N`` = :meth:`~harnesses.base.BaseHarness.command_limit` seconds (the run's
time budget unless ``command_timeout`` is given) instead of mini's default 30 s, after which mini
kills the command's process group and shows the model a timeout message.

``action_format="text"`` runs mini in its text-based mode (``-c mini_textbased.yaml --model-class
litellm_textbased``): the model writes its command in a ```` ```mswea_bash_command ```` block instead
of a tool call, and no tool schemas are sent. That is the mode for models without a tool-call format
(SmolLM2 in ``ares-gateway demo``). The default ``"tools"`` is mini's own default (``mini.yaml``,
one ``bash`` tool call per step). ``action_regex`` (text mode) replaces mini's regex for the action
(``-c model.action_regex=...``), e.g. :data:`LENIENT_ACTION_REGEX`, which also takes a ```` ```bash ````
block: small models write those, and mini drops an answer without an action from its history.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .base import BaseHarness, HarnessContext, Prepared, pip_install_step, pip_version_command

PYPI_PACKAGE = "mini-swe-agent"
#: A text-mode action regex that also accepts ```bash / ```sh blocks (mini's own: mswea_bash_command only).
LENIENT_ACTION_REGEX = r"```(?:mswea_bash_command|bash|sh)[ \t]*\n(.*?)\n```"


class MiniSweAgentHarness(BaseHarness):
    name = "mini-swe-agent"
    default_version = "2.4.6"
    probe = "bin/mini"
    #: The interpreter that builds the virtual environment (>= 3.10).
    python = "python3"
    #: The builtin mini config the run starts from (``-c``; naming any config drops mini's default).
    config = "mini.yaml"
    #: ``action_format`` -> (builtin config, ``--model-class`` or ``None`` for mini's default).
    ACTION_FORMATS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "tools": ("mini.yaml", None),
        "text": ("mini_textbased.yaml", "litellm_textbased"),
    }

    def __init__(self, *, action_format: str = "tools", action_regex: str | None = None,
                 **options: Any) -> None:
        if action_format not in self.ACTION_FORMATS:
            raise ValueError(
                f"action_format must be one of {', '.join(self.ACTION_FORMATS)}, got {action_format!r}")
        if action_regex is not None and action_format != "text":
            raise ValueError("action_regex is for action_format='text'")
        super().__init__(**options)
        #: How the model writes its actions: ``tools`` (tool calls) or ``text`` (a fenced command block).
        self.action_format = action_format
        self.action_regex = action_regex
        self.config, self._model_class = self.ACTION_FORMATS[action_format]

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        q = shlex.quote(prefix)
        py = shlex.quote(self.python)
        return [
            ("check python",
             f"{py} -c 'import sys, venv; assert sys.version_info >= (3, 10), sys.version' || "
                             "{ echo 'python >= 3.10 with venv is needed (apt-get install python3-venv)' "
                             ">&2; exit 127; }"),
            ("create the virtual environment", f"rm -rf {q} && {py} -m venv {q}"),
            pip_install_step(prefix, PYPI_PACKAGE, self.version),
        ]

    def version_command(self, prefix: str) -> str:
        return pip_version_command(prefix, PYPI_PACKAGE)

    def agent_env(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": posixpath.join(prep.state_dir, "mswea-config"),
            "MSWEA_SILENT_STARTUP": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "HF_HUB_OFFLINE": "1",
            "OPENAI_API_KEY": ctx.token,
            "OPENAI_API_BASE": ctx.openai_base_url,
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "PYTHONUNBUFFERED": "1",
        }

    def agent_command(self, ctx: HarnessContext, prep: Prepared, prompt: str) -> str:
        model_class = f"--model-class {shlex.quote(self._model_class)} " if self._model_class else ""
        if self.action_regex is not None:
            model_class += f"-c {shlex.quote('model.action_regex=' + self.action_regex)} "
        return (
            f"mini -m {shlex.quote('openai/' + ctx.model)} -c {shlex.quote(self.config)} {model_class}"
            f"-c environment.timeout={self.command_limit(prep)} -t {shlex.quote(prompt)} -y "
            "--exit-immediately "
            f"-o {shlex.quote(prep.state_dir + '/trajectory.json')}"
        )

    def artifact_paths(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        return {"trajectory.json": f"{prep.state_dir}/trajectory.json"}

    @staticmethod
    def is_side_call(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
        return False
