"""The weight-update fence over real HTTP on loopback, with the official openai and anthropic SDKs as agents.

A pause hands nothing to any policy (in process or ``/poll``) and every request stays parked; a drain
waits for the generations in flight; an abort cancels them and the request is sampled again after the
resume (the record holds only that answer); streaming agents get keep-alives through the pause; bad
calls get the control API's errors and lose nothing parked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest

from ares_gateway import (
    Completion,
    Gateway,
    SamplingNotPausedError,
    SamplingPausedError,
)
from ares_gateway.core.errors import DrainTimeoutError, InvalidFenceError
from ares_gateway.policies import PolicyServer
from tests.gateway.conftest import ADMIN
from tests.helpers import eventually

pytestmark = pytest.mark.asyncio

_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with Gateway(port=0, admin_token=ADMIN, request_timeout=60, lease_seconds=60,
                       pause_keepalive_seconds=0.3) as g:
        yield g


class Policy:
    """Answers "answer <n>" (n: its call count); the calls listed in ``slow`` first sleep ``delay`` s."""

    def __init__(self, delay: float = 0.0, slow: tuple[int, ...] = ()) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.finished: list[int] = []
        self.delay = delay
        self.slow = slow

    async def __call__(self, request: Any) -> Completion:
        self.calls += 1
        n = self.calls
        self.started.set()
        if n in self.slow:
            await asyncio.sleep(self.delay)
        self.finished.append(n)
        return Completion(text=f"answer {n}")


def oai(gw: Gateway, base_url: str, token: str, timeout: float = 30.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0, timeout=timeout)


def ant(base_url: str, token: str, timeout: float = 30.0) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=token, max_retries=0, timeout=timeout)


# ---------------------------------------------------------------- in process


async def test_request_during_pause_is_answered_after_resume(gw: Gateway) -> None:
    info = await gw.create_session()
    policy = Policy()
    async with PolicyServer(gw, policy, concurrency=4):
        report = await gw.pause_sampling()
        assert report.mode == "drain" and report.in_flight == 0
        task = asyncio.create_task(
            oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
        await eventually(lambda: gw.broker.pending_count == 1)
        await asyncio.sleep(0.5)
        assert not task.done() and policy.calls == 0  # parked, handed to nobody
        gw.resume_sampling(version=1)
        out = await asyncio.wait_for(task, 10)
    assert out.choices[0].message.content == "answer 1"
    assert gw.policy_version == 1
    assert gw.fence.pauses == 1


async def test_pause_twice_and_resume_without_pause_are_clear_errors(gw: Gateway) -> None:
    with pytest.raises(SamplingNotPausedError, match="not paused"):
        gw.resume_sampling()
    await gw.pause_sampling()
    with pytest.raises(SamplingPausedError, match="resume it before pausing again"):
        await gw.pause_sampling("abort")
    with pytest.raises(InvalidFenceError, match="unknown pause mode"):
        await gw.pause_sampling("sideways")
    gw.resume_sampling()
    with pytest.raises(SamplingNotPausedError):
        gw.resume_sampling()
    with pytest.raises(InvalidFenceError, match="timeout"):
        await gw.pause_sampling(timeout=-1)
    assert not gw.fence.paused


async def test_drain_waits_for_the_generation_in_flight(gw: Gateway) -> None:
    info = await gw.create_session()
    policy = Policy(delay=1.5, slow=(1,))
    async with PolicyServer(gw, policy, concurrency=4):
        task = asyncio.create_task(
            oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
        await asyncio.wait_for(policy.started.wait(), 10)
        t0 = time.monotonic()
        report = await gw.pause_sampling("drain", timeout=30)
        waited = time.monotonic() - t0
        # The pause returned only once the generation finished and its answer was given.
        assert policy.finished == [1] and waited > 1.0
        assert report.in_flight == 1 and report.aborted == 0 and report.drain_seconds >= 1.0
        out = await asyncio.wait_for(task, 5)
        assert out.choices[0].message.content == "answer 1"
        gw.resume_sampling(version=2)
    assert len(gw.turn_log(info.session_id)) == 1


async def test_abort_cancels_and_the_record_holds_only_the_resampled_answer(gw: Gateway) -> None:
    info = await gw.create_session()
    policy = Policy(delay=60.0, slow=(1,))
    async with PolicyServer(gw, policy, concurrency=4):
        task = asyncio.create_task(
            ant(info.base_url, info.token).messages.create(model="m", max_tokens=16, messages=_MSG))  # type: ignore[arg-type]
        await asyncio.wait_for(policy.started.wait(), 10)
        t0 = time.monotonic()
        async with gw.weight_update(7, mode="abort", timeout=10) as report:
            assert time.monotonic() - t0 < 2.0  # did not wait for the 60 s generation
            assert report.aborted == 1 and policy.finished == []
            assert gw.fence.in_flight() == 0
            await asyncio.sleep(0.3)
            assert policy.calls == 1 and not task.done()  # not re-sampled while paused
        out = await asyncio.wait_for(task, 10)
    assert out.content[0].text == "answer 2"  # type: ignore[union-attr]
    turns = gw.turn_log(info.session_id)
    assert [t["completion"]["text"] for t in turns] == ["answer 2"]
    assert gw.policy_version == 7


async def test_drain_timeout_resumes_and_says_so(gw: Gateway) -> None:
    info = await gw.create_session()
    policy = Policy(delay=3.0, slow=(1,))
    async with PolicyServer(gw, policy, concurrency=4):
        task = asyncio.create_task(
            oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
        await asyncio.wait_for(policy.started.wait(), 10)
        with pytest.raises(DrainTimeoutError, match="sampling was resumed"):
            await gw.pause_sampling(timeout=0.2)
        assert not gw.fence.paused
        out = await asyncio.wait_for(task, 10)
    assert out.choices[0].message.content == "answer 1"


async def test_pause_time_does_not_count_against_request_timeout() -> None:
    async with Gateway(port=0, admin_token=ADMIN, request_timeout=1.0) as gw:
        info = await gw.create_session()
        async with PolicyServer(gw, Policy(), concurrency=2):
            await gw.pause_sampling()
            task = asyncio.create_task(
                oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
            await asyncio.sleep(2.0)  # twice the request timeout, all of it paused
            assert not task.done()
            gw.resume_sampling()
            out = await asyncio.wait_for(task, 10)
        assert out.choices[0].message.content == "answer 1"


async def test_non_streaming_client_with_a_short_timeout_times_out_itself(gw: Gateway) -> None:
    info = await gw.create_session()
    await gw.pause_sampling()
    client = oai(gw, info.base_url, info.token, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model="m", messages=_MSG)  # type: ignore[arg-type]
    # Its request is withdrawn when it hangs up: nothing is left parked for a policy to answer.
    await eventually(lambda: gw.broker.pending_count == 0)
    gw.resume_sampling()


# ---------------------------------------------------------------- streaming keep-alives


async def test_openai_stream_parked_through_a_pause_gets_keepalives_and_its_answer(gw: Gateway) -> None:
    info = await gw.create_session()
    async with PolicyServer(gw, Policy(), concurrency=4):
        await gw.pause_sampling()
        # A read timeout of 1 s, a pause of 3 s: only the keep-alives keep this client waiting.
        client = oai(gw, info.base_url, info.token, timeout=1.0)

        async def consume() -> str:
            stream = await client.chat.completions.create(model="m", messages=_MSG, stream=True)  # type: ignore[arg-type]
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        sdk = asyncio.create_task(consume())
        # The same request's bytes, read raw: the keep-alives themselves.
        raw: list[bytes] = []

        async def read_raw() -> None:
            async with aiohttp.ClientSession() as s, s.post(
                f"{info.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {info.token}"},
                json={"model": "m", "messages": _MSG, "stream": True}) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    raw.append(chunk)

        rawtask = asyncio.create_task(read_raw())
        await asyncio.sleep(3.0)
        assert not sdk.done()
        gw.resume_sampling()
        assert await asyncio.wait_for(sdk, 10) in ("answer 1", "answer 2")  # two requests: either answer
        await asyncio.wait_for(rawtask, 10)
    body = b"".join(raw)
    assert body.count(b": keep-alive\n\n") >= 5
    assert body.index(b": keep-alive") < body.index(b"data: {")
    assert body.rstrip().endswith(b"data: [DONE]")


async def test_anthropic_stream_parked_through_a_pause_gets_pings_and_its_answer(gw: Gateway) -> None:
    info = await gw.create_session()
    async with PolicyServer(gw, Policy(), concurrency=4):
        await gw.pause_sampling()
        client = ant(info.base_url, info.token, timeout=1.0)

        async def consume() -> str:
            async with client.messages.stream(model="m", max_tokens=16, messages=_MSG) as stream:  # type: ignore[arg-type]
                return "".join([t async for t in stream.text_stream])

        sdk = asyncio.create_task(consume())
        raw: list[bytes] = []

        async def read_raw() -> None:
            async with httpx.AsyncClient(timeout=10) as h, h.stream(
                "POST", f"{info.base_url}/v1/messages", headers={"x-api-key": info.token},
                json={"model": "m", "max_tokens": 16, "messages": _MSG, "stream": True}) as r:
                assert r.status_code == 200
                async for chunk in r.aiter_bytes():
                    raw.append(chunk)

        rawtask = asyncio.create_task(read_raw())
        await asyncio.sleep(3.0)
        assert not sdk.done()
        gw.resume_sampling()
        text = await asyncio.wait_for(sdk, 10)
        await asyncio.wait_for(rawtask, 10)
    assert text.startswith("answer")
    body = b"".join(raw)
    assert body.count(b"event: ping\n") >= 5
    assert body.index(b"event: ping") < body.index(b"event: message_start")
    assert b"event: message_stop" in body


# ---------------------------------------------------------------- control API


async def _post(s: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with s.post(url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def test_poll_is_empty_while_paused_and_an_answer_leased_before_an_abort_is_refused(
    gw: Gateway) -> None:
    info = await gw.create_session()
    client = oai(gw, info.base_url, info.token)
    agent = asyncio.create_task(client.chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
    url = gw.url
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        async with s.get(f"{url}/poll", params={"wait": "5"}) as r:
            [item] = await r.json()
        assert item["attempt"] == 1
        status, body = await _post(s, f"{url}/sampling/pause", json={"mode": "abort", "timeout": 5})
        assert status == 200 and body["status"] == "paused" and body["aborted"] == 1 and body[
            "in_flight"] == 1
        assert body["drain_seconds"] >= 0
        async with s.get(f"{url}/sampling") as r:
            state = await r.json()
        assert state["state"] == "paused" and state["mode"] == "abort" and state["parked"] == 1
        t0 = time.monotonic()
        async with s.get(f"{url}/poll", params={"wait": "0.5"}) as r:
            assert r.status == 200 and await r.json() == []
        assert time.monotonic() - t0 >= 0.4
        old = {"id": item["id"], "completion": {"text": "sampled with the old weights"}}
        status, body = await _post(s, f"{url}/respond", json=old)
        assert status == 409 and body["status"] == "error" and "weight-update fence" in body["error"]
        status, body = await _post(s, f"{url}/sampling/resume", json={"version": 3})
        assert status == 200 and body["status"] == "sampling" and body["policy_version"] == 3
        async with s.get(f"{url}/poll", params={"wait": "5"}) as r:
            [again] = await r.json()
        assert again["id"] == item["id"] and again["attempt"] == 2
        # The old poller's answer, sent with the attempt it was given, is still refused.
        status, body = await _post(s, f"{url}/respond", json={**old, "attempt": 1})
        assert status == 409 and body["code"] == 409
        status, body = await _post(s, f"{url}/respond",
                                   json={"id": item["id"], "attempt": 2,
                                         "completion": {"text": "new weights"}})
        assert status == 200, body
    out = await asyncio.wait_for(agent, 10)
    assert out.choices[0].message.content == "new weights"
    assert [t["completion"]["text"] for t in gw.turn_log(info.session_id)] == ["new weights"]


async def test_drain_over_http_waits_for_the_poller_to_answer(gw: Gateway) -> None:
    info = await gw.create_session()
    agent = asyncio.create_task(
        oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        async with s.get(f"{gw.url}/poll", params={"wait": "5"}) as r:
            [item] = await r.json()
        pause = asyncio.create_task(_post(s, f"{gw.url}/sampling/pause", json={}))
        await asyncio.sleep(0.5)
        assert not pause.done() and gw.fence.state == "draining"
        status, _ = await _post(s, f"{gw.url}/respond",
                                json={"id": item["id"], "completion": {"text": "done"}})
        assert status == 200
        status, body = await asyncio.wait_for(pause, 5)
        assert status == 200 and body["mode"] == "drain" and body["in_flight"] == 1 and body[
            "drain_seconds"] >= 0.4
        status, _ = await _post(s, f"{gw.url}/sampling/resume")
        assert status == 200
        async with s.get(f"{gw.url}/metrics") as r:
            metrics = await r.text()
    assert (await agent).choices[0].message.content == "done"
    assert "ares_gateway_fence_pauses_total 1.0" in metrics
    assert "ares_gateway_fence_drain_seconds_count 1.0" in metrics
    assert "ares_gateway_fence_paused_now 0.0" in metrics


async def test_control_api_bad_input_gets_its_errors_and_loses_nothing_parked(gw: Gateway) -> None:
    info = await gw.create_session()
    agent = asyncio.create_task(
        oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
    await eventually(lambda: gw.broker.pending_count == 1)
    url = gw.url
    async with aiohttp.ClientSession() as anon:
        for path in ("/sampling/pause", "/sampling/resume"):
            status, body = await _post(anon, url + path, json={})
            assert status == 401 and body["status"] == "error" and body["code"] == 401
            status, body = await _post(anon, url + path, json={}, headers={"Authorization": "Bearer wrong"})
            assert status == 401
        async with anon.get(f"{url}/sampling") as r:
            assert r.status == 401
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        status, body = await _post(s, f"{url}/sampling/resume", json={})
        assert status == 409 and "not paused" in body["error"]
        for bad in ({"mode": "sideways"}, {"mode": 3}, {"timeout": "soon"}, {"timeout": -1}, {"wait": 1},
                    [1]):
            status, body = await _post(s, f"{url}/sampling/pause", json=bad)
            assert status == 400 and body["status"] == "error", (bad, body)
        status, body = await _post(s, f"{url}/sampling/pause", data=b"{not json",
                                   headers={"Content-Type": "application/json"})
        assert status == 400 and "not valid JSON" in body["error"]
        assert not gw.fence.paused
        status, body = await _post(s, f"{url}/sampling/pause", json={"mode": "drain"})
        assert status == 200
        status, body = await _post(s, f"{url}/sampling/pause", json={"mode": "drain"})
        assert status == 409 and "already" in body["error"]
        for bad_version in ("three", -1, 1.5, True):
            status, body = await _post(s, f"{url}/sampling/resume", json={"version": bad_version})
            assert status == 400 and body["status"] == "error", (bad_version, body)
            assert gw.fence.paused  # a bad version leaves sampling paused
        status, body = await _post(s, f"{url}/sampling/resume", json={"version": 5})
        assert status == 200
        await _post(s, f"{url}/sampling/pause", json={})
        status, body = await _post(s, f"{url}/sampling/resume", json={"version": 4})
        assert status == 409 and gw.fence.paused  # versions only go up
        status, body = await _post(s, f"{url}/sampling/resume", json={"version": 5})
        assert status == 200
        # The request parked all along is still there, and answerable.
        async with s.get(f"{url}/poll", params={"wait": "5"}) as r:
            [item] = await r.json()
        status, _ = await _post(s, f"{url}/respond", json={"id": item["id"], "completion": {"text": "kept"}})
        assert status == 200
    assert (await asyncio.wait_for(agent, 10)).choices[0].message.content == "kept"


async def test_drain_waits_for_a_streamed_answer_still_being_sent(gw: Gateway) -> None:
    from ares_gateway import CompletionDelta

    info = await gw.create_session()
    sent = asyncio.Event()

    async def streaming(request: Any) -> AsyncIterator[CompletionDelta | Completion]:
        for word in ("one ", "two ", "three"):
            yield CompletionDelta(text=word)
            sent.set()
            await asyncio.sleep(0.5)
        yield Completion(text="one two three")

    async with PolicyServer(gw, streaming, concurrency=2):

        async def consume() -> str:
            stream = await oai(gw, info.base_url, info.token).chat.completions.create(
                model="m", messages=_MSG, stream=True)  # type: ignore[arg-type]
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        agent = asyncio.create_task(consume())
        await asyncio.wait_for(sent.wait(), 10)
        assert gw.broker.streams_in_flight == 1
        report = await gw.pause_sampling("abort", timeout=10)  # a stream reaching its agent is not taken back
        # The pause returned once the stream was sent to its end: its turn is recorded already.
        assert report.in_flight == 1 and report.drain_seconds > 0.8
        assert gw.broker.streams_in_flight == 0
        assert [t["completion"]["text"] for t in gw.turn_log(info.session_id)] == ["one two three"]
        assert await asyncio.wait_for(agent, 5) == "one two three"
        gw.resume_sampling()


async def test_gateway_env_answer_refused_by_an_abort_gives_the_request_back(gw: Gateway) -> None:
    from ares_gateway import GatewayEnv

    info = await gw.create_session()
    client = oai(gw, info.base_url, info.token)
    agent = asyncio.create_task(client.chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
    env = GatewayEnv.attached(gw, session_id=info.session_id)
    first = await env.reset()
    assert first.observation is not None
    # The caller samples its answer; a trainer aborts meanwhile (the request is taken back) and resumes.
    pause = asyncio.create_task(gw.pause_sampling("abort", timeout=5))
    report = await pause
    assert report.aborted == 1 and report.in_flight == 1
    asyncio.get_running_loop().call_later(0.3, gw.resume_sampling, 2)
    again = await asyncio.wait_for(env.step(Completion(text="sampled with the old weights")), 10)
    assert not gw.fence.paused
    assert again.mid() and again.observation is not None and again.observation.id == first.observation.id
    assert not agent.done()
    last = asyncio.create_task(env.step(Completion(text="sampled with the new weights")))
    out = await asyncio.wait_for(agent, 5)
    await gw.end_session(info.session_id, reward=1.0)
    assert (await asyncio.wait_for(last, 5)).last()
    assert out.choices[0].message.content == "sampled with the new weights"
    [turn] = gw.turn_log(info.session_id)
    assert turn["completion"]["text"] == "sampled with the new weights" and turn["policy_version"] == 2
    await env.close()


async def test_a_lease_running_out_during_a_drain_ends_the_wait_and_fences_the_late_answer() -> None:
    async with Gateway(port=0, admin_token=ADMIN, lease_seconds=0.5) as gw:
        info = await gw.create_session()
        agent = asyncio.create_task(
            oai(gw, info.base_url, info.token).chat.completions.create(model="m", messages=_MSG))  # type: ignore[arg-type]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
            async with s.get(f"{gw.url}/poll", params={"wait": "5"}) as r:
                [item] = await r.json()
            report = await gw.pause_sampling("drain", timeout=10)  # the poller never answers: its lease ends
            assert report.in_flight == 1 and 0.3 < report.drain_seconds < 5
            status, body = await _post(s, f"{gw.url}/respond",
                                       json={"id": item["id"], "completion": {"text": "late"}})
            assert status == 409 and "weight-update fence" in body["error"]
            gw.resume_sampling()
            async with s.get(f"{gw.url}/poll", params={"wait": "5"}) as r:
                [again] = await r.json()
            assert again["id"] == item["id"] and again["attempt"] == 2
            status, _ = await _post(s, f"{gw.url}/respond",
                                    json={"id": item["id"], "completion": {"text": "fresh"}})
            assert status == 200
        assert (await asyncio.wait_for(agent, 5)).choices[0].message.content == "fresh"


async def test_openai_responses_stream_parked_through_a_pause_gets_its_answer(gw: Gateway) -> None:
    info = await gw.create_session()
    async with PolicyServer(gw, Policy(), concurrency=2):
        await gw.pause_sampling()
        client = oai(gw, info.base_url, info.token, timeout=1.0)  # shorter than the pause

        async def consume() -> str:
            async with client.responses.stream(model="m", input="hi") as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
            assert final.output_text == "".join(deltas)
            return final.output_text

        sdk = asyncio.create_task(consume())
        await asyncio.sleep(2.5)
        assert not sdk.done()
        gw.resume_sampling()
        assert await asyncio.wait_for(sdk, 10) == "answer 1"
