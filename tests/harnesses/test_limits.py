"""Per-harness command limits (derived from the run's time budget) and Terminus-2's Python discovery.

The limits are what each agent CLI reads: mini-swe-agent's ``environment.timeout`` (default 30 s),
Claude Code's ``BASH_DEFAULT_TIMEOUT_MS``/``BASH_MAX_TIMEOUT_MS`` (2 and 10 min) and its
background-task switch (which also blocks a standalone ``sleep``), Codex's
``background_terminal_max_timeout`` (5 min). The end-to-end proof that a command of over a minute
runs through each real CLI is tests/rollouts/test_real_length.py.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import sandbox
from harnesses import HarnessContext, HarnessInstallError, Prepared, registry
from harnesses.base import DEFAULT_TIME_BUDGET
from harnesses.scripted import Finish, RunCommand, Step
from harnesses.terminus2 import NO_PYTHON_HELP, PYTHON_CANDIDATES, PYTHON_ENV, Terminus2Harness

from .conftest import require_backend

CTX = HarnessContext(workdir="/workspace", session_id="s1", base_url="http://127.0.0.1:9/s/s1",
                     token="t" * 16)


def _prep(budget: float | None) -> Prepared:
    return Prepared(user=None, home="/home/agent", state_dir="/home/agent/.ares/x/s1", time_budget=budget)


@pytest.mark.parametrize(("budget", "option", "seconds"), [
    (330.0, None, 330),       # the run's budget (the task's agent timeout + the episode's grace)
    (90.4, None, 91),         # whole seconds, rounded up
    (None, None, int(DEFAULT_TIME_BUDGET)),
    (330.0, 45.0, 45),        # command_timeout= overrides the budget
])
def test_each_agent_gets_its_command_limit_from_the_time_budget(
    budget: float | None, option: float | None, seconds: int
) -> None:
    opts = {"command_timeout": option} if option is not None else {}
    prep = _prep(budget)

    mini = registry.create("mini-swe-agent", **opts)
    cmd = shlex.split(mini.agent_command(CTX, prep, "do it"))
    # `-c mini.yaml` first: naming any -c config drops mini's default one.
    assert cmd[cmd.index("-c") + 1] == "mini.yaml"
    assert f"environment.timeout={seconds}" in cmd

    claude = registry.create("claude-code", **opts)
    env = claude.agent_env(CTX, prep)
    assert env["BASH_DEFAULT_TIMEOUT_MS"] == env["BASH_MAX_TIMEOUT_MS"] == str(seconds * 1000)
    assert env["CLAUDE_CODE_DISABLE_BACKGROUND_TASKS"] == "1"

    codex = registry.create("codex", **opts)
    cmd = shlex.split(codex.agent_command(CTX, prep, "do it"))
    assert cmd[cmd.index("-c") + 1] == f"background_terminal_max_timeout={seconds * 1000}"
    assert cmd[0:2] == ["codex", "exec"] and cmd[-1] == "do it"


@pytest.mark.parametrize("bad", [0, -1.0])
def test_command_timeout_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="command_timeout"):
        registry.create("codex", command_timeout=bad)


# ---------------------------------------------------------------- Terminus-2's Python discovery


def _python312() -> str | None:
    """A real interpreter >= 3.12 with venv on this machine (the discovery must accept it)."""
    for cand in ["/opt/ares-agents/python/3.12/bin/python3",
                 *sorted(glob.glob("/root/.pyenv/versions/3.1[2-9]*/bin/python3")),
                 shutil.which("python3.12") or "", shutil.which("python3.13") or ""]:
        if cand and os.access(cand, os.X_OK):
            ok = subprocess.run(
                [cand, "-c", "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))"],
                capture_output=True, check=False)
            if ok.returncode == 0:
                return cand
    return None


def _run_find(harness: Terminus2Harness, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", harness.find_python_command()], env=env, capture_output=True,
                          text=True, check=False, timeout=60)


def _old_python(tmp: Path) -> str:
    """A directory whose ``python3`` is too old (3.11), as a stock Debian bookworm's PATH has."""
    d = tmp / "oldbin"
    d.mkdir()
    fake = d / "python3"
    fake.write_text("#!/bin/sh\nexit 1\n")  # fails the version check, as 3.11 does
    fake.chmod(0o755)
    return str(d)


def test_default_candidates_cover_the_usual_places() -> None:
    words = " ".join(PYTHON_CANDIDATES)
    for place in ("/python/*/bin/python3", "PYENV_ROOT", ".pyenv/versions/*", "/root/.pyenv/versions/*",
                  ".local/share/uv/python/*", "/usr/local/bin/python3.1", "python3.12", "REAL_HOME"):
        assert place in words, place


def test_pyenv_interpreter_is_found_though_path_and_home_hide_it(tmp_path: Path) -> None:
    """The local sandbox's PATH has only system dirs and HOME is the workdir: pyenv's 3.12 is found anyway."""
    real = _python312()
    if real is None:
        pytest.skip("no Python >= 3.12 on this machine to stand in for pyenv's")
    root = tmp_path / "pyenv"
    (root / "versions" / "3.12.99" / "bin").mkdir(parents=True)
    (root / "versions" / "3.12.99" / "bin" / "python3").symlink_to(real)
    harness = Terminus2Harness(install_root=str(tmp_path / "no-provisioned-python"))
    env = {"PATH": f"{_old_python(tmp_path)}:/usr/bin:/bin", "HOME": str(tmp_path / "work"),
           "PYENV_ROOT": str(root)}
    r = _run_find(harness, env)
    assert r.returncode == 0, r.stderr
    found = r.stdout.strip()
    # Either the fake pyenv one, or one found earlier in the list (a system python3.12 / the host's pyenv).
    assert found.endswith("python3") or "python3.1" in found
    # Restricted to the pyenv pattern alone, it is exactly the pyenv interpreter.
    only = Terminus2Harness(
        python_candidates=['"${PYENV_ROOT:-/nonexistent}"/versions/*/bin/python3', "python3"])
    r = _run_find(only, env)
    assert r.returncode == 0 and r.stdout.strip() == str(root / "versions" / "3.12.99" / "bin" / "python3"), r


