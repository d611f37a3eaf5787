"""Policy versions with the real model: the TITO policy on in-process llama.cpp (SmolLM2-135M), which
reports no weight version of its own, so each turn takes the version the trainer set on the gateway
when the request was handed to the policy. An agent (the official openai SDK) holds one conversation
across a version change: its sample's trained responses carry both versions, marked mixed."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from ares_gateway import Gateway
from ares_gateway.policies import PolicyServer


async def test_the_real_model_turns_carry_the_gateways_versions(llama_engine: Any,
                                                                smol_renderer: Any) -> None:
    from ares_gateway.policies.tito import TitoPolicy

    policy = TitoPolicy(llama_engine, renderer=smol_renderer, temperature=0.0, max_tokens=12)
    async with Gateway(port=0, data_dir=False) as gw, PolicyServer(gw, policy, concurrency=1):
        info = await gw.create_session("real")
        client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
        try:
            for version in (0, 1):
                gw.set_policy_version(version)
                out = await asyncio.wait_for(client.chat.completions.create(model="m", messages=history), 60)  # type: ignore[arg-type]
                history += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                            {"role": "user", "content": "Another one."}]
        finally:
            await client.close()
        log = gw.turn_log("real")
        assert [t["policy_version"] for t in log] == [0, 1]
        assert all(t["completion"]["tokens"]["output_ids"] for t in log)
        samples = gw.trajectory("real")
        spans = [span for s in samples for span in s.metadata["policy_versions"]]
        assert sorted(v for _, _, v in spans) == [0, 1]
        # TITO extends the stream: the second prompt continues the first turn's tokens, so one sample
        # trains both answers, each with its own version.
        (sample,) = samples
        assert sample.metadata["turn_ids"] == [1, 2] and sample.metadata["mixed_versions"] is True
