"""Real agent CLIs through a weight-update fence: a turn parked through a 60-second pause.

One gateway, two sessions: the real Claude Code (Anthropic Messages, streaming) and the real Codex
(Responses API, streaming) each run two shell commands, then send their next main-line turn (Claude
Code's is ~100 KB, as a real session's is by then) while sampling is open; nobody takes it; then
sampling is paused for 60 s (the trainer loading new weights). Each agent's client must hold through
the pause, get its answer after the resume and exit cleanly with the answer's text, without a retry:
from the gateway's side every request that arrived was answered, none was withdrawn (a client that
timed out hangs up, which withdraws its request) or timed out, and each agent's turn arrived once.

Claude Code's request timeout is set shorter than the pause (25 s), so only the gateway's pings hold
it. Codex runs with its own default stream idle timeout (300 s): it counts SSE events, not the
comment lines the gateway sends the Responses API as keep-alives (a 25 s idle timeout gives up 35 s
into the pause), so it is Codex's default that must outlast the pause. The gateway's
``request_timeout`` is shorter than the pause too: a pause's time does not count against it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import sandbox
from ares_gateway import Completion, Gateway, ParkedRequest
from harnesses import HarnessContext, HarnessResult, registry
from harnesses.codex import CodexHarness
from harnesses.scripted import Finish, RunCommand, ScriptedPolicy

from .conftest import AGENTS_IMAGE, require_backend

#: How long sampling stays paused (the spec's weight update).
PAUSE_SECONDS = 60.0
#: Seconds between the gateway's keep-alives to a parked streaming request.
KEEPALIVE_SECONDS = 10.0
#: Claude Code's request timeout: well under the pause, over the keep-alive interval.
CLAUDE_TIMEOUT_MS = 25_000
ANSWERS = {"claude-code": "fence-held-claude-5521", "codex": "fence-held-codex-7731"}
PROMPT = "Run the shell commands you are given, one at a time, then stop."
#: Two commands whose output (~28 KB each) grows Claude Code's body from ~47 KB to a real session's
#: ~100 KB by the turn that is parked through the pause.
COMMANDS = [RunCommand("seq 100000 104000"), RunCommand("seq 200000 204000")]


class _CodexDefaultIdle(CodexHarness):
    """Codex with its own default stream idle timeout (the harness sets a longer one)."""

    def config_toml(self, ctx: HarnessContext) -> str:
        text = super().config_toml(ctx)
        assert "stream_idle_timeout_ms = 900000\n" in text
        return text.replace("stream_idle_timeout_ms = 900000\n", "")


def _is_side_call(harnesses: dict[str, Any]) -> Any:
    def detect(req: Any, headers: Any) -> bool:
        name = "codex" if "input" in req.raw else "claude-code"
        return bool(harnesses[name].is_side_call(req.raw, headers))

    return detect


@pytest.mark.slow
async def test_real_agents_hold_through_a_60s_pause_without_a_retry() -> None:
    for name in ANSWERS:
        require_backend("local", name)
    harnesses: dict[str, Any] = {
        "claude-code": registry.create("claude-code", extra_env={"API_TIMEOUT_MS": str(CLAUDE_TIMEOUT_MS)}),
        "codex": _CodexDefaultIdle(),
    }
    seen: dict[str, list[ParkedRequest]] = {name: [] for name in ANSWERS}
    results: dict[str, HarnessResult] = {}
    go = asyncio.Event()
    async with Gateway(port=0, request_timeout=30, pause_keepalive_seconds=KEEPALIVE_SECONDS,
                       side_call_detector=_is_side_call(harnesses)) as gw:
        sessions = {name: await gw.create_session(f"fence-{name}") for name in ANSWERS}

        async def agent(name: str) -> None:
            info = sessions[name]
            async with sandbox.create(sandbox.SandboxSpec(image=AGENTS_IMAGE), backend="local") as sb:
                ctx = HarnessContext(workdir=sb.workdir, session_id=info.session_id, base_url=info.base_url,
                                     token=info.token, model="ares-policy")
                results[name] = await harnesses[name].run(sb, ctx, PROMPT, time_budget=300)

        agents = {name: asyncio.create_task(agent(name)) for name in ANSWERS}

        async def policy(name: str) -> None:
            """Answer the session's requests; before taking the main-line turn after the commands,
            wait for ``go`` (the pause is over): that turn is the one parked through the pause."""
            scripted = ScriptedPolicy(name, [*COMMANDS, Finish(ANSWERS[name])])
            sid = sessions[name].session_id
            while not agents[name].done():
                if scripted.main_turns == len(COMMANDS):
                    await go.wait()
                req = await gw.next_request(sid, timeout=0.5)
                if req is None:
                    continue
                assert not gw.fence.paused, "a request was handed out while sampling was paused"
                seen[name].append(req)
                await gw.respond(req.id, Completion.model_validate(scripted(req.request.raw, {})))

        def main_parked(name: str) -> list[ParkedRequest]:
            sid = sessions[name].session_id
            return [p for p in gw.broker.pending() if p.session_id == sid and not p.side_call]

        policies = [asyncio.create_task(policy(name)) for name in ANSWERS]
        try:
            # Both agents' main-line turns after the commands arrive while sampling is open; nobody takes
            # them.
            deadline = time.monotonic() + 240
            while not all(main_parked(name) for name in ANSWERS):
                assert time.monotonic() < deadline, {n: len(main_parked(n)) for n in ANSWERS}
                done = [t for t in [*agents.values(), *policies] if t.done()]
                assert not done, [t.result() for t in done]
                await asyncio.sleep(0.2)
            target = {name: main_parked(name)[0] for name in ANSWERS}
            body = target["claude-code"].raw_body
            assert body is not None and len(body) > 85_000, "Claude Code's turn is not Claude-Code-sized"
            assert all(p.request.stream for p in target.values())

            report = await gw.pause_sampling("drain", timeout=10)
            assert report.in_flight == 0 and report.parked >= 2
            paused_at = time.monotonic()
            # Through the pause: the turns stay parked, no other main-line request arrives (a client that
            # gave up would withdraw its request and send it again), nobody takes one.
            while time.monotonic() - paused_at < PAUSE_SECONDS:
                for name in ANSWERS:
                    assert [p.id for p in main_parked(name)] == [target[name].id], (
                        f"{name}'s turn left the parked ones {time.monotonic() - paused_at:.1f} s "
                        "into the pause", gw.metrics.withdrawn_total,
                        [(p.id, p.side_call) for p in gw.broker.pending()])
                assert gw.metrics.withdrawn_total == 0 and gw.metrics.timed_out_total == 0
                done = [t for t in [*agents.values(), *policies] if t.done()]
                assert not done, [t.result() for t in done]
                await asyncio.sleep(0.5)
            gw.resume_sampling()
            go.set()
            await asyncio.wait_for(asyncio.gather(*agents.values(), *policies), timeout=180)
        finally:  # a failed check must not leave an agent running
            tasks = [*agents.values(), *policies]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        withdrawn, timed_out = gw.metrics.withdrawn_total, gw.metrics.timed_out_total
        parked, answered = gw.metrics.parked_total, gw.metrics.answered_total

    for name in ANSWERS:
        result = results[name]
        assert result.exit_code == 0, (name, result.stderr_tail, result.stdout_tail)
        assert ANSWERS[name] in result.stdout_tail, (name, result.stdout_tail)
        main = [r for r in seen[name] if not r.side_call]
        # The turn arrived once: the request answered after the commands is the one parked through the pause.
        assert len(main) == len(COMMANDS) + 1 and main[-1].id == target[name].id, name
    assert (withdrawn, timed_out) == (0, 0)
    assert parked == answered == sum(len(s) for s in seen.values())
