"""Per-call usage and timing: each turn's prompt, completion and reused prompt tokens, the seconds it was
parked, the policy's seconds, a stream's time to first piece and the agent's think time before it.

Agents are the official openai SDK over loopback; the policy answers in process. Token counts equal the
token records (reused: the prefix shared with the previous turn's prompt + output), else the policy's
``usage``, else null (never 0); timings are non-negative and add up; they survive a restart (the durable
record), a record written without them reads back as null, and Prometheus counts them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai

from ares_gateway import Completion, CompletionDelta, Gateway
from ares_gateway.core.canonical import Usage
from ares_gateway.core.record_codec import Decoder, log_entry, pack
from tests.helpers import token_record

ADMIN = "usage-admin-token"
PARK = 0.2  # seconds each request waits before the policy takes it
THINK = 0.15  # seconds the agent waits between an answer and its next request


async def _agent(base_url: str, token: str, stream_second: bool) -> list[str]:
    """Four turns of one conversation; the second streamed when asked."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    got: list[str] = []
    try:
        for i in range(4):
            if i:
                await asyncio.sleep(THINK)
            if i == 1 and stream_second:
                text = ""
                stream = await client.chat.completions.create(model="m", messages=history,  # type: ignore[arg-type]
                                                              stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
            else:
                out = await client.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
                text = out.choices[0].message.content or ""
            got.append(text)
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    finally:
        await client.close()
    return got


async def _run(gw: Gateway, sid: str) -> None:
    info = await gw.create_session(sid)
    agent = asyncio.create_task(_agent(info.base_url, info.token, stream_second=True))
    answers: list[Any] = []
    # Turn 2's prompt continues turn 1's prompt + output for 5 ids, then differs (a re-rendered tail).
    answers.append(Completion(text="one", tokens=token_record([1, 2, 3], [10, 11])))

    async def streamed() -> AsyncIterator[CompletionDelta | Completion]:
        yield CompletionDelta(text="tw")
        await asyncio.sleep(0.1)
        yield CompletionDelta(text="o")
        yield Completion(text="two", tokens=token_record([1, 2, 3, 10, 11, 4, 5], [12, 13, 14]))

    answers.append(streamed())
    # an upstream's usage
    answers.append(Completion(text="three", usage=Usage(input_tokens=40, output_tokens=7)))
    answers.append(Completion(text="four"))  # neither: the counts are not known
    for answer in answers:
        req = None
        while req is None:  # the request is parked PARK seconds before the policy takes it
            if gw.broker.pending_for(sid):
                await asyncio.sleep(PARK)
                req = await gw.next_request(session=sid, timeout=10)
            else:
                await asyncio.sleep(0.01)
        await gw.respond(req.id, answer)
    assert await asyncio.wait_for(agent, 20) == ["one", "two", "three", "four"]


def _check(log: list[dict[str, Any]]) -> None:
    use = [t["usage"] for t in log]
    assert [(u["prompt_tokens"], u["completion_tokens"], u["reused_prompt_tokens"]) for u in use] == [
        (3, 2, 0), (7, 3, 5), (40, 7, None), (None, None, None)]
    for i, (t, u) in enumerate(zip(log, use, strict=True)):
        parked, policy = u["parked_seconds"], u["policy_seconds"]
        assert parked >= PARK * 0.9 and policy >= 0, u
        assert abs(parked + policy - t["latency"]) < 1e-3, (u, t["latency"])
        if i == 1:  # the streamed turn: its first piece before its end, its end 0.1 s later
            assert parked <= u["ttft_seconds"] <= t["latency"] - 0.09, (u, t["latency"])
        else:
            assert u["ttft_seconds"] is None
        if i == 0:
            assert u["think_seconds"] is None  # no answer before it
        else:
            # From the previous answer's end to this request's arrival: the agent's pause and its client's
            # work.
            assert THINK * 0.9 <= u["think_seconds"] < THINK + 2.0, u
            assert abs(log[i - 1]["timestamp"] + log[i - 1]["latency"] + u["think_seconds"]
                       - t["timestamp"]) < 1e-3


async def test_usage_and_timing_per_turn_survive_a_restart_and_reach_prometheus(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    async with Gateway(port=0, admin_token=ADMIN, data_dir=data) as gw, aiohttp.ClientSession() as http:
        await _run(gw, "use")
        log = gw.turn_log("use")
        _check(log)
        async with http.get(f"{gw.url}/sessions/use/turns",
                            headers={"authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            served = await r.json()
        served_log = served["turns"] if isinstance(served, dict) else served
        assert [t["usage"] for t in served_log] == [t["usage"] for t in log]
        async with http.get(f"{gw.url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}) as r:
            text = await r.text()
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        assert float(lines["ares_gateway_turn_parked_seconds_count"]) == 4
        assert float(lines["ares_gateway_turn_parked_seconds_sum"]) >= 4 * PARK * 0.9
        assert float(lines["ares_gateway_turn_policy_seconds_count"]) == 4
        assert float(lines["ares_gateway_turn_ttft_seconds_count"]) == 1
        assert float(lines["ares_gateway_turn_prompt_tokens_total"]) == 3 + 7 + 40
        assert float(lines["ares_gateway_turn_completion_tokens_total"]) == 2 + 3 + 7
        await gw.durable()
    async with Gateway(port=0, admin_token=ADMIN, data_dir=data) as gw:
        again = gw.turn_log("use")
        assert [t["usage"] for t in again] == [t["usage"] for t in log]


def test_a_record_written_without_usage_reads_back_as_null() -> None:
    # A record as gateways wrote it before usage and timing were recorded: no "use" key.
    header = {"v": 1, "rid": "req_old", "proto": "openai.chat", "side": False, "ts": 1.0e9, "lat": 0.5,
              "body": {"keys": ["model", "messages"], "set": {"model": "m"}, "lk": "messages", "keep": 0,
                       "new": [{"role": "user", "content": "hi"}]},
              "completion": {"text": "hello", "finish_reason": "stop"}}
    entry = log_entry(Decoder().decode(1, pack(header, b"")), tokens=True)
    assert entry["usage"] == {"prompt_tokens": None, "completion_tokens": None, "reused_prompt_tokens": None,
                              "parked_seconds": None, "policy_seconds": None, "ttft_seconds": None,
                              "think_seconds": None}
    # Nonsense in the field (a negative count, a string, a bool) reads as not known, never as a number.
    header["use"] = {"pt": -3, "ct": "7", "po": True, "pk": 0.25}
    entry = log_entry(Decoder().decode(1, pack(header, b"")), tokens=True)
    assert entry["usage"]["prompt_tokens"] is None and entry["usage"]["completion_tokens"] is None
    assert entry["usage"]["policy_seconds"] is None and entry["usage"]["parked_seconds"] == 0.25
