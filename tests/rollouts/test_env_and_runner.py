"""GatewayEnv over real local sandboxes and the runner, with the tiny agent (a real process that speaks
chat completions over HTTP, starting in milliseconds): rewards, outputs, limits, failures, cleanup,
the oracle's command, the http policy through a real /poll poller, CLI argument errors."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import sandbox
from ares_gateway import EpisodeConfig, Gateway, GatewayEnv, RunConfig
from ares_gateway.cli import main as cli_main
from ares_gateway.episodes.episode import harness_side_call_detector
from ares_gateway.episodes.rollouts import pass_at_k, run_rollouts
from ares_gateway.episodes.tasks import Task, load_dataset, prepare_workdir
from ares_gateway.episodes.verifier import run_tests
from ares_gateway.policies import HttpPolicy, PolicyError, call_policy, make_policy
from ares_gateway.policies.scripted import SessionScriptedPolicy
from harnesses.tiny_agent import TinyAgentHarness
from tests.helpers import CrashingHarness, left_behind
from tests.prereq import docker_ok, require

TASKS = load_dataset("examples").tasks
BY_NAME = {t.name: t for t in TASKS}


async def play(env: GatewayEnv, policy: SessionScriptedPolicy, task: Task) -> tuple[list[str], object]:
    """Run one episode with a scripted policy; returns the step types seen and the last TimeStep."""
    ts = await env.reset()
    kinds = [ts.step_type.name]
    if not ts.last():
        assert env.session is not None
        policy.bind(env.session.session_id, agent="mini-swe-agent", task=task)
    while not ts.last():
        assert ts.observation is not None
        ts = await env.step(await call_policy(policy, ts.observation))
        kinds.append(ts.step_type.name)
    return kinds, ts


# ---------------------------------------------------------------------------------------------- pieces


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 4, 4) == 1.0


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
async def test_oracle_command_solves_each_task_through_a_shell(task: Task, sandbox_root: Path) -> None:
    """The one command the oracle sends reproduces solution/solve.sh when a shell runs it in the workdir."""
    async with sandbox.LocalSandbox(task.sandbox_spec()) as sb:
        await prepare_workdir(sb, task)
        ran = await sb.exec(["sh", "-c", task.oracle_command()], timeout=60)
        assert ran.ok and "solve.sh exited with status 0" in ran.stdout, (ran.stdout, ran.stderr)
        verdict = await run_tests(sb, task)
    assert verdict.reward.value == 1.0, verdict
    assert left_behind(sandbox_root) == []


def test_scripted_policies_by_name() -> None:
    assert isinstance(make_policy("oracle"), SessionScriptedPolicy)
    assert make_policy("scripted", commands=["true"]).mode == "scripted"
    with pytest.raises(ValueError, match="solution"):
        make_policy("oracle", commands=["true"])
    no_solution = Task(name="x", path=Path("/nonexistent"), instruction="x", config=TASKS[0].config,
                       tests_dir=Path("/nonexistent"))
    with pytest.raises(PolicyError, match="no solution"):
        make_policy("oracle").bind("s", agent="mini-swe-agent", task=no_solution)


async def test_unbound_session_is_a_policy_error(gateway: Gateway) -> None:
    from ares_gateway.core.broker import ParkedRequest
    from ares_gateway.core.canonical import CanonicalRequest, Message, WireProtocol

    req = CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, model="m",
                           messages=[Message(role="user", content="hi")],
                           raw={"messages": []})
    parked = ParkedRequest("r1", "unbound", WireProtocol.OPENAI_CHAT, "/v1/chat/completions", req,
                           time.time(), asyncio.get_running_loop().create_future())
    with pytest.raises(PolicyError, match="not bound"):
        await make_policy("oracle")(parked)


# ---------------------------------------------------------------------------------------------- GatewayEnv


async def test_env_oracle_and_failing_tests(sandbox_root: Path) -> None:
    """The oracle reaches 1.0 (reward.json parts kept); an agent that does nothing gets 0.0; a partial
    answer gets the mean of the parts. Every sandbox is gone at LAST; samples and turns stay readable."""
    slug, csv, greet = BY_NAME["make-slug-tests-pass"], BY_NAME["summarize-sales-csv"], BY_NAME[
        "write-greeting-file"]
    cases = [
        (slug, make_policy("oracle")),
        (greet, make_policy("scripted")),  # finishes at once: the tests fail
        (csv, make_policy("scripted", commands=["""printf '{"north": 12.5}' > summary.json"""])),
    ]
    envs = [GatewayEnv(task=t, harness=TinyAgentHarness(), sandbox="local") for t, _ in cases]
    try:
        results = await asyncio.gather(
            *(play(env, pol, t) for env, (t, pol) in zip(envs, cases, strict=True)))
        (k1, oracle), (k2, nothing), (k3, partial) = results
        assert k3 == ["FIRST", "MID", "LAST"], k3
        assert k1 == ["FIRST", "MID", "LAST"] and k2 == ["FIRST", "LAST"], (k1, k2)
        assert oracle.reward == 1.0 and oracle.discount == 0.0  # type: ignore[attr-defined]
        assert oracle.info["reward_parts"] == {"visible_tests": 1.0, "hidden_tests": 1.0}  # type: ignore[attr-defined]
        assert oracle.info["exit_reason"] == "completed" and oracle.info["agent_exit_code"] == 0  # type: ignore[attr-defined]
        assert nothing.reward == 0.0 and nothing.info["exit_reason"] == "completed"  # type: ignore[attr-defined]
        assert nothing.info["reward_source"] == "reward.txt"  # type: ignore[attr-defined]
        assert partial.reward == pytest.approx(1 / 3)  # type: ignore[attr-defined]
        assert partial.info["reward_parts"] == {"valid_json": 1.0, "regions": 0.0, "totals": 0.0}  # type: ignore[attr-defined]
        assert left_behind(sandbox_root) == []
        for env in envs:
            assert (env.outcome is not None and "stdout.log" in env.logs
                    and "verifier.log" in env.logs)
            turns = env.turn_log()
            assert turns and turns[0]["request"]["tools"][0]["function"]["name"] == "bash"
            assert env.trajectory() == []  # scripted answers carry no token ids
    finally:
        for env in envs:
            await env.close()


class _BrokenInstall(TinyAgentHarness):
    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        return [("download the agent", "echo 'registry says no' >&2; exit 4")]


async def test_env_install_failure_and_crash_end_with_zero(sandbox_root: Path, tmp_path: Path) -> None:
    task = BY_NAME["write-greeting-file"]
    broken = GatewayEnv(task=task, harness=_BrokenInstall(install_root=str(tmp_path / "agents")),
                        sandbox="local")
    crash = GatewayEnv(task=task, harness=CrashingHarness(), sandbox="local")
    try:
        ts1, ts2 = await asyncio.gather(broken.reset(), crash.reset())
        assert ts1.last() and ts1.reward == 0.0 and ts1.discount == 0.0
        assert ts1.info["exit_reason"] == "install_error"
        assert "download the agent" in ts1.info["error"] and "registry says no" in ts1.info["error"]
        assert ts2.last() and ts2.reward == 0.0 and ts2.info["exit_reason"] == "agent_error"
        assert "code 7" in ts2.info["error"] and "agent blew up" in ts2.info["error"]
        assert "\n" not in ts1.info["error"] and "\n" not in ts2.info["error"]  # one line each
        assert "verify_seconds" in ts2.info and ts2.info["verify_seconds"] == 0.0  # no tests after a crash
        assert left_behind(sandbox_root) == []
    finally:
        await broken.close()
        await crash.close()


async def test_env_limits_truncate_and_stop_the_agent(sandbox_root: Path) -> None:
    task = BY_NAME["write-greeting-file"]
    timed = GatewayEnv(task=task, harness=TinyAgentHarness(), sandbox="local", time_limit=4)
    stepped = GatewayEnv(task=task, harness=TinyAgentHarness(), sandbox="local", step_limit=1)
    started = time.monotonic()
    try:
        (kinds_t, last_t), (kinds_s, last_s) = await asyncio.gather(
            play(timed, make_policy("scripted", commands=["sleep 120"]), task),
            play(stepped, make_policy("scripted", commands=["sleep 120"]), task),
        )
        assert time.monotonic() - started < 40
        assert kinds_t == ["FIRST", "LAST"] and kinds_s == ["FIRST", "LAST"]
        for last, reason in ((last_t, "time_limit"), (last_s, "step_limit")):
            assert last.discount == 1.0 and last.info["truncated"] is True  # type: ignore[attr-defined]
            assert last.info["exit_reason"] == reason  # type: ignore[attr-defined]
            assert last.info["reward_source"] == "reward.txt" and last.reward == 0.0  # type: ignore[attr-defined]
        assert 4 <= timed.outcome.agent_seconds < 20  # type: ignore[union-attr]
        assert left_behind(sandbox_root) == []  # the sleeping agent went with its sandbox
    finally:
        await timed.close()
        await stepped.close()


async def test_env_takes_the_runs_episode_config(sandbox_root: Path) -> None:
    """``GatewayEnv.for_task(task, EpisodeConfig(...))`` plays what the config says: its harness with its
    options, its sandbox, its step limit (the same config run_rollouts takes)."""
    task = BY_NAME["write-greeting-file"]
    config = EpisodeConfig(harness="tiny-agent", harness_options={"command_timeout": 7.0}, sandbox="local",
                           step_limit=1)
    env = GatewayEnv.for_task(task, config)
    try:
        assert env.config is config and env.sandbox_backend == "local" and env.step_limit == 1
        kinds, last = await play(env, make_policy("scripted", commands=["sleep 120"]), task)
        assert kinds == ["FIRST", "LAST"], kinds
        assert last.info["exit_reason"] == "step_limit" and last.info["truncated"] is True  # type: ignore[attr-defined]
        assert env.episode is not None and isinstance(env.episode.harness, TinyAgentHarness)
        assert env.episode.harness.command_timeout == 7.0  # the config's harness options reached it
        assert last.info["sandbox"] == "local"  # type: ignore[attr-defined]
    finally:
        await env.close()
    assert left_behind(sandbox_root) == []


def test_env_config_or_keywords_not_both() -> None:
    """The keywords make the same config (checked as every config is); beside a config they are refused
    by name; a harness object may run in place of the config's harness."""
    task = BY_NAME["write-greeting-file"]
    env = GatewayEnv.for_task(task, harness="tiny-agent", sandbox="local", step_limit=3, time_limit=9)
    assert env.config == EpisodeConfig(harness="tiny-agent", sandbox="local", step_limit=3, time_limit=9)
    config = EpisodeConfig(harness="tiny-agent", sandbox="local")
    with pytest.raises(TypeError, match="sandbox, step_limit beside episode=: set them in the EpisodeConfig"):
        GatewayEnv.for_task(task, config, sandbox="docker", step_limit=2)
    with pytest.raises(TypeError, match="harness beside episode="):
        GatewayEnv.for_task(task, config, harness="mini-swe-agent")
    with pytest.raises(ValueError, match="step_limit must be a whole number"):
        GatewayEnv.for_task(task, harness="tiny-agent", step_limit=0)
    with pytest.raises(ValueError, match="needs the episode's harness"):
        GatewayEnv.for_task(task)
    with pytest.raises(ValueError, match=r"GatewayEnv\(episode=...\) needs task="):
        GatewayEnv(episode=config)
    with pytest.raises(TypeError, match="episode must be an EpisodeConfig"):
        GatewayEnv.for_task(task, {"harness": "tiny-agent"})  # type: ignore[arg-type]
    custom = CrashingHarness()
    env = GatewayEnv.for_task(task, config, harness=custom)
    assert env.config is config and env._harness is custom


