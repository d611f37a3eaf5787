"""Real agent CLIs in real sandboxes, driven through a real gateway by the scripted policy.

Each run: a Gateway on 127.0.0.1 (port 0; containers use host networking), one session, the harness
started on a prompt, and the scripted policy answering every request through ``GatewayEnv``:
(1) run a command that writes a file with known content, (2) finish.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

import sandbox
from ares_gateway import Completion, ErrorAnswer, Gateway, GatewayEnv, ParkedRequest
from ares_gateway.core import _body_layout
from ares_gateway.http.body_parser import parse_inline
from harnesses import HarnessContext, HarnessInstallError, HarnessResult, claude_code_is_side_call, registry
from harnesses.scripted import CallTool, Finish, RunCommand, ScriptedPolicy, Step
from harnesses.terminus2 import SUMMARY_MARKERS

from .conftest import AGENTS_IMAGE, require, require_backend

MARK = "ares-harness-ok-4711"
COMMAND = f"printf '%s\\n' {MARK} > out.txt && cat out.txt"
PROMPT = "Write the marker into out.txt in the current directory, show it, then stop. Use the shell."
HARNESSES = ["claude-code", "codex", "mini-swe-agent", "terminus-2"]
#: Main-line turns of the two-step script: command, finish (Terminus-2 confirms completion once more).
MAIN_TURNS = {"claude-code": 2, "codex": 2, "mini-swe-agent": 2, "terminus-2": 3}

Answer = Callable[[ParkedRequest, int], Awaitable[Any] | Any]


def _spec() -> sandbox.SandboxSpec:
    return sandbox.SandboxSpec(image=AGENTS_IMAGE, labels={"ares-gateway.test": "harnesses"})


async def drive(
    name: str,
    backend: str,
    *,
    time_budget: float = 240.0,
    answer: Answer | None = None,
    harness_options: dict[str, Any] | None = None,
    check: Callable[[sandbox.BaseSandbox], Awaitable[None]] | None = None,
    script: list[Step] | None = None,
    prompt: str = PROMPT,
    gateway_options: dict[str, Any] | None = None,
) -> tuple[HarnessResult, list[ParkedRequest], list[dict[str, Any]], ScriptedPolicy]:
    """Run harness ``name`` in a ``backend`` sandbox against a fresh gateway session.

    Every request is answered by ``answer(request, index)`` when it returns something, else by
    the scripted policy. Returns the result, the observed requests, the turn log and the policy.
    """
    harness = registry.create(name, **(harness_options or {}))
    policy = ScriptedPolicy(name, script or [RunCommand(COMMAND), Finish("The marker is written.")])
    seen: list[ParkedRequest] = []
    async with Gateway(port=0, request_timeout=300,
                       side_call_detector=lambda req, headers: harness.is_side_call(req.raw, headers),
                       **(gateway_options or {})) as gw:
        info = await gw.create_session()
        async with sandbox.create(_spec(), backend=backend) as sb:
            ctx = HarnessContext(workdir=sb.workdir, session_id=info.session_id, base_url=info.base_url,
                                 token=info.token, model="ares-policy")
            run = asyncio.create_task(harness.run(sb, ctx, prompt, time_budget=time_budget))
            run.add_done_callback(lambda _: gw.end_session_nowait(info.session_id))
            env = GatewayEnv(gw, session_id=info.session_id, time_limit=time_budget + 60)
            ts = await env.reset()
            while not ts.last():
                req = ts.observation
                assert req is not None
                seen.append(req)
                action = answer(req, len(seen) - 1) if answer else None
                if asyncio.iscoroutine(action):
                    action = await action
                if action is None:
                    action = Completion.model_validate(policy(req.request.raw, {}))
                ts = await env.step(action)
            result = await run
            if check is not None:
                await check(sb)
            turns = gw.turn_log(info.session_id)
    return result, seen, turns, policy


def _chat(req: ParkedRequest) -> list[dict[str, Any]]:
    return [m.to_chat_dict() for m in req.request.messages if m.role not in ("system", "developer")]


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def assert_one_main_path(main: list[ParkedRequest]) -> None:
    """Each main-line request extends the one before it: prior turns kept, the policy's answer appended."""
    for before, after in itertools.pairwise(main):
        a, b = _chat(before), _chat(after)
        assert len(b) > len(a), "a later main-line request must carry more conversation"
        # The first user message (the task) and every earlier assistant/tool turn are kept as they were.
        for i, msg in enumerate(a):
            if msg["role"] in ("assistant", "tool"):
                assert b[i]["role"] == msg["role"], f"turn {i} changed role: {msg['role']} -> {b[i]['role']}"
        assert b[len(a)]["role"] == "assistant", "the policy's answer follows the previous conversation"


