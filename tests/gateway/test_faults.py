"""Bad input and faults: clear 4xx in the right protocol's shape, nothing parked, nothing leaked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from ares_gateway import (
    AlreadyAnsweredError,
    Completion,
    Gateway,
    GatewayClosedError,
    RequestGoneError,
    SessionInfo,
    UnknownRequestError,
)

from .conftest import ADMIN
from .test_edges import _nested

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
RESP = "/v1/responses"


def is_openai_error(body: Any) -> bool:
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str))


def is_anthropic_error(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and body.get("type") == "error"
        and isinstance(body.get("error"), dict)
        and isinstance(body["error"].get("type"), str)
        and isinstance(body["error"].get("message"), str)
    )


SHAPE = {CHAT: is_openai_error, RESP: is_openai_error, MSGS: is_anthropic_error}


async def post(url: str, data: bytes | str, token: str | None, *,
               anthropic_style: bool = False) -> tuple[int, Any]:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["x-api-key" if anthropic_style else "authorization"] = (token if anthropic_style
                                                                        else f"Bearer {token}")
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


@pytest.mark.parametrize("path", [CHAT, MSGS, RESP])
@pytest.mark.parametrize(
    "data,status",
    [
        (b"{not json", 400),
        (b"", 400),
        (b"[1, 2]", 400),
        (b'"a string"', 400),
        (json.dumps({"model": "m", "messages": "not a list", "input": 5}), 400),
        (json.dumps({"model": "m"}), 400),
    ],
)
async def test_malformed_bodies_get_protocol_shaped_400(
    path: str, data: Any, status: int, gateway: Gateway, session: SessionInfo
) -> None:
    if path == RESP and data == json.dumps({"model": "m"}):
        # input itself is optional
        data = json.dumps({"model": "m", "input": [{"type": "function_call", "name": 5}]})
    code, body = await post(session.base_url + path, data, session.token, anthropic_style=path == MSGS)
    assert code == status, body
    assert SHAPE[path](body), body
    assert gateway.broker.pending_count == 0


@pytest.mark.parametrize("path", [CHAT, MSGS, RESP])
async def test_bad_and_missing_token_get_401(path: str, gateway: Gateway, session: SessionInfo) -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "input": "x", "max_tokens": 5})
    for token in (None, "wrong-token-123456789"):
        for base in (session.base_url, gateway.url):
            code, out = await post(base + path, body, token, anthropic_style=path == MSGS)
            assert code == 401, out
            assert SHAPE[path](out)
            assert session.token not in json.dumps(out)
    assert gateway.broker.pending_count == 0


async def test_unknown_session_is_404(gateway: Gateway, session: SessionInfo) -> None:
    code, out = await post(f"{gateway.url}/s/nope{CHAT}", json.dumps({"messages": []}), session.token)
    assert code == 404 and is_openai_error(out)


async def test_token_at_root_resolves_session(gateway: Gateway, session: SessionInfo) -> None:
    client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=session.token, max_retries=0)
    task = asyncio.create_task(
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]))
    req = await gateway.next_request(timeout=5)
    assert req is not None and req.session_id == session.session_id
    await gateway.respond(req.id, "ok")
    assert (await task).content[0].text == "ok"


async def test_oversized_body_is_413_in_shape(session: SessionInfo) -> None:
    async with Gateway(port=0, max_body_bytes=4096) as gw:
        info = await gw.create_session()
        big = json.dumps(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 10_000}]})
        code, out = await post(info.base_url + MSGS, big, info.token, anthropic_style=True)
        assert code == 413 and is_anthropic_error(out)
        code, out = await post(info.base_url + CHAT, big, info.token)
        assert code == 413 and is_openai_error(out)
        assert gw.broker.pending_count == 0


async def test_unknown_path_and_method_in_shape(gateway: Gateway, session: SessionInfo) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{session.base_url}/v1/nonexistent") as r:
            assert r.status == 404 and is_openai_error(await r.json())
        async with s.get(f"{session.base_url}/v1/messages") as r:
            assert r.status == 405 and is_anthropic_error(await r.json())
            assert r.headers["allow"] == "POST"
        async with s.delete(f"{gateway.url}/v1/responses") as r:
            assert r.status == 405 and is_openai_error(await r.json())
            assert r.headers["allow"] == "GET,POST"
        for path in ("/s/", "/s//v1/chat/completions", "/sessions/", "/nowhere", "/s/x/poll", "//s/"):
            async with s.post(gateway.url + path) as r:
                assert r.status == 404, path
        async with s.head(f"{gateway.url}/poll", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 405 and r.headers["allow"] == "GET"  # a HEAD must not lease items
        async with s.put(f"{gateway.url}/sessions/{session.session_id}") as r:
            body = await r.json()
            assert r.status == 405 and body["code"] == 405 and r.headers["allow"] == "DELETE,GET,HEAD"


async def test_base_url_with_trailing_slash_still_routes(gateway: Gateway, session: SessionInfo) -> None:
    # ANTHROPIC_BASE_URL=".../s/{sid}/" joined with "/v1/messages" gives a double slash.
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    agent = asyncio.create_task(
        post(session.base_url + "//v1/messages", body, session.token, anthropic_style=True))
    req = await gateway.next_request(session=session.session_id, timeout=5)
    assert req is not None and req.endpoint == "/v1/messages"
    await gateway.respond(req.id, "ok")
    code, out = await agent
    assert code == 200 and out["content"][0]["text"] == "ok"


async def test_probes_answer_at_every_base(gateway: Gateway, session: SessionInfo) -> None:
    async with aiohttp.ClientSession() as s:
        for base in (gateway.url, session.base_url):
            for url in (base, base + "/"):
                async with s.head(url) as r:
                    assert r.status == 200 and await r.read() == b"", url
                async with s.get(url) as r:
                    assert r.status == 200 and (await r.json())["service"] == "ares-gateway", url


async def test_expect_100_continue_is_honoured(gateway: Gateway) -> None:
    # curl sends "Expect: 100-continue" with large bodies and waits for the interim answer.
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    body = b'{"session_id": "expect-test"}'
    writer.write(
        b"POST /sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN.encode()
        + b"\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n"
    )
    await writer.drain()
    assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(body)
    await writer.drain()
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 201")
    writer.close()
    assert gateway.sessions.find("expect-test") is not None


async def test_oversized_control_body_is_413_in_shape() -> None:
    async with Gateway(port=0, max_body_bytes=4096) as gw, \
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {gw.admin_token}"}) as s:
        async with s.post(f"{gw.url}/respond", data=b"[" + b"1," * 5000 + b"1]") as r:
            assert r.status == 413 and (await r.json())["code"] == 413
        async with s.post(f"{gw.url}/sessions", data=b'{"metadata": "' + b"x" * 5000 + b'"}') as r:
            assert r.status == 413 and (await r.json())["code"] == 413
        assert len(gw.sessions) == 0


async def test_respond_unknown_answered_and_gone(gateway: Gateway, session: SessionInfo,
                                                 http: aiohttp.ClientSession) -> None:
    client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
    agent = asyncio.create_task(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    req = await gateway.next_request(session=session.session_id, timeout=5)
    assert req is not None
    async with http.post(f"{gateway.url}/respond",
                         json={"id": "req_missing", "completion": {"text": "x"}}) as r:
        assert r.status == 404
    async with http.post(f"{gateway.url}/respond", json={"id": req.id, "completion": {"text": "first"}}) as r:
        assert r.status == 200 and (await r.json()) == {"id": req.id, "status": "ok"}
    async with http.post(f"{gateway.url}/respond",
                         json={"id": req.id, "completion": {"text": "second"}}) as r:
        assert r.status == 409
    with pytest.raises(AlreadyAnsweredError):
        await gateway.respond(req.id, "third")
    assert (await agent).choices[0].message.content == "first"
    with pytest.raises(UnknownRequestError):
        await gateway.respond("req_nope", "x")


async def test_bad_answers_are_400_and_request_stays_answerable(gateway: Gateway, session: SessionInfo,
                                                                http: aiohttp.ClientSession) -> None:
    client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
    agent = asyncio.create_task(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    req = await gateway.next_request(timeout=5)
    assert req is not None
    bad = [
        {"id": req.id},
        {"id": req.id, "completion": {"text": 5}},
        {"id": req.id, "completion": {"text": "x", "finish_reason": "bogus"}},
        {"id": req.id, "response": {"nonsense": True}},
        {"id": req.id, "error": {"status": 200, "message": "x"}},
        {"id": req.id, "completion": {"text": "x"},
         "tokens": {"prompt_ids": [1], "output_ids": [2, 3], "output_logprobs": [0.1]}},
        {"id": 7, "completion": {"text": "x"}},
    ]
    for payload in bad:
        async with http.post(f"{gateway.url}/respond", json=payload) as r:
            assert r.status == 400, (payload, await r.text())
    async with http.post(f"{gateway.url}/respond", data=b"{oops") as r:
        assert r.status == 400
    async with http.post(f"{gateway.url}/respond",
                         json={"id": req.id, "error": {"status": 429, "message": "slow down"}}) as r:
        assert r.status == 200
    with pytest.raises(openai.RateLimitError) as err:
        await agent
    assert "slow down" in str(err.value)


async def test_batch_respond_reports_per_item(gateway: Gateway, session: SessionInfo,
                                              http: aiohttp.ClientSession) -> None:
    client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
    agents = [
        asyncio.create_task(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": str(i)}]))
        for i in range(3)
    ]
    items: list[dict[str, Any]] = []
    while len(items) < 3:
        async with http.get(f"{gateway.url}/poll", params={"wait": "2", "max": "10"}) as r:
            items += await r.json()
    payload = [{"id": it["id"], "completion": {"text": it["request"]["messages"][0]["content"] * 2}}
               for it in items]
    payload.append({"id": "req_unknown", "completion": {"text": "x"}})
    async with http.post(f"{gateway.url}/respond", json=payload) as r:
        assert r.status == 200
        results = await r.json()
    assert [x["status"] for x in results] == ["ok", "ok", "ok", "error"] and results[3]["code"] == 404
    got = sorted([(await a).choices[0].message.content for a in agents])
    assert got == ["00", "11", "22"]


async def test_poller_that_dies_loses_nothing() -> None:
    async with Gateway(port=0, lease_seconds=0.3) as gw:
        info = await gw.create_session()
        client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        agent = asyncio.create_task(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {gw.admin_token}"}) as s:
            async with s.get(f"{gw.url}/poll", params={"wait": "5"}) as r:
                first = await r.json()
            assert len(first) == 1 and first[0]["attempt"] == 1
            # This poller "dies" without answering; the lease runs out and the item comes back.
            async with s.get(f"{gw.url}/poll", params={"wait": "0"}) as r:
                assert await r.json() == []
            async with s.get(f"{gw.url}/poll", params={"wait": "5", "canonical": "0"}) as r:
                again = await r.json()
            assert [i["id"] for i in again] == [first[0]["id"]] and again[0]["attempt"] == 2
            assert "canonical" in first[0] and "canonical" not in again[0]  # ?canonical=0: native body only
            async with s.post(f"{gw.url}/respond",
                              json={"id": first[0]["id"], "completion": {"text": "saved"}}) as r:
                assert r.status == 200
        assert (await agent).choices[0].message.content == "saved"


async def test_timeout_gives_504_and_410_to_late_answer() -> None:
    async with Gateway(port=0, request_timeout=0.3) as gw:
        info = await gw.create_session()
        client = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0)
        agent = asyncio.create_task(
            client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]))
        req = await gw.next_request(timeout=5)
        assert req is not None
        with pytest.raises(anthropic.APIStatusError) as err:
            await agent
        assert err.value.status_code == 504
        with pytest.raises(RequestGoneError):
            await gw.respond(req.id, "too late")
        assert gw.broker.pending_count == 0


async def test_agent_disconnect_withdraws_request(gateway: Gateway, session: SessionInfo,
                                                  http: aiohttp.ClientSession) -> None:
    async def agent() -> None:
        async with aiohttp.ClientSession() as s:
            await s.post(
                f"{session.base_url}{CHAT}",
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                headers={"authorization": f"Bearer {session.token}"},
            )

    task = asyncio.create_task(agent())
    req = await gateway.next_request(timeout=5)
    assert req is not None
    task.cancel()  # the agent goes away: its connection closes
    for _ in range(100):
        if gateway.broker.pending_count == 0:
            break
        await asyncio.sleep(0.02)
    assert gateway.broker.pending_count == 0
    async with http.post(f"{gateway.url}/respond", json={"id": req.id, "completion": {"text": "x"}}) as r:
        assert r.status == 410


async def test_agent_disconnect_mid_stream_ends_cleanly(gateway: Gateway, session: SessionInfo) -> None:
    """The policy streams slowly; the agent hangs up after the first delta; the policy's stream is closed."""
    from ares_gateway import CompletionDelta

    closed = asyncio.Event()

    async def slow_stream() -> Any:
        try:
            for i in range(1000):
                yield CompletionDelta(text=f"tok{i} ")
                await asyncio.sleep(0.01)
            yield Completion(text="never")
        finally:
            closed.set()

    async def agent() -> str:
        client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                      stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                await stream.close()
                return chunk.choices[0].delta.content
        return ""

    task = asyncio.create_task(agent())
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, slow_stream())
    assert (await task) == "tok0 "
    await asyncio.wait_for(closed.wait(), 5)
    assert gateway.broker.pending_count == 0