async def test_env_reset_mid_episode_cleans_the_old_one(sandbox_root: Path) -> None:
    task = BY_NAME["fix-median-bug"]
    async with Gateway(port=0, side_call_detector=harness_side_call_detector("tiny-agent")) as gw:
        env = GatewayEnv(gw, task=task, harness=TinyAgentHarness(), sandbox="local")
        first = await env.reset()
        assert first.first()
        old_sb, old_sid = env.episode.sandbox, env.session.session_id  # type: ignore[union-attr]
        assert old_sb is not None and old_sb.state == "running"
        again = await env.reset()
        assert again.first() and env.session.session_id != old_sid  # type: ignore[union-attr]
        assert old_sb.state == "stopped" and gw.sessions.find(old_sid) is None
        # The new episode's sandbox and its grading sandbox, started beside it (and their disk images) only.
        left = [n for n in left_behind(sandbox_root) if not n.endswith(".disk.img")]
        assert env.episode is not None and env.episode.sandbox is not None
        assert env.episode.sandbox.id in left and old_sb.id not in left and len(left) <= 2, left
        await env.close()
        assert left_behind(sandbox_root) == []


# ---------------------------------------------------------------------------------------------- runner


async def test_runner_outputs(tmp_path: Path, sandbox_root: Path) -> None:
    out = tmp_path / "run"
    summary = await run_rollouts(
        TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=4, attempts=2, out=out, stats_period=0),
    )
    assert len(summary.episodes) == 2 * len(TASKS) and not summary.interrupted
    assert all(e.reward == 1.0 and e.exit_reason == "completed" and e.turns == 2 for e in summary.episodes)
    assert summary.pass_at_k == {"pass@1": 1.0, "pass@2": 1.0}
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["mean_reward"] == 1.0 and len(doc["episodes"]) == 8
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 8
    for t in TASKS:
        for attempt in (0, 1):
            key = f"{t.name}.{attempt}"
            turns = [json.loads(line) for line in (out / "turns" / f"{key}.jsonl").read_text().splitlines()]
            assert len(turns) == 2 and turns[0]["request"]["messages"][1]["content"] == t.instruction
            assert (out / "trajectories" / f"{key}.jsonl").exists()
            assert (out / "logs" / key / "stdout.log").exists()
            assert "exit code 0" in (out / "logs" / key / "verifier.log").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    rewards = acc.Scalars("episode/reward")
    assert len(rewards) == 8 and {r.value for r in rewards} == {1.0}
    assert len(acc.Scalars("gateway/answer_latency_s")) == 8
    assert left_behind(sandbox_root) == []


