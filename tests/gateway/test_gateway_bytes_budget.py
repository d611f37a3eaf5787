"""The gateway-wide budget of parked body bytes, with the official SDKs over loopback.

Sessions' waiting bodies together pass ``max_parked_bytes``: the next request gets a 429 with
``retry-after`` in its own protocol's error shape (OpenAI chat, Responses, Anthropic), the per-session
budget still applies, and the total goes back down as requests are answered, withdrawn or time out.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from ares_gateway import Completion, Gateway, SessionInfo
from tests.helpers import eventually

TEXT = "x" * 20_000  # each request's body is a little over 20 KB
BUDGET = 45_000  # two such bodies fit, a third does not


def _openai(s: SessionInfo) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=s.token, max_retries=0)


def _anthropic(s: SessionInfo) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=s.base_url, api_key=s.token, max_retries=0)


async def _chat(s: SessionInfo) -> Any:
    async with _openai(s) as c:
        return await c.chat.completions.create(model="m", messages=[{"role": "user", "content": TEXT}])


async def _responses(s: SessionInfo) -> Any:
    async with _openai(s) as c:
        return await c.responses.create(model="m", input=TEXT)


async def _messages(s: SessionInfo) -> Any:
    async with _anthropic(s) as c:
        return await c.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": TEXT}])


async def _metric(gw: Gateway, name: str) -> float:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {gw.admin_token}"}) as http, \
            http.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


async def test_past_the_gateway_budget_each_protocol_gets_its_429_and_the_total_comes_back() -> None:
    async with Gateway(port=0, data_dir=False, request_timeout=60, max_parked_bytes=BUDGET) as gw:
        a, b, c = [await gw.create_session() for _ in range(3)]
        parked = [asyncio.create_task(_chat(a)), asyncio.create_task(_messages(b))]
        await eventually(lambda: gw.broker.pending_count == 2, "two parked requests")
        held = gw.broker.parked_bytes
        assert 40_000 < held <= BUDGET
        assert held == gw.broker.held_bytes_for(a.session_id) + gw.broker.held_bytes_for(b.session_id)
        assert await _metric(gw, "ares_gateway_parked_bytes_now") == held

        # A third session, in each protocol: 429, retry-after, the protocol's own error shape.
        with pytest.raises(openai.RateLimitError) as chat_err:
            await _chat(c)
        with pytest.raises(openai.RateLimitError) as resp_err:
            await _responses(c)
        with pytest.raises(anthropic.RateLimitError) as msg_err:
            await _messages(c)
        for err in (chat_err.value, resp_err.value):
            assert err.response.headers.get("retry-after") == "1"
            body = err.response.json()["error"]
            assert "across sessions" in body["message"] and body["type"], body
        assert msg_err.value.response.headers.get("retry-after") == "1"
        ant = msg_err.value.response.json()
        assert ant["type"] == "error" and ant["error"]["type"] == "rate_limit_error", ant
        assert "across sessions" in ant["error"]["message"]
        assert gw.broker.parked_bytes == held and gw.broker.held_bytes_for(c.session_id) == 0

        # Answered: the budget is back, and the third session's turn goes through.
        for _ in range(2):
            req = await gw.next_request(timeout=5)
            assert req is not None
            await gw.respond(req.id, Completion(text="ok"))
        chat, msg = await asyncio.gather(*parked)
        assert chat.choices[0].message.content == "ok" and msg.content[0].text == "ok"
        assert gw.broker.parked_bytes == 0
        third = asyncio.create_task(_responses(c))
        req = await gw.next_request(timeout=5)
        assert req is not None and req.session_id == c.session_id
        await gw.respond(req.id, Completion(text="fine"))
        assert (await third).output_text == "fine"

        # Withdrawn (the client gives up): the total comes back down as well.
        gone = asyncio.create_task(_messages(a))
        await eventually(lambda: gw.broker.parked_bytes > 0, "a parked request")
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await eventually(lambda: gw.broker.pending_count == 0, "the withdrawn request to go")
        assert gw.broker.parked_bytes == 0
        assert await _metric(gw, "ares_gateway_parked_bytes_now") == 0


async def test_timed_out_requests_give_their_bytes_back_and_the_session_budget_still_holds() -> None:
    async with Gateway(port=0, data_dir=False, request_timeout=0.5, max_parked_bytes=BUDGET,
                       max_parked_bytes_per_session=30_000) as gw:
        a, b = await gw.create_session(), await gw.create_session()
        with pytest.raises(openai.APIStatusError) as late:
            await _chat(a)
        assert late.value.status_code == 504
        assert gw.broker.parked_bytes == 0 and gw.broker.pending_count == 0
        # One session's second body passes its own (smaller) budget: 429 naming the session's limit.
        first = asyncio.create_task(_messages(a))
        await eventually(lambda: gw.broker.pending_count == 1, "a parked request")
        with pytest.raises(anthropic.RateLimitError) as own:
            await _messages(a)
        assert "per session" in own.value.response.json()["error"]["message"]
        # Another session still fits the gateway's budget.
        other = asyncio.create_task(_chat(b))
        await eventually(lambda: gw.broker.pending_count == 2, "two parked requests")
        for task in (first, other):
            with pytest.raises(openai.APIStatusError if task is other else anthropic.APIStatusError):
                await task
        assert gw.broker.parked_bytes == 0


async def test_a_body_over_the_whole_gateway_budget_is_413() -> None:
    async with Gateway(port=0, data_dir=False, max_parked_bytes=10_000) as gw:
        s = await gw.create_session()
        with pytest.raises(openai.APIStatusError) as err:
            await _chat(s)
        assert err.value.status_code == 413
        assert "across sessions" in err.value.response.json()["error"]["message"]
        assert gw.broker.parked_bytes == 0


async def test_sessions_parking_large_bodies_cannot_push_a_small_session_to_429() -> None:
    # Budget 100 KB; one session parks four 20 KB bodies (80 KB, over half the budget). Another session's
    # small request still goes through (it holds less than an equal share, 50 KB among two), while the
    # large session's next body is refused: it holds more than its share once the gateway is over half full.
    async with Gateway(port=0, data_dir=False, request_timeout=60, max_parked_bytes=100_000) as gw:
        hog, small = await gw.create_session(), await gw.create_session()
        parked = [asyncio.create_task(_chat(hog)) for _ in range(4)]
        await eventually(lambda: gw.broker.pending_count == 4, "four parked requests")
        assert gw.broker.parked_bytes > 80_000
        async with _anthropic(small) as c:
            ask = asyncio.create_task(c.messages.create(model="m", max_tokens=16,
                                                        messages=[{"role": "user", "content": "hello"}]))
            await eventually(lambda: gw.broker.pending_count == 5, "the small session's request")
            assert gw.broker.held_bytes_for(small.session_id) > 0
            with pytest.raises(openai.RateLimitError) as share:
                async with _openai(hog) as h:
                    await h.chat.completions.create(model="m",
                                                    messages=[{"role": "user", "content": "x" * 1_000}])
            message = share.value.response.json()["error"]["message"]
            assert "equal share" in message, message
            assert share.value.response.headers.get("retry-after") == "1"
            for _ in range(5):
                req = await gw.next_request(timeout=5)
                assert req is not None
                await gw.respond(req.id, Completion(text="ok"))
            assert (await ask).content[0].text == "ok"
        assert all(r.choices[0].message.content == "ok" for r in await asyncio.gather(*parked))
        assert gw.broker.parked_bytes == 0
        # A session alone may use the whole budget: the share among one holder is all of it.
        solo = [asyncio.create_task(_chat(small)) for _ in range(4)]
        await eventually(lambda: gw.broker.pending_count == 4, "one session's four parked requests")
        for _ in range(4):
            req = await gw.next_request(timeout=5)
            assert req is not None
            await gw.respond(req.id, Completion(text="ok"))
        await asyncio.gather(*solo)
