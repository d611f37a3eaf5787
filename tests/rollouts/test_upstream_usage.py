"""Per-call usage on the upstream policy: real SDK agents -> gateway -> PolicyServer -> UpstreamPolicy -> a
local OpenAI-compatible server over loopback. With the server's token ids the counts are the token
records'; from a server that gives no ids, they are its ``usage``, streamed or not; reuse needs token ids."""

from __future__ import annotations

import pytest

from ares_gateway import Gateway
from ares_gateway.policies import PolicyServer

from .fake_llm import FakeLLM
from .test_upstream import oai, policy, two_turns


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_is_the_upstreams_without_token_ids(gateway: Gateway, llm: FakeLLM, stream: bool) -> None:
    llm.reject_token_fields = True  # no token ids: the counts can come only from the server's usage
    info = await gateway.create_session()
    async with policy(llm, stream=stream) as pol, PolicyServer(gateway, pol):
        async with oai(info) as client:
            await two_turns(client, stream=stream)
    log = gateway.turn_log(info.session_id)
    served = llm.turns[-2:]
    assert [t["completion"].get("tokens") for t in log] == [None, None]
    assert [(t["usage"]["prompt_tokens"], t["usage"]["completion_tokens"]) for t in log] == [
        (len(s.prompt_ids), len(s.output_ids)) for s in served]
    assert [t["usage"]["reused_prompt_tokens"] for t in log] == [None, None]
    for t in log:
        u = t["usage"]
        assert u["parked_seconds"] >= 0 and u["policy_seconds"] >= 0
        assert abs(u["parked_seconds"] + u["policy_seconds"] - t["latency"]) < 1e-3
        assert (u["ttft_seconds"] is not None) == stream


async def test_usage_with_token_ids_is_the_token_records(gateway: Gateway, llm: FakeLLM) -> None:
    info = await gateway.create_session()
    async with policy(llm) as pol, PolicyServer(gateway, pol):
        async with oai(info) as client:
            await two_turns(client)
    log = gateway.turn_log(info.session_id)
    first, second = llm.turns
    assert [(t["usage"]["prompt_tokens"], t["usage"]["completion_tokens"]) for t in log] == [
        (len(first.prompt_ids), len(first.output_ids)), (len(second.prompt_ids), len(second.output_ids))]
    # Turn 2's prompt extends turn 1's prompt + output (the fake renders it so).
    assert [t["usage"]["reused_prompt_tokens"] for t in log] == [0, len(first.prompt_ids)
                                                                 + len(first.output_ids)]