class _CountingExecutor:
    """Another executor through the seam: the local one, which fails one planned episode at its boundary
    (as a lost worker would)."""

    kind = "counting"

    def __init__(self, fail_key: str) -> None:
        from ares_gateway.episodes.executor import LocalExecutor

        self.inner = LocalExecutor(concurrency=3)
        self.fail_key = fail_key
        self.ran: list[str] = []
        self.started = self.closed = 0

    @property
    def slots(self) -> int:
        return self.inner.slots

    async def start(self, **kwargs: object) -> None:
        self.started += 1
        await self.inner.start(**kwargs)  # type: ignore[arg-type]

    async def run(self, spec: object) -> object:
        self.ran.append(spec.key)  # type: ignore[attr-defined]
        if spec.key == self.fail_key:  # type: ignore[attr-defined]
            raise ConnectionError("the worker running it went away")
        return await self.inner.run(spec)  # type: ignore[arg-type]

    def turns_answered(self) -> int:
        return self.inner.turns_answered()

    def describe(self) -> list[str]:
        return []

    async def close(self) -> None:
        self.closed += 1
        await self.inner.close()

    @property
    def policy_version(self) -> int | None:
        return self.inner.policy_version

    async def set_policy_version(self, version: int) -> None:
        await self.inner.set_policy_version(version)

    async def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> Any:
        return await self.inner.pause_sampling(mode, timeout=timeout)

    async def resume_sampling(self, version: int | None = None) -> float:
        return await self.inner.resume_sampling(version)

    def weight_update(self, version: int | None = None, *, mode: str = "drain",
                      timeout: float | None = None) -> Any:
        return self.inner.weight_update(version, mode=mode, timeout=timeout)