async def _check_file(sb: sandbox.BaseSandbox) -> None:
    r = await sb.exec("cat out.txt", timeout=30)
    assert r.ok, r.stderr
    assert r.stdout == MARK + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
@pytest.mark.parametrize("name", HARNESSES)
async def test_scripted_run_writes_file_and_finishes(name: str, backend: str) -> None:
    require_backend(backend, name)
    result, seen, turns, policy = await drive(name, backend, check=_check_file)

    assert result.exit_code == 0, (result.stderr_tail, result.stdout_tail)
    assert not result.timed_out
    assert result.version == registry.create(name).version
    assert result.duration > 0

    main = [r for r in seen if not r.side_call]
    side = [r for r in seen if r.side_call]
    assert len(main) == MAIN_TURNS[name] == policy.main_turns
    harness_cls = registry.get_class(name)
    for r in side:  # every tagged side call is one the harness's detector recognises
        assert harness_cls.is_side_call(r.request.raw, {})  # type: ignore[attr-defined]
    # The recorded turns: the same main line, the side calls tagged.
    assert [t["side_call"] for t in turns] == [r.side_call for r in seen]

    # The first command's result reaches the agent's next request.
    second = main[1].request.messages
    if name == "terminus-2":
        assert MARK in _text_of(second[-1].to_chat_dict())
    else:
        tool_msgs = [m for m in second if m.role == "tool"]
        assert tool_msgs, [m.role for m in second]
        assert MARK in _text_of(tool_msgs[-1].to_chat_dict())
        assert tool_msgs[-1].tool_call_id
    assert_one_main_path(main)

    # Artifacts the harness keeps.
    expected_artifact = {"claude-code": "stream.jsonl", "codex": "rollout.jsonl",
                         "mini-swe-agent": "trajectory.json", "terminus-2": "trajectory.json"}[name]
    assert result.artifacts.get(expected_artifact), sorted(result.artifacts)
    if name == "claude-code":
        events = [json.loads(line) for line in result.artifacts["stream.jsonl"].splitlines() if line.strip()]
        assert events[-1]["type"] == "result" and events[-1]["subtype"] == "success"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["codex", "claude-code"])
async def test_time_budget_overrun_is_killed_and_reported(name: str) -> None:
    require_backend("local", name)
    budget = 8.0
    holding: list[ParkedRequest] = []

    async def never(req: ParkedRequest, i: int) -> Any:
        holding.append(req)
        await asyncio.sleep(budget + 30)  # longer than the budget: the harness must give up first
        return None

    async def no_agent_left(sb: sandbox.BaseSandbox) -> None:
        r = await sb.exec("ps -eo comm= | grep -E '^(claude|codex|node)' || true", timeout=30)
        assert r.stdout.strip() == "", f"agent processes still running: {r.stdout}"

    harness = registry.create(name)

    async def run_it() -> HarnessResult:
        async with Gateway(port=0, request_timeout=120) as gw:
            info = await gw.create_session()
            async with sandbox.create(_spec(), backend="local") as sb:
                ctx = HarnessContext(workdir=sb.workdir, session_id=info.session_id, base_url=info.base_url,
                                     token=info.token)
                run = asyncio.create_task(harness.run(sb, ctx, PROMPT, time_budget=budget))
                first = await gw.next_request(session=info.session_id, timeout=60)
                assert first is not None, "the agent made no request"
                result = await run  # nobody answers: the budget runs out
                await no_agent_left(sb)
                return result

    result = await asyncio.wait_for(run_it(), 120)
    assert result.timed_out
    assert result.exit_code is None
    assert budget <= result.duration < budget + 25
    assert not result.ok


@pytest.mark.slow
@pytest.mark.parametrize(("name", "status"), [("claude-code", 529), ("codex", 500), ("mini-swe-agent", 500),
                                              ("terminus-2", 500)])
async def test_api_error_is_retried_and_the_run_completes(name: str, status: int) -> None:
    require_backend("local", name)
    errors: list[int] = []

    def fail_first_main(req: ParkedRequest, i: int) -> Any:
        if not req.side_call and not errors:
            errors.append(i)
            return ErrorAnswer(status, "overloaded, try again")
        return None

    result, seen, _turns, policy = await drive(name, "local", answer=fail_first_main, check=_check_file)
    assert errors == [0] or (errors and not seen[errors[0]].side_call)
    assert result.exit_code == 0, (result.stderr_tail, result.stdout_tail)
    main = [r for r in seen if not r.side_call]
    # The failed request came again (a retry), then the script ran as usual.
    assert len(main) == MAIN_TURNS[name] + 1
    assert _chat(main[0]) == _chat(main[1])
    assert policy.main_turns == MAIN_TURNS[name]


