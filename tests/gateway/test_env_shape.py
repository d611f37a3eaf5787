"""GatewayEnv's shape: one named constructor per mode, dm_env-style TimeStep helpers, truncation as a
value."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import ares_gateway
from ares_gateway import (
    Completion,
    Gateway,
    GatewayEnv,
    SessionInfo,
    StepType,
    restart,
    termination,
    transition,
    truncation,
)
from ares_gateway.core.broker import Broker
from ares_gateway.core.canonical import CanonicalRequest, Message, WireProtocol


def test_public_api_is_all_importable() -> None:
    assert sorted(ares_gateway.__all__) == sorted(set(ares_gateway.__all__))
    for name in ares_gateway.__all__:
        assert getattr(ares_gateway, name) is not None, name


async def test_helpers_build_dm_env_timesteps() -> None:
    b = Broker()
    p = b.park("s", CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, model="m",
                                     messages=[Message(role="user", content="hi")]), "/e")
    first, mid = restart(p), transition(0.5, p)
    assert (first.step_type, first.reward, first.discount, first.observation) == (StepType.FIRST, None, None,
                                                                                  p)
    assert (mid.step_type, mid.reward, mid.discount) == (StepType.MID, 0.5, 1.0)
    done = termination(1.0, {"steps": 3})
    cut = truncation(0.0, "step_limit", {"steps": 3})
    assert done.last() and done.discount == 0.0 and done.info == {"steps": 3, "truncated": False,
                                                                  "truncation": None}
    assert cut.last() and cut.discount == 1.0 and cut.info == {"steps": 3, "truncated": True,
                                                               "truncation": "step_limit"}
    b.close()


async def _agent(info: SessionInfo, turns: int) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for k in range(turns):
            r = await client.post(f"{info.base_url}/v1/chat/completions",
                                  headers={"authorization": f"Bearer {info.token}"},
                                  json={"model": "m", "messages": [{"role": "user", "content": f"turn {k}"}]})
            if r.status_code != 200:
                return


async def test_launching_truncates_at_the_step_limit_with_the_reason_as_a_value() -> None:
    async with Gateway(port=0) as gw:
        agents: list[asyncio.Task[None]] = []

        async def launch(info: SessionInfo) -> None:
            agents.append(asyncio.create_task(_agent(info, 10)))

        env = GatewayEnv.launching(gw, launch=launch, step_limit=2)
        ts = await env.reset()
        assert ts.first()
        ts = await env.step(Completion(text="a"))
        assert ts.step_type is StepType.MID
        ts = await env.step(Completion(text="b"))
        assert ts.last() and ts.discount == 1.0
        assert ts.info["truncated"] is True and ts.info["truncation"] == "step_limit"
        await env.close()
        for a in agents:
            a.cancel()
        await asyncio.gather(*agents, return_exceptions=True)


async def test_attached_ends_without_truncation_when_the_session_ends() -> None:
    async with Gateway(port=0) as gw:
        info = await gw.create_session()
        agent = asyncio.create_task(_agent(info, 1))
        env = GatewayEnv.attached(gw, session_id=info.session_id)
        ts = await env.reset()
        assert ts.first()
        await gw.end_session(info.session_id, reward=1.0)
        ts = await env.step(Completion(text="done"))
        assert ts.last() and ts.reward == 1.0 and ts.discount == 0.0
        assert ts.info["truncated"] is False and ts.info["truncation"] is None
        await agent
        await env.close()
        assert gw.sessions.find(info.session_id) is not None  # an attached session is not the env's to delete


def test_for_task_needs_a_harness_and_takes_no_launch() -> None:
    with pytest.raises(TypeError):
        GatewayEnv.for_task("examples/tasks/fix-median-bug", launch=None)  # type: ignore[call-arg]
    env = GatewayEnv.for_task("examples/tasks/fix-median-bug", harness="mini-swe-agent", sandbox="local")
    assert env.task is not None and env.task.name == "fix-median-bug" and env.sandbox_backend == "local"