def test_no_python_fails_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    harness = Terminus2Harness(python_candidates=["/nonexistent/bin/python3", "python3"])
    r = _run_find(harness, {"PATH": f"{_old_python(tmp_path)}:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 127 and r.stdout == ""
    assert "no Python >= 3.12 with venv found (tried: /nonexistent/bin/python3, python3)" in r.stderr
    assert NO_PYTHON_HELP in r.stderr
    for hint in ("provision-agents.sh", PYTHON_ENV, "uv python install 3.12", "pyenv install 3.12"):
        assert hint in r.stderr


def test_python_named_by_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PYTHON_ENV, "/somewhere/python3.12")
    assert Terminus2Harness().python == "/somewhere/python3.12"
    assert Terminus2Harness(python="/explicit/python3").python == "/explicit/python3"


async def test_install_without_python_raises_a_clean_install_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a real local sandbox: the install step fails as a HarnessInstallError naming the step."""
    if shutil.which("bwrap") is None or shutil.which("tmux") is None:
        pytest.skip("needs bubblewrap and tmux (apt-get install bubblewrap tmux)")
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    root = tmp_path / "agents"  # an empty, writable install root: nothing provisioned
    root.mkdir()
    harness = Terminus2Harness(user=None, install_root=str(root), python="/nonexistent/python3.12",
                               install_timeout=120)
    async with sandbox.create(sandbox.SandboxSpec(), backend="local") as sb:
        ctx = HarnessContext(workdir=sb.workdir, session_id="nopython", base_url="http://127.0.0.1:9",
                             token="x" * 16)
        await harness.prepare(sb, ctx)
        with pytest.raises(HarnessInstallError) as info:
            await harness.install(sb)
    err = info.value
    assert err.harness == "terminus-2" and err.step == "install step 'find Python >= 3.12'"
    assert "exit 127" in err.detail and PYTHON_ENV in err.detail and "provision-agents.sh" in err.detail


async def test_pyenv_python_is_found_inside_a_local_sandbox(tmp_path: Path) -> None:
    """The real local sandbox (scrubbed PATH, HOME = workdir): the default candidates still find a 3.12+."""
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap (apt-get install bubblewrap)")
    if not glob.glob("/root/.pyenv/versions/3.1[2-9]*/bin/python3") and not glob.glob(
            "/usr/local/bin/python3.1[2-9]"):
        pytest.skip("no pyenv or /usr/local Python >= 3.12 on this host")
    harness = Terminus2Harness(install_root=str(tmp_path / "nothing-provisioned"))
    async with sandbox.create(sandbox.SandboxSpec(), backend="local") as sb:
        r = await sb.exec(["sh", "-c", harness.find_python_command()], timeout=60)
    assert r.ok, r.stderr
    assert "/opt/ares-agents" not in r.stdout and "python3" in r.stdout


# ---------------------------------------------------------------- the real CLIs honour the limit


def _tool_outputs(seen: list[Any]) -> str:
    """Everything the agent sent after its first request (where tool results arrive)."""
    return "\n".join(json.dumps(r.request.raw) for r in seen[1:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mini-swe-agent", "claude-code"])
async def test_a_command_over_the_limit_is_cut_by_the_agent(name: str) -> None:
    """command_timeout=5: the agent itself stops a 30-s command (so the setting reaches the CLI)."""
    from .test_harnesses import drive

    require_backend("local", name)
    script: list[Step] = [RunCommand("sleep 30; echo ares-not-cut-short"), Finish()]
    result, seen, _turns, _policy = await drive(name, "local", script=script, time_budget=120,
                                                harness_options={"command_timeout": 5})
    assert result.exit_code == 0, (result.stderr_tail, result.stdout_tail)
    # Without the setting mini-swe-agent waits 30 s and Claude Code 2 min for the command.
    assert result.duration < 30, f"the command was not cut short ({result.duration:.0f} s)"
    assert len(seen) >= 2  # the agent went on after the cut


@pytest.mark.slow
async def test_codex_poll_ceiling_is_the_command_limit() -> None:
    """command_timeout=6: each empty write_stdin poll returns after at most ~6 s, not Codex's 5 min."""
    from .test_harnesses import drive

    require_backend("local", "codex")
    script: list[Step] = [RunCommand("sleep 45; echo ares-slept-45"), Finish()]
    result, seen, _turns, policy = await drive("codex", "local", script=script, time_budget=120,
                                               harness_options={"command_timeout": 6})
    assert result.exit_code == 0, (result.stderr_tail, result.stdout_tail)
    # exec_command yields at 30 s, then polls of <= 6 s until the exit at 45 s: two or more polls
    # (with the default ceiling, one poll would wait for the exit).
    assert policy.wait_turns >= 2, policy.wait_turns
    assert "ares-slept-45" in _tool_outputs(seen).replace("; echo ares-slept-45", "")
