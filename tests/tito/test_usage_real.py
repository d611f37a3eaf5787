"""Per-call usage with the real model: the TITO policy on in-process llama.cpp (SmolLM2-135M), the agent the
official openai SDK, its second call streamed. The counts are the renderer's token records (prompt and
output ids; reused: the prefix the second prompt shares with the first's prompt + output, all of it, as
TITO extends the stream); the streamed call has a time to first piece before its end."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from ares_gateway import Gateway
from ares_gateway.policies import PolicyServer


async def test_the_real_models_usage_is_its_token_records(llama_engine: Any, smol_renderer: Any) -> None:
    from ares_gateway.policies.tito import TitoPolicy

    policy = TitoPolicy(llama_engine, renderer=smol_renderer, temperature=0.0, max_tokens=12)
    async with Gateway(port=0, data_dir=False) as gw, PolicyServer(gw, policy, concurrency=1):
        info = await gw.create_session("real")
        client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
        try:
            out = await asyncio.wait_for(client.chat.completions.create(model="m", messages=history), 60)  # type: ignore[arg-type]
            history += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                        {"role": "user", "content": "Another one."}]
            stream = await client.chat.completions.create(model="m", messages=history, stream=True)  # type: ignore[arg-type]
            async for _ in stream:
                pass
        finally:
            await client.close()
        log = gw.turn_log("real")
    assert len(log) == 2
    recs = [t["completion"]["tokens"] for t in log]
    assert [(t["usage"]["prompt_tokens"], t["usage"]["completion_tokens"]) for t in log] == [
        (len(r["prompt_ids"]), len(r["output_ids"])) for r in recs]
    first = recs[0]["prompt_ids"] + recs[0]["output_ids"]
    second = recs[1]["prompt_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
                  min(len(first), len(second)))
    assert shared > 0 and [t["usage"]["reused_prompt_tokens"] for t in log] == [0, shared]
    u0, u1 = log[0]["usage"], log[1]["usage"]
    assert u0["ttft_seconds"] is None and u0["think_seconds"] is None
    assert u1["parked_seconds"] <= u1["ttft_seconds"] <= log[1]["latency"], u1
    assert u1["think_seconds"] >= 0
    for t in log:
        u = t["usage"]
        assert u["parked_seconds"] >= 0 and u["policy_seconds"] > 0
        assert abs(u["parked_seconds"] + u["policy_seconds"] - t["latency"]) < 1e-3