async def test_admin_token_guards_control_api(gateway: Gateway, session: SessionInfo) -> None:
    async with aiohttp.ClientSession() as s:
        for method, path in [("GET", "/poll"), ("POST", "/respond"), ("POST", "/sessions"),
                             ("GET", "/sessions"), ("GET", "/metrics")]:
            async with s.request(method, gateway.url + path) as r:
                assert r.status == 401, path
            async with s.request(method, gateway.url + path,
                                 headers={"authorization": f"Bearer {session.token}"}) as r:
                assert r.status == 401, path
        async with s.get(gateway.url + "/healthz") as r:
            assert r.status == 200


async def test_session_lifecycle_over_http(gateway: Gateway, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{gateway.url}/sessions",
                         json={"session_id": "ep-1", "metadata": {"task": "t"}}) as r:
        assert r.status == 201
        info = await r.json()
    assert info["session_id"] == "ep-1" and info["base_url"].endswith("/s/ep-1") and len(info["token"]) > 20
    async with http.post(f"{gateway.url}/sessions", json={"session_id": "ep-1"}) as r:
        assert r.status == 409
    async with http.post(f"{gateway.url}/sessions", json={"session_id": "bad id/../x"}) as r:
        assert r.status == 400
    async with http.get(f"{gateway.url}/sessions") as r:
        listed = await r.json()
    assert [s["session_id"] for s in listed] == ["ep-1"] and "token" not in json.dumps(listed)
    client = openai.AsyncOpenAI(base_url=info["base_url"] + "/v1", api_key=info["token"], max_retries=0)
    agent = asyncio.create_task(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    await asyncio.sleep(0.1)
    async with http.get(f"{gateway.url}/sessions/ep-1") as r:
        assert (await r.json())["pending"] == 1
    async with http.delete(f"{gateway.url}/sessions/ep-1") as r:
        assert (await r.json()) == {"status": "ok", "cancelled": 1}
    with pytest.raises(openai.APIStatusError) as err:
        await agent
    assert err.value.status_code == 503
    async with http.get(f"{gateway.url}/sessions/ep-1") as r:
        assert r.status == 404


async def test_metrics_count_outcomes(gateway: Gateway, session: SessionInfo,
                                      http: aiohttp.ClientSession) -> None:
    client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
    agent = asyncio.create_task(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, "ok")
    await agent
    async with http.get(f"{gateway.url}/metrics") as r:
        text = await r.text()
    assert "ares_gateway_requests_parked_total 1.0" in text
    assert "ares_gateway_requests_answered_total 1.0" in text
    assert "ares_gateway_answer_latency_seconds_count 1.0" in text
    assert "ares_gateway_requests_parked_now 0.0" in text


async def test_no_leaked_tasks_after_close() -> None:
    before = len(asyncio.all_tasks())
    async with Gateway(port=0, request_timeout=5) as gw:
        info = await gw.create_session()
        client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        agent = asyncio.create_task(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
        poller = asyncio.create_task(gw.broker.poll("other-session", wait=30))
        await asyncio.sleep(0.1)
    # Closing the gateway fails the parked request and releases the long-poller with a clear error.
    with pytest.raises(openai.APIStatusError):
        await agent
    with pytest.raises(GatewayClosedError):
        await asyncio.wait_for(poller, 1)
    with pytest.raises(GatewayClosedError):
        await gw.next_request(timeout=1)
    await asyncio.sleep(0.05)
    assert len(asyncio.all_tasks()) <= before


async def test_count_tokens_validates_like_messages(gateway: Gateway, session: SessionInfo) -> None:
    url = session.base_url + "/v1/messages/count_tokens"
    code, out = await post(url, json.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}),
                           session.token, anthropic_style=True)
    assert code == 400 and is_anthropic_error(out)
    code, out = await post(url, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi " * 40}]}), session.token, anthropic_style=True)
    assert code == 200 and out["input_tokens"] > 20
    code, out = await post(url, json.dumps({"model": "m", "messages": []}), "nope-not-a-token",
                           anthropic_style=True)
    assert code == 401 and is_anthropic_error(out)
    # Nested past what the gateway encodes again (its size is measured as JSON): a 400, was a 500.
    code, out = await post(url, json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "tools": [{"name": "t", "input_schema": {"x": _nested(300)}}]}),
                           session.token, anthropic_style=True)
    assert code == 400 and is_anthropic_error(out), (code, out)
    assert "nests objects or arrays too deeply" in out["error"]["message"]