async def test_runner_runs_on_any_executor_and_records_a_failed_call(tmp_path: Path,
                                                                     sandbox_root: Path) -> None:
    from ares_gateway.episodes.executor import Executor, LocalExecutor

    assert isinstance(LocalExecutor(), Executor)
    ex = _CountingExecutor(fail_key=f"{TASKS[1].name}.0")
    assert isinstance(ex, Executor)
    out = tmp_path / "run"
    summary = await run_rollouts(
        TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=8, out=out, executor=ex, retries=1, retry_backoff=0.0),
    )
    # Every planned episode went through the executor once, in plan order up to its 3 slots; the one
    # whose call raised (an infrastructure failure) twice: its retry.
    expected = [f"{t.name}.0" for t in TASKS] + [f"{TASKS[1].name}.0"]
    assert sorted(ex.ran) == sorted(expected) and ex.started == ex.closed == 1
    by_task = {e.task: e for e in summary.episodes}
    failed = by_task[TASKS[1].name]
    assert (failed.exit_reason, failed.infra_cause, failed.retries) == ("infra_error", "error", 1)
    assert "went away" in (failed.error or "")
    assert all(e.reward == 1.0 for t, e in by_task.items() if t != TASKS[1].name)
    doc = json.loads((out / "results.json").read_text())
    assert doc["run"]["executor"] == "counting" and len(doc["episodes"]) == len(TASKS)
    assert left_behind(sandbox_root) == []
    with pytest.raises(ValueError, match="not both"):
        await run_rollouts(
            TASKS, policy=make_policy("oracle"), gateway=object(), episode=EpisodeConfig("tiny-agent"),
            run=RunConfig(executor=ex),
        )


async def test_runner_stop_cancels_and_keeps_what_finished(tmp_path: Path, sandbox_root: Path) -> None:
    stop = asyncio.Event()
    finished: list[str] = []

    def on_episode(result: object) -> None:
        finished.append(result.task)  # type: ignore[attr-defined]
        stop.set()  # as Ctrl-C would, once the first episode is in

    policy = make_policy("scripted", commands=["sleep 1"])
    summary = await run_rollouts(
        TASKS, policy=policy, stop=stop, on_episode=on_episode,
        episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=2, attempts=2, out=tmp_path / "run"),
    )
    assert summary.interrupted and len(summary.episodes) >= 1
    assert len(summary.episodes) + len(summary.cancelled) == summary.planned
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["summary"]["interrupted"] is True and len(doc["episodes"]) == len(summary.episodes)
    assert left_behind(sandbox_root) == []