@pytest.mark.parametrize("name", ["codex", "mini-swe-agent"])
async def test_broken_install_names_harness_and_step(name: str) -> None:
    require_backend("local", name)
    harness = registry.create(name, version="0.0.0-no-such-release", install_timeout=300)
    async with sandbox.create(_spec(), backend="local") as sb:
        ctx = HarnessContext(workdir=sb.workdir, session_id="broken", base_url="http://127.0.0.1:9",
                             token="x" * 16)
        with pytest.raises(HarnessInstallError) as info:
            await harness.run(sb, ctx, PROMPT, time_budget=30)
    err = info.value
    assert err.harness == name
    assert "0.0.0-no-such-release" in err.step and "install" in err.step
    assert name in str(err) and err.step in str(err)


@pytest.mark.slow
async def test_claude_code_subagent_is_a_tagged_side_call() -> None:
    """Real traffic: Claude Code's Agent tool starts a sub-agent whose requests are side calls."""
    require_backend("local", "claude-code")
    script: list[Step] = [
        CallTool("Agent", {"description": "List files", "prompt": "List the files in the current directory.",
                           "subagent_type": "general-purpose", "run_in_background": False}),
        Finish("The sub-agent listed the files."),
    ]
    result, seen, turns, policy = await drive(
        "claude-code", "local", script=script,
        prompt="Use a sub-agent to list the files here, then summarize.")
    assert result.exit_code == 0, result.stderr_tail
    side = [r for r in seen if r.side_call]
    main = [r for r in seen if not r.side_call]
    assert len(side) >= 1 and policy.side_turns == len(side)
    assert len(main) == 2
    assert [t["side_call"] for t in turns].count(True) == len(side)
    # Told by the body alone too, without the agent-id header: the real sub-agent's system prompt
    # opens a block with its introduction, and the main line's does not.
    assert all(claude_code_is_side_call(r.request.raw, {}) for r in side)
    assert not any(claude_code_is_side_call(r.request.raw, {}) for r in main)
    assert_one_main_path(main)
    # The sub-agent's answer (the policy's side-call text) comes back to the main line as the tool result.
    tool_msgs = [m for m in main[1].request.messages if m.role == "tool"]
    assert tool_msgs and "Scripted task" in _text_of(tool_msgs[-1].to_chat_dict())


#: Main-line turns of the long Claude Code session (a real session's length: its body grows each turn).
LONG_TURNS = 200


