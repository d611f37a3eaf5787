"""What a user sees when things go wrong, and the CLI around it, with real parts: the real
``ares-gateway`` CLI in a subprocess (stdout a pipe, as in CI), a real aiohttp upstream on 127.0.0.1,
the tiny agent (a real process) in real local sandboxes.

* failed episodes name their cause in one line (the policy's error, the agent's stderr tail), and a
  failed policy call is a turn of ``turns/`` with its error;
* start-up checks: an unreachable, erroring, hanging or key-refusing upstream, a missing Docker
  engine and a failing harness install end the run at once with exit code 2, one error line, no
  traceback, and ``results.json``;
* ``GatewayEnv(launch=...)``: a launch that does not return fails ``reset()`` with a clear error;
* ``--version``, ``run --help`` (presets, harnesses, datasets, every default, no doc markup), tasks by
  name, progress lines when stdout is no terminal.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from ares_gateway import EpisodeConfig, Gateway, GatewayEnv, RunConfig
from ares_gateway.episodes.env import LaunchTimeoutError
from ares_gateway.episodes.episode import last_lines, one_line
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import FunctionPolicy, UpstreamError, UpstreamPolicy
from tests.helpers import cli, free_port

from .e2e import REPO
from .fake_llm import FakeLLM, running

TASKS = {t.name: t for t in load_dataset("examples").tasks}
GREETING = TASKS["write-greeting-file"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(tmp_path / "sandboxes"), "PYTHONUNBUFFERED": "1",
            "COLUMNS": "", **extra}


async def _cli(*args: str, env: dict[str, str], timeout: float = 120.0) -> tuple[int, str, str, float]:
    """Run the real CLI as a subprocess (stdout and stderr pipes) without blocking this loop."""
    env = {k: v for k, v in env.items() if v != ""}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*cli(*args), cwd=REPO, env=env,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - started


def _assert_one_clean_error(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ares-gateway: error: ")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# ---------------------------------------------------------------------------------------------- one-line
# errors


def test_one_line_keeps_what_failed_and_the_cause() -> None:
    tb = ("Traceback (most recent call last):\n  File \"a.py\", line 1\n" + "  noise\n" * 500
          + "ValueError: the cause")
    line = one_line("harness 'x': install step 'y' failed: exit 1:\n" + tb)
    assert line is not None and "\n" not in line and len(line) <= 620
    assert line.startswith("harness 'x': install step 'y' failed") and line.endswith("ValueError: the cause")
    assert last_lines(tb, 60).endswith("ValueError: the cause") and "\n" not in last_lines(tb)
    assert one_line(None) is None and one_line(" \n ") == ""


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_erroring_upstream_episode_names_the_policy_error_and_turns_keep_it(
        tmp_path: Path, sandbox_root: Path) -> None:
    """The agent got 502s from a failing upstream and crashed: the error says both, in one line, and the
    failed call is in turns/ with its error (it was only in WARNING lines before)."""
    out = tmp_path / "run"
    async for llm in running(FakeLLM(fail_next=[500] * 50)):
        async with UpstreamPolicy(base_url=llm.url, max_attempts=1) as policy:
            summary = await run_rollouts(
                [GREETING], policy=policy, episode=EpisodeConfig("tiny-agent", sandbox="local"),
                run=RunConfig(out=out, stats="null"),
            )
    [e] = summary.episodes
    assert e.exit_reason == "agent_error" and e.reward == 0.0
    assert e.error is not None and "\n" not in e.error
    assert e.error.startswith(
        "the policy failed on 1 of 1 request(s) (last: 502 upstream answered 500: injected 500")
    assert "then the agent exited with code 1" in e.error and "HTTP Error 502" in e.error
    [doc_e] = json.loads((out / "results.json").read_text())["episodes"]
    [line_e] = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert doc_e["error"] == line_e["error"] == e.error
    [turn] = [json.loads(x) for x in (out / "turns" / f"{GREETING.name}.0.jsonl").read_text().splitlines()]
    assert turn["error"]["status"] == 502 and "injected 500" in turn["error"]["message"]
    assert turn["request"]["messages"][1]["content"] == GREETING.instruction and "completion" not in turn


async def test_a_raising_policy_is_named_and_recorded(tmp_path: Path, sandbox_root: Path) -> None:
    async def broken(request: object) -> str:
        raise RuntimeError("the policy's own bug\nsecond line")

    out = tmp_path / "run"
    summary = await run_rollouts(
        [GREETING], policy=FunctionPolicy(broken), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(out=out, stats="null"),
    )
    [e] = summary.episodes
    assert e.error is not None and "\n" not in e.error
    assert ("the policy failed on 1 of 1 request(s) (last: 502 the policy failed: RuntimeError: the "
            "policy's own bug") \
        in e.error
    [turn] = [json.loads(x) for x in (out / "turns" / f"{GREETING.name}.0.jsonl").read_text().splitlines()]
    assert "RuntimeError: the policy's own bug" in turn["error"]["message"]


# ---------------------------------------------------------------------------------------------- preflight


class _Upstream:
    """An OpenAI-like server on 127.0.0.1 whose /models behaves as told."""

    def __init__(self, *, models: list[str] | None = None, key: str | None = None,
                 hang: bool = False) -> None:
        self.models, self.key, self.hang = models, key, hang
        self.url = ""
        self.chat_hits = 0

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.hang:
            await asyncio.sleep(3600)
        if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        if self.models is None:
            raise web.HTTPNotFound()
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.chat_hits += 1
        return web.json_response({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "length"}]})

    async def run(self) -> AsyncIterator[_Upstream]:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
        try:
            yield self
        finally:
            await runner.cleanup()


async def test_upstream_check() -> None:
    async for up in _Upstream(models=["Qwen/Qwen3-8B"], key="sekrit").run():
        async with UpstreamPolicy(base_url=up.url, model="Qwen/Qwen3-8B", api_key="sekrit") as ok:
            assert "answers (serves Qwen/Qwen3-8B)" in await ok.check()
        async with UpstreamPolicy(base_url=up.url, model="other", api_key="sekrit") as wrong_model:
            with pytest.raises(UpstreamError, match=r"does not serve model 'other'; it serves Qwen/Qwen3-8B"):
                await wrong_model.check()
        async with UpstreamPolicy(base_url=up.url, api_key="wrong") as wrong_key:
            with pytest.raises(UpstreamError, match=r"refused the API key \(401\).*--api-key-env") as info:
                await wrong_key.check()
            # no secret in the message
            assert "wrong" not in str(info.value) and "sekrit" not in str(info.value)
    async for up in _Upstream(models=None).run():  # no /models: one tiny chat completion instead
        async with UpstreamPolicy(base_url=up.url) as bare:
            assert "no /models" in await bare.check() and up.chat_hits == 1
    async for up in _Upstream(hang=True).run():
        async with UpstreamPolicy(base_url=up.url) as slow:
            started = time.monotonic()
            with pytest.raises(UpstreamError, match=r"did not answer within 1 s"):
                await slow.check(timeout=1.0)
            assert time.monotonic() - started < 5


async def test_cli_unreachable_upstream_fails_at_once_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, _, err, took = await _cli(
        "run", "examples-tiny", "--policy", "upstream", "--base-url", f"http://127.0.0.1:{free_port()}/v1",
        "--sandbox", "local", "--out", str(out), env=_env(tmp_path))
    _assert_one_clean_error(rc, err, "cannot reach upstream", "start the server or fix --base-url")
    assert took < 15, took  # was ~37 s of retries per episode
    doc = json.loads((out / "results.json").read_text())
    assert "cannot reach upstream" in doc["error"] and doc["episodes"] == [] and doc["summary"][
        "planned"] == 4
    assert not (tmp_path / "sandboxes").exists() or not list((tmp_path / "sandboxes").iterdir())


async def test_cli_erroring_upstream_fails_the_start_up_check(tmp_path: Path) -> None:
    async for llm in running(FakeLLM(fail_next=[500] * 10)):  # no /models: the tiny request gets the 500
        rc, _, err, _ = await _cli("run", "examples-tiny:0", "--policy", "upstream", "--base-url", llm.url,
                                   "--sandbox", "local", "--out", str(tmp_path / "out"), env=_env(tmp_path))
        hits = llm.hits
    _assert_one_clean_error(rc, err, "upstream answered 500: injected 500", "start-up check")
    assert hits == 1  # one try, no retries
    assert json.loads((tmp_path / "out" / "results.json").read_text())["error"]


async def test_cli_missing_docker_engine_is_reported_once_at_start(tmp_path: Path) -> None:
    rc, _, err, took = await _cli("run", "examples-tiny", "--sandbox", "docker", "--out",
                                  str(tmp_path / "out"),
                                  env=_env(tmp_path, DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock"))
    _assert_one_clean_error(rc, err, "no Docker engine answers", "--sandbox local")
    assert took < 30


@pytest.mark.docker
async def test_cli_missing_docker_image_is_reported_once_at_start(tmp_path: Path) -> None:
    from tests.prereq import docker_ok, require

    require(docker_ok(), "no Docker engine answers: run bash .ci/provision-docker.sh", docker=True)
    rc, _, err, _ = await _cli("run", "examples-tiny", "--sandbox", "docker", "--image",
                               "ares-gateway/no-such:never", "--out", str(tmp_path / "out"),
                               env=_env(tmp_path, ARES_DOCKER_PULL=""))
    _assert_one_clean_error(rc, err, "the Docker image ares-gateway/no-such:never is not on this engine")


async def test_cli_harness_install_failure_is_one_line_and_results_json(tmp_path: Path) -> None:
    """A harness whose install fails (as Terminus-2's did without Python 3.12): one line, exit code 2,
    results.json written, never a raw traceback."""
    script = textwrap.dedent(f"""
        import sys
        import ares_gateway.episodes.installs as installs
        from ares_gateway.cli import main
        from ares_gateway.episodes.selectors import register_harness
        from harnesses import registry
        from harnesses.tiny_agent import TinyAgentHarness

        class Broken(TinyAgentHarness):
            name = "broken-agent"
            def install_steps(self, prefix):
                return [("find Python >= 3.12", "echo 'no Python >= 3.12 with venv found' >&2; exit 3")]

        registry.register("broken-agent", Broken)
        register_harness("broken-agent")
        installs._install_candidates = lambda: [{str(tmp_path / 'agents')!r}]
        sys.exit(main(sys.argv[1:]))
    """)
    env = {k: v for k, v in _env(tmp_path).items() if v != ""}
    out = tmp_path / "out"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, "run", "examples-broken-agent", "--sandbox", "local", "--out", str(out),
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err_b = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    line = _assert_one_clean_error(proc.returncode, err_b.decode(),
                                   "install step 'find Python >= 3.12' failed",
                                   "no Python >= 3.12 with venv found")
    assert "\n" not in line
    doc = json.loads((out / "results.json").read_text())
    assert "no Python >= 3.12" in doc["error"] and doc["run"]["harness"] == "broken-agent"


# ---------------------------------------------------------------------------------------------- GatewayEnv
# launch=


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_env_launch_that_does_not_return_fails_reset_clearly() -> None:
    async with Gateway(port=0) as gw:
        async def waits_for_the_agent(session: object) -> None:
            await asyncio.sleep(3600)  # e.g. awaiting the agent process to exit: it never could

        env = GatewayEnv(gw, launch=waits_for_the_agent, launch_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(LaunchTimeoutError, match=r"launch= did not return within 0.5 s.*not wait for it"):
            await env.reset()
        assert time.monotonic() - started < 5
        assert len(gw.sessions) == 0 and env.session is None  # the session it created is gone

        async def fails(session: object) -> None:
            raise OSError("no such agent binary")

        with pytest.raises(OSError, match="no such agent binary"):
            await GatewayEnv(gw, launch=fails).reset()
        assert len(gw.sessions) == 0
        with pytest.raises(ValueError, match="launch_timeout must be positive"):
            GatewayEnv(gw, launch=fails, launch_timeout=0)


# ---------------------------------------------------------------------------------------------- CLI


_MARKUP = re.compile(r"``|:(?:class|func|meth|mod|data|attr):|`[^`]+`")


async def test_cli_version_and_help(tmp_path: Path) -> None:
    from importlib.metadata import version

    env = _env(tmp_path, COLUMNS="120")
    rc, out, _, _ = await _cli("--version", env=env)
    assert rc == 0 and out.strip() == f"ares-gateway {version('ares-gateway')}"
    helps = {}
    for args in ((), ("run",), ("serve",), ("demo",), ("gc",)):
        rc, out, err, _ = await _cli(*args, "--help", env=env)
        assert rc == 0, err
        assert not _MARKUP.search(out), (args, _MARKUP.search(out))
        helps[args] = out
    run_help = helps[("run",)]
    for needle in ("examples-mswea", "examples-cc", "examples-codex", "examples-terminus",  # presets
                   "mini-swe-agent (mswea)", "claude-code (cc)", "terminus-2 (terminus)",  # harnesses
                   "examples: 4 task(s): fix-median-bug",  # datasets
                   "examples-mswea:fix-median-bug"):
        assert needle in run_help, needle
    for args, text in helps.items():
        # Every option but --help and --version says its default.
        options = re.split(r"\n  (?=-)", text.split("options:", 1)[1].split("\n\n", 1)[0])[1:]
        for option in options:
            if option.startswith(("-h, --help", "--version")):
                continue
            assert "(default: " in " ".join(option.split()), (args, option)


async def test_cli_task_by_name_and_progress_lines_on_a_pipe(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, stdout, err, _ = await _cli("run", "examples-tiny:write-greeting-file,fix-median-bug", "--policy",
                                    "oracle", "--sandbox", "local", "--out", str(out), "--stats", "null",
                                    env=_env(tmp_path), timeout=300)
    assert rc == 0, stdout[-3000:] + err[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert sorted(e["task"] for e in doc["episodes"]) == ["fix-median-bug", "write-greeting-file"]
    assert all(e["reward"] == 1.0 for e in doc["episodes"])
    assert "preflight: tiny-agent installed under" in stdout
    progress = [line for line in stdout.splitlines()
                if re.search(r"tiny-agent: 2 task\(s\): \d/2 done", line)]
    assert progress and progress[-1].startswith("tiny-agent: 2 task(s): 2/2 done"), stdout
    assert "mean reward 1.000" in progress[-1]
    assert max(len(line) for line in stdout.splitlines()) > 80  # not cut at rich's default 80 columns
    header = stdout.splitlines()[0]
    assert header.endswith("concurrency 4"), header


async def test_an_invalid_answer_is_a_failed_call_and_the_episode_goes_on(tmp_path: Path,
                                                                          sandbox_root: Path) -> None:
    async def bogus(request: object) -> dict[str, object]:
        return {"not": "a chat completion"}

    out = tmp_path / "run"
    summary = await run_rollouts(
        [GREETING], policy=FunctionPolicy(bogus), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(out=out, stats="null"),
    )
    [e] = summary.episodes
    assert e.exit_reason == "agent_error" and e.error is not None  # the agent got a 502 and crashed
    assert "(last: 502 the policy gave an invalid answer: " in e.error and "HTTP Error 502" in e.error
    [turn] = [json.loads(x) for x in (out / "turns" / f"{GREETING.name}.0.jsonl").read_text().splitlines()]
    assert turn["error"]["message"].startswith("the policy gave an invalid answer")
    # a real episode's outputs, not a crash
    assert (out / "logs" / f"{GREETING.name}.0" / "stderr.log").exists()


async def test_a_harness_error_without_detail_still_says_something(sandbox_root: Path) -> None:
    from harnesses.base import HarnessLaunchError
    from harnesses.tiny_agent import TinyAgentHarness

    class Silent(TinyAgentHarness):
        async def prepare(self, sb, ctx):  # type: ignore[no-untyped-def]
            raise HarnessLaunchError(self.name, "launching the agent", "")

    env = GatewayEnv(task=GREETING, harness=Silent(), sandbox="local")
    try:
        ts = await env.reset()
    finally:
        await env.close()
    assert ts.last() and ts.info["exit_reason"] == "agent_error"
    assert ts.info["error"] == ("harness 'tiny-agent': launching the agent failed "
                                "(no error output; the agent's logs may say more)")