async def test_http_policy_leaves_requests_to_an_external_poller(tmp_path: Path, sandbox_root: Path) -> None:
    """With the http policy the runner answers nothing: a trainer polls /poll and answers on /respond."""
    task = BY_NAME["write-greeting-file"]
    oracle = make_policy("oracle")
    answered: list[str] = []

    async def trainer(url: str, admin_token: str) -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin_token}"}) as http:
            while True:
                async with http.get(f"{url}/poll", params={"wait": "1", "max": "4"}) as r:
                    items = await r.json()
                for item in items:
                    sid = item["session_id"]
                    if oracle.session_policy(sid) is None:
                        oracle.bind(sid, agent="mini-swe-agent", task=task)
                    answer = oracle.session_policy(sid)(item["request"], {})  # type: ignore[misc]
                    async with http.post(f"{url}/respond",
                                         json={"id": item["id"], "completion": answer}) as r:
                        assert r.status == 200, await r.text()
                    answered.append(item["id"])

    async with Gateway(port=0) as gw:
        poller = asyncio.create_task(trainer(gw.url, gw.admin_token))
        try:
            summary = await run_rollouts(
                [task], policy=HttpPolicy(), gateway=gw,
                episode=EpisodeConfig("tiny-agent", sandbox="local", time_limit=60),
                run=RunConfig(out=tmp_path / "run"),
            )
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    assert [e.reward for e in summary.episodes] == [1.0] and len(answered) == 2
    assert left_behind(sandbox_root) == []


def test_run_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "examples-mswea:9"]) == 2
    assert "valid task indices are 0..3" in capsys.readouterr().err
    assert cli_main(["run", "examples-mswea", "--policy", "upstream"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert cli_main(["run", "examples-mswea", "--policy", "upstream", "--base-url", "http://127.0.0.1:9/v1",
                     "--api-key-env", "ARES_TEST_UNSET_KEY_VAR"]) == 2
    assert "ARES_TEST_UNSET_KEY_VAR" in capsys.readouterr().err
    assert cli_main(["run", "nosuch-mswea"]) == 2
    assert "unknown dataset" in capsys.readouterr().err


def test_docker_sandbox_failure_is_reported(sandbox_root: Path) -> None:
    require(docker_ok(), "no Docker engine answers: run bash .ci/provision-docker.sh", docker=True)

    async def go() -> None:
        env = GatewayEnv(task=BY_NAME["write-greeting-file"], harness=TinyAgentHarness(), sandbox="docker",
                         image="ares-gateway/no-such-image:never")
        try:
            ts = await env.reset()
            assert ts.last() and ts.reward == 0.0 and ts.info["exit_reason"] == "sandbox_error", ts.info
            assert "no-such-image" in ts.info["error"]
        finally:
            await env.close()

    asyncio.run(go())
    assert os.environ.get("ARES_SANDBOX_LOCAL_ROOT") == str(sandbox_root)


async def test_runner_with_upstream_policy_writes_token_faithful_samples(llm: object, tmp_path: Path,
                                                                      sandbox_root: Path) -> None:
    """run_rollouts + the upstream policy against a local vLLM-like server: the trajectory file holds
    exactly the server's token ids and logprobs (the agent, a real process, gets a text reply and stops)."""
    from ares_gateway.policies import UpstreamPolicy

    task = BY_NAME["write-greeting-file"]
    out = tmp_path / "run"
    async with UpstreamPolicy(base_url=llm.url) as policy:  # type: ignore[attr-defined]
        summary = await run_rollouts(
            [task], policy=policy, episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(out=out),
        )
    [episode] = summary.episodes
    assert episode.exit_reason == "completed" and episode.reward == 0.0 and episode.samples == 1
    [turn] = llm.turns  # type: ignore[attr-defined]
    [sample] = [json.loads(line)
                for line in (out / "trajectories" / f"{task.name}.0.jsonl").read_text().splitlines()]
    assert sample["tokens"] == turn.prompt_ids + turn.output_ids
    assert sample["response_length"] == len(turn.output_ids) and sample["loss_mask"] == [1] * len(
        turn.output_ids)
    assert sample["logprobs"] == pytest.approx(turn.logprobs)
    assert left_behind(sandbox_root) == []