@pytest.mark.slow
async def test_claude_code_long_session_is_parsed_and_recorded_as_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real traffic at a real session's length: 200 Claude Code turns on one session, each body the
    last one's plus a tool call and its result. Every body the session's parse memo took over from
    the one before converts as a fresh parse of the same bytes does, its /poll encoding is pydantic's,
    the main line's turns take the unchanged-tail path (Claude Code writes its system prompt and tools
    after the messages), and the data dir, read back by a fresh gateway, holds every request as sent."""
    require_backend("local", "claude-code")
    tail_path = 0
    walk = _body_layout._continue_to_same_tail

    def counted(*args: Any) -> Any:
        nonlocal tail_path
        got = walk(*args)
        tail_path += got is not None
        return got

    monkeypatch.setattr(_body_layout, "_continue_to_same_tail", counted)
    data = tmp_path / "data"
    script: list[Step] = [RunCommand(f"echo step {i}; seq {i} {i + 150}") for i in range(LONG_TURNS - 1)]
    result, seen, turns, policy = await drive(
        "claude-code", "local", script=[*script, Finish("Every step ran.")], time_budget=1500,
        prompt="Run the shell commands you are given, one at a time, then stop.",
        gateway_options={"data_dir": str(data)})
    assert result.exit_code == 0, result.stderr_tail
    main = [r for r in seen if not r.side_call]
    assert len(main) == policy.main_turns == LONG_TURNS
    assert_one_main_path(main)
    assert main[0].raw_body is not None and main[-1].raw_body is not None
    assert len(main[-1].raw_body) > len(main[0].raw_body) + 150_000, "the session's body did not grow"
    for req in seen:
        assert req.raw_body is not None
        fresh = parse_inline(req.raw_body, req.protocol).request
        assert fresh is not None
        want = fresh.model_dump(mode="json", exclude={"raw"})
        assert req.request.model_dump(mode="json", exclude={"raw"}) == want
        assert orjson.loads(req.poll_json())["canonical"] == want
    # Every main-line body after the first ends with the one before's system prompt and tools.
    assert tail_path >= LONG_TURNS - 1, (tail_path, len(seen))
    sent = [orjson.loads(req.raw_body) for req in seen if req.raw_body is not None]
    assert [t["request"] for t in turns] == sent
    async with Gateway(port=0, data_dir=str(data)) as again:
        assert [t["request"] for t in again.turn_log(seen[0].session_id)] == sent


@pytest.mark.slow
async def test_terminus2_summarization_subagents_are_tagged_side_calls() -> None:
    """Real traffic: with a small context window Terminus-2 summarizes through three side calls."""
    require_backend("local", "terminus-2")
    result, seen, turns, policy = await drive("terminus-2", "local", harness_options={"context_tokens": 8500},
                                              check=_check_file)
    assert result.exit_code == 0, result.stderr_tail
    side = [r for r in seen if r.side_call]
    kinds = [next(k for k, m in enumerate(SUMMARY_MARKERS) if _text_of(r.request.messages[-1].to_chat_dict())
                  .lstrip().startswith(m)) for r in side]
    # Each summarization is three sub-agent calls: summary, questions, answers (it may run more than once).
    assert kinds and kinds == [0, 1, 2] * (len(kinds) // 3), kinds
    assert policy.side_turns == len(side)
    assert [t["side_call"] for t in turns] == [r.side_call for r in seen]
    # The main line still runs the script: the command, then task_complete confirmed.
    assert policy.main_turns == MAIN_TURNS["terminus-2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HARNESSES)
async def test_agents_contact_only_the_gateway(name: str) -> None:
    """Every socket the agent (and its children) connects to is the gateway on 127.0.0.1."""
    require_backend("local", name)
    require(shutil.which("strace") is not None, "strace is not installed: apt-get install strace")
    log = "/tmp/ares-net-trace.log"  # the local sandbox's private /tmp
    trace: dict[str, str] = {}

    async def read_trace(sb: sandbox.BaseSandbox) -> None:
        trace["log"] = (await sb.exec(f"cat {log}", timeout=30)).stdout

    result, _seen, _turns, _policy = await drive(
        name, "local", harness_options={"wrapper": f"strace -f -qq -e trace=connect -o {log}"},
        check=read_trace)
    assert result.exit_code == 0, result.stderr_tail
    connects = [line for line in trace["log"].splitlines() if "connect(" in line]
    inet = [line for line in connects if "AF_INET" in line]
    assert inet, "no connection to the gateway was traced"
    for line in inet:
        assert 'inet_addr("127.0.0.1")' in line or 'inet_pton(AF_INET6, "::1"' in line, line
    assert not [line for line in connects if "htons(53)" in line], "DNS lookups were made"


@pytest.mark.slow
async def test_cancelled_run_kills_the_agent() -> None:
    require_backend("local", "codex")
    harness = registry.create("codex")
    async with Gateway(port=0, request_timeout=120) as gw:
        info = await gw.create_session()
        async with sandbox.create(_spec(), backend="local") as sb:
            ctx = HarnessContext(workdir=sb.workdir, session_id=info.session_id, base_url=info.base_url,
                                 token=info.token)
            run = asyncio.create_task(harness.run(sb, ctx, PROMPT, time_budget=300))
            assert await gw.next_request(session=info.session_id, timeout=60) is not None
            alive = await sb.exec("ps -eo comm= | grep -c '^codex' || true", timeout=30)
            assert int(alive.stdout.strip() or 0) >= 1
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            left = await sb.exec("ps -eo comm= | grep '^codex' || true", timeout=30)
            assert left.stdout.strip() == "", left.stdout


async def test_agent_command_that_exits_still_reports_its_exit_code() -> None:
    """An ``exit`` inside the agent's command must not skip the launch script's exit-code line."""
    from harnesses.tiny_agent import TinyAgentHarness

    class ExitingAgent(TinyAgentHarness):
        def agent_command(self, ctx: Any, prep: Any, prompt: str) -> str:
            return "echo started; exit 3"

    harness = ExitingAgent()
    async with sandbox.create(_spec(), backend="local") as sb:
        ctx = HarnessContext(workdir=sb.workdir, session_id="s", base_url="http://127.0.0.1:9/s/s",
                             token="t" * 20)
        result = await asyncio.wait_for(harness.run(sb, ctx, PROMPT, time_budget=30), 60)
    assert result.exit_code == 3 and not result.timed_out and not result.ok
    assert "started" in result.stdout_tail
