"""Agent harnesses: run real agent CLIs unmodified in a sandbox against a gateway session.

>>> from harnesses import HarnessContext, registry
>>> harness = registry.create("claude-code")
>>> result = await harness.run(sandbox, HarnessContext(workdir, session_id, base_url, token), "Fix the bug")

Depends on ``sandbox`` only. See docs/harnesses.md.
"""

from __future__ import annotations

from . import registry
from .base import (
    INSTALL_ROOT,
    BaseHarness,
    HarnessContext,
    HarnessError,
    HarnessInstallError,
    HarnessLaunchError,
    HarnessResult,
    InstallInfo,
    Prepared,
)
from .claude_code import ClaudeCodeHarness, claude_code_is_side_call
from .codex import CodexHarness, codex_is_side_call
from .mini_swe_agent import MiniSweAgentHarness
from .scripted import CallTool, Finish, RunCommand, ScriptedPolicy
from .terminus2 import Terminus2Harness, terminus2_is_side_call

__all__ = [
    "INSTALL_ROOT",
    "BaseHarness",
    "CallTool",
    "ClaudeCodeHarness",
    "CodexHarness",
    "Finish",
    "HarnessContext",
    "HarnessError",
    "HarnessInstallError",
    "HarnessLaunchError",
    "HarnessResult",
    "InstallInfo",
    "MiniSweAgentHarness",
    "Prepared",
    "RunCommand",
    "ScriptedPolicy",
    "Terminus2Harness",
    "claude_code_is_side_call",
    "codex_is_side_call",
    "registry",
    "terminus2_is_side_call",
]
