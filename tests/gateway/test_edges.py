"""The gateway's edges: session ids that name directories, credentials that are not
UTF-8, an in-process gateway's control API, and answers the gateway cannot render.

Each attack runs over real HTTP on loopback (aiohttp, httpx with raw header bytes, the official
openai and anthropic SDKs as the agent) against a real gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest
from yarl import URL

from ares_gateway import (
    Completion,
    ErrorAnswer,
    Gateway,
    GatewayEnv,
    InvalidAnswerError,
    NativeAnswer,
)
from ares_gateway.cli.serve import _admin_token, add_serve_command
from ares_gateway.core.answers import MAX_ANSWER_DEPTH
from ares_gateway.http.session_socket import SessionSocketError
from tests.helpers import free_port

ADMIN = "edges-admin-token-0123456789abcdef"
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
BODIES = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "m", "input": "hi"},
}


def _nested(depth: int) -> Any:
    """A JSON value nesting ``depth`` arrays (the innermost holds a string)."""
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


def _nested_object(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@contextlib.contextmanager
def _short_dir() -> Iterator[Path]:
    # Under /tmp itself: a runtime dir must be short (sun_path holds 108 bytes), and pytest's tmp_path is not.
    d = Path(tempfile.mkdtemp(prefix="edges-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def _agent_and_poller(gw: Gateway) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {gw.admin_token}"}) as http:
        yield http


async def _poll_one(http: aiohttp.ClientSession, gw: Gateway) -> dict[str, Any]:
    async with http.get(f"{gw.url}/poll", params={"wait": "10"}) as r:
        assert r.status == 200, await r.text()
        items = await r.json()
    assert len(items) == 1
    return items[0]


# ------------------------------------------------------------------------------------- session ids

BAD_IDS = [".", "..", "a/b", "../x", "a.b", "x" * 129, "café", "١٢٣", "a b", "a\nb", "a\x00b", "a%2Fb"]


async def test_post_sessions_refuses_ids_that_are_not_letters_digits_dash_underscore() -> None:
    with _short_dir() as parent:
        sentinel = parent / "keep-me"
        sentinel.write_text("still here")
        runtime = parent / "rt"
        async with Gateway(port=0, admin_token=ADMIN, runtime_dir=str(runtime)) as gw, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            for sid in BAD_IDS:
                async with http.post(f"{gw.url}/sessions", json={"session_id": sid}) as r:
                    body = await r.json()
                    assert r.status == 400, (sid, body)
                    assert body["status"] == "error" and body["code"] == 400
                    assert "letters, digits, '-' and '_'" in body["error"]
                with pytest.raises(SessionSocketError):
                    await gw.agent_socket(sid)
            assert len(gw.sessions) == 0
            # The longest good id, and the characters allowed, still work (and get a socket).
            for sid in ("A-z_09", "x" * 36):
                async with http.post(f"{gw.url}/sessions", json={"session_id": sid}) as r:
                    assert r.status == 201, await r.text()
            assert (await gw.agent_socket("A-z_09")).endswith("/rt/A-z_09/agent.sock")
            async with http.post(f"{gw.url}/sessions", json={"session_id": "x" * 128}) as r:
                assert r.status == 201
            # A session an older data dir remembers with such an id gets no socket: nothing is removed.
            for sid in (".", ".."):
                gw.sessions.restore(sid, token=f"restored-token-{len(sid)}-0123456789",
                                    created_at=time.time(), metadata={})
                with pytest.raises(SessionSocketError, match="cannot name a directory"):
                    await gw.agent_socket(sid)
            assert runtime.is_dir() and (runtime / "A-z_09" / "agent.sock").exists()
        assert sentinel.read_text() == "still here"
        assert sorted(p.name for p in parent.iterdir()) == ["keep-me", "rt"] and not list(runtime.iterdir())


async def test_in_process_create_session_refuses_the_same_ids() -> None:
    async with Gateway(port=0, data_dir=False) as gw:
        for sid in BAD_IDS:
            with pytest.raises(ValueError, match="invalid session id"):
                await gw.create_session(sid)
        for token in ("tok with spaces 0123456789", "tök-0123456789abcdef", "t" * 513,
                      "tok\x7f0123456789abcdef"):
            with pytest.raises(ValueError, match="invalid token"):
                await gw.create_session(token=token)
        with pytest.raises(ValueError, match="metadata cannot be stored"):
            await gw.create_session(metadata={"deep": _nested(300)})
        assert len(gw.sessions) == 0


@pytest.mark.parametrize("raw_sid", ["..", ".", "%2E%2E", "%2e", "a%2Fb", "caf%C3%A9", "x" * 129])
async def test_auto_sessions_refuse_bad_ids_in_the_agents_shape(raw_sid: str) -> None:
    with _short_dir() as parent:
        sentinel = parent / "keep-me"
        sentinel.write_text("still here")
        # request_timeout: were such an id accepted, the request would be parked, unanswered.
        async with Gateway(port=0, auto_sessions=True, runtime_dir=str(parent / "rt"),
                           request_timeout=3) as gw, \
                aiohttp.ClientSession() as http:
            for name, path in PATHS.items():
                # encoded=True: the path goes out exactly as written (no client-side dot-segment removal).
                url = URL(f"{gw.url}/s/{raw_sid}{path}", encoded=True)
                async with http.post(url, json=BODIES[name],
                                     headers={"x-api-key": "tok-auto-0123456789abcdef",
                                              "Authorization": "Bearer tok-auto-0123456789abcdef"}) as r:
                    body = await r.json()
                    # "a%2Fb" is the path /s/a/b/...: no such route. The others reach the id check.
                    assert r.status == (404 if raw_sid == "a%2Fb" else 400), (raw_sid, name, r.status, body)
                    if name == "messages":
                        assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error",
                                                                                     "not_found_error")
                    else:
                        assert isinstance(body["error"]["message"], str)
            assert all(s.id not in (".", "..") and "/" not in s.id for s in gw.sessions)
            for s in gw.sessions:
                await gw.agent_socket(s.id)
        assert sentinel.read_text() == "still here"


# ------------------------------------------------------------------------------ non-UTF-8 credentials

def _server_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("ares_gateway", "aiohttp"))]


BAD_VALUES = [b"\xff\xfe\xfd", b"ags-\xc3\x28-0123456789", b"\x80" * 64]


@pytest.mark.parametrize("where", ["root", "session"])
async def test_a_credential_that_is_not_utf8_is_a_401_in_each_protocols_shape(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with Gateway(port=0, admin_token=ADMIN, data_dir=False) as gw, httpx.AsyncClient() as client:
        info = await gw.create_session()
        base = gw.url if where == "root" else info.base_url
        sent = 0
        for name, path in PATHS.items():
            for value in BAD_VALUES:
                for header in (b"x-api-key", b"authorization"):
                    v = b"Bearer " + value if header == b"authorization" else value
                    r = await client.post(base + path, content=json.dumps(BODIES[name]).encode(),
                                          headers=[(header, v), (b"content-type", b"application/json")])
                    sent += 1
                    assert r.status_code == 401, (name, header, value, r.status_code, r.text)
                    body = r.json()
                    if name == "messages":
                        assert body == {"type": "error", "error": {"type": "authentication_error",
                                                                   "message": body["error"]["message"]}}
                    else:
                        assert set(body["error"]) >= {"message", "type", "code"}
            # models and count_tokens check the same credential
            r = await client.get(base + "/v1/models", headers=[(b"x-api-key", b"\xff")])
            assert r.status_code == 401
        r = await client.post(base + "/v1/messages/count_tokens",
                              content=json.dumps(BODIES["messages"]).encode(),
                              headers=[(b"x-api-key", b"\xff\xfe")])
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert gw.broker.pending_count == 0 and sent == 18
    # The server's log (the gateway's and aiohttp's; not the client's): no error, no traceback, small.
    ours = _server_records(caplog)
    assert not [r for r in ours if r.levelno >= logging.WARNING or r.exc_info], [r.getMessage() for r in ours]
    assert sum(len(r.getMessage()) for r in ours) < 2000


async def test_other_headers_that_are_not_utf8_do_not_break_a_turn() -> None:
    """The headers the gateway and its side-call detectors read (and Anthropic's) may hold any bytes."""
    junk = [(name, b"\xff\xfe")
            for name in (b"x-claude-code-agent-id", b"x-ares-side-call", b"x-openai-subagent",
                                            b"anthropic-version", b"anthropic-beta", b"user-agent",
                         b"openai-beta")]
    async with Gateway(port=0, data_dir=False) as gw, httpx.AsyncClient(timeout=20) as client:
        info = await gw.create_session()

        async def policy() -> None:
            for _ in PATHS:
                req = await gw.next_request(session=info.session_id, timeout=20)
                assert req is not None
                await gw.respond(req.id, Completion(text="ok"))

        answering = asyncio.create_task(policy())
        for name, path in PATHS.items():
            r = await client.post(info.base_url + path, content=json.dumps(BODIES[name]).encode(),
                                  headers=[(b"x-api-key", info.token.encode()), *junk])
            assert r.status_code == 200, (name, r.text)
        await asyncio.wait_for(answering, 20)
        assert len(gw.turn_log(info.session_id)) == 3


async def test_a_non_utf8_credential_creates_no_auto_session() -> None:
    async with Gateway(port=0, auto_sessions=True, data_dir=False) as gw, httpx.AsyncClient() as client:
        for path in PATHS.values():
            for sid_part in ("", "/s/fresh"):
                r = await client.post(gw.url + sid_part + path, content=b"{}",
                                      headers=[(b"authorization", b"Bearer \xff\xfe-0123456789abcdef")])
                assert r.status_code == 401, r.text
        assert len(gw.sessions) == 0


async def test_control_api_answers_401_to_a_non_utf8_admin_token(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with Gateway(port=0, admin_token=ADMIN, data_dir=False) as gw, httpx.AsyncClient() as client:
        for method, path in (("GET", "/poll?wait=0"), ("GET", "/sessions"), ("POST", "/sessions"),
                             ("POST", "/respond"), ("GET", "/metrics")):
            for header, value in ((b"authorization", b"Bearer \xff\xfe"), (b"x-admin-token", b"\xc3\x28"),
                                  (b"authorization", b"Bearer " + ADMIN.encode() + b"\xff")):
                r = await client.request(method, gw.url + path, headers=[(header, value)], content=b"{}")
                assert r.status_code == 401, (method, path, value, r.text)
                assert r.json()["status"] == "error" and r.json()["code"] == 401
        # An Expect header that is not UTF-8 is still answered in shape (417), never a 500.
        r = await client.post(gw.url + "/sessions", headers=[(b"expect", b"\xff-continue")], content=b"{}")
        assert r.status_code == 417, r.text
    assert not [r for r in _server_records(caplog) if r.levelno >= logging.WARNING or r.exc_info]


# ------------------------------------------------------------------------ an in-process control API


async def test_an_in_process_gateway_generates_an_admin_token() -> None:
    async with Gateway(port=0, data_dir=False) as gw, Gateway(port=0, data_dir=False) as other:
        assert isinstance(gw.admin_token, str) and len(gw.admin_token) >= 32
        assert gw.admin_token != other.admin_token
        info = await gw.create_session()
        async with aiohttp.ClientSession() as http:
            for method, path in (("GET", "/poll?wait=0"), ("GET", "/sessions"), ("POST", "/sessions"),
                                 ("GET", "/metrics"), ("POST", f"/sessions/{info.session_id}/end"),
                                 ("POST", "/respond"), ("GET", f"/sessions/{info.session_id}/turns")):
                async with http.request(method, gw.url + path, json={}) as r:
                    assert r.status == 401, (method, path, r.status)
                async with http.request(method, gw.url + path, json={},
                                        headers={"Authorization": f"Bearer {other.admin_token}"}) as r:
                    assert r.status == 401
            assert not gw.sessions.get(info.session_id).ended
            # The owner passes the token it reads from the gateway.
            async with http.get(gw.url + "/sessions",
                                headers={"Authorization": f"Bearer {gw.admin_token}"}) as r:
                assert r.status == 200 and [s["session_id"] for s in await r.json()] == [info.session_id]
            # The in-process helpers need no token: a real agent, answered in process.
            agent = openai.AsyncOpenAI(base_url=info.base_url + "/v1", api_key=info.token, max_retries=0)

            async def policy() -> None:
                req = await gw.next_request(session=info.session_id, timeout=20)
                assert req is not None
                await gw.respond(req.id, Completion(text="hello"))

            got, _ = await asyncio.gather(
                agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]),
                policy())
            assert got.choices[0].message.content == "hello"
            await agent.close()
    with pytest.raises(ValueError, match="admin_token"):
        Gateway(port=0, admin_token="")
    async with Gateway(port=0, admin_token=ADMIN, data_dir=False) as given:
        assert given.admin_token == ADMIN


def test_serve_reads_the_admin_token_from_a_file_never_from_its_command_line(tmp_path: Path) -> None:
    secret = "file-admin-token-" + "z" * 24
    token_file = tmp_path / "admin"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    port = free_port()
    env = {**os.environ, "ARES_GATEWAY_ADMIN_TOKEN": "not-this-one-0123456789"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", str(port), "--in-memory",
         "--admin-token-file", str(token_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            assert proc.poll() is None and time.time() < deadline, "serve did not start"
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert secret.encode() not in cmdline
        with pytest.raises(urllib.error.HTTPError) as no:
            urllib.request.urlopen(url + "/sessions", timeout=5)
        assert no.value.code == 401
        for token, status in ((env["ARES_GATEWAY_ADMIN_TOKEN"], 401), (secret, 200)):
            req = urllib.request.Request(url + "/sessions", headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    assert r.status == status
            except urllib.error.HTTPError as exc:
                assert exc.code == status
    finally:
        proc.terminate()
        proc.wait(10)
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert secret not in out and "warning" not in out


def _serve_args(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_admin_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ARES_GATEWAY_ADMIN_TOKEN", "from-the-environment-0123")
    assert _admin_token(_serve_args()) == "from-the-environment-0123"
    assert capsys.readouterr().err == ""
    (tmp_path / "t").write_text("from-a-file-0123456789\nignored\n")
    assert _admin_token(_serve_args("--admin-token-file", str(tmp_path / "t"))) == "from-a-file-0123456789"
    with pytest.raises(SystemExit) as exit_info:  # never the command line, where ps shows it
        _serve_args("--admin-token", "on-the-command-line-0123")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--admin-token-file" in err and "on-the-command-line-0123" not in err
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError, match="admin token file"):
            _admin_token(_serve_args("--admin-token-file", str(bad)))


# ------------------------------------------------------------------------ answers that cannot render


def _chat_response(content: Any = "fine") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "fine"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "x_extra": content}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_native_answer_300_deep_is_refused_at_respond_and_a_good_one_still_lands(
    stream: bool) -> None:
    async with Gateway(port=0, data_dir=False) as gw, _agent_and_poller(gw) as http:
        info = await gw.create_session()
        agent = openai.AsyncOpenAI(base_url=info.base_url + "/v1", api_key=info.token, max_retries=0)

        async def ask() -> str:
            if stream:
                out = []
                async for chunk in await agent.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        out.append(chunk.choices[0].delta.content)
                return "".join(out)
            got = await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return got.choices[0].message.content or ""

        task = asyncio.create_task(ask())
        item = await _poll_one(http, gw)
        for bad in (_chat_response(_nested(300)), _chat_response(_nested(MAX_ANSWER_DEPTH))):
            async with http.post(f"{gw.url}/respond", json={"id": item["id"], "response": bad}) as r:
                body = await r.json()
                assert r.status == 400, body
                assert "levels deep" in body["error"]
        # In a batch, that item alone is refused.
        async with http.post(f"{gw.url}/respond",
                             json=[{"id": item["id"], "response": _chat_response(_nested(300))}]) as r:
            assert r.status == 200 and (await r.json())[0]["code"] == 400
        assert not task.done() and gw.broker.pending_count == 1  # still parked, still answerable
        async with http.post(f"{gw.url}/respond",
                             json={"id": item["id"], "response": _chat_response(_nested(20))}) as r:
            assert r.status == 200, await r.text()
        assert await asyncio.wait_for(task, 10) == "fine"
        await agent.close()
        turns = gw.turn_log(info.session_id)
        assert len(turns) == 1 and turns[0]["completion"]["text"] == "fine"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_the_agents_protocol_cannot_render_is_refused(stream: bool) -> None:
    # Anthropic renders a tool call's arguments as its "input" object: 300 objects deep, no encoder takes it.
    deep_args = json.dumps(_nested_object(300))
    async with Gateway(port=0, data_dir=False) as gw, _agent_and_poller(gw) as http:
        info = await gw.create_session()
        agent = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0)
        kwargs: dict[str, Any] = {"model": "m", "max_tokens": 16,
                                  "messages": [{"role": "user", "content": "hi"}]}

        async def ask() -> Any:
            if stream:
                async with agent.messages.stream(**kwargs) as s:
                    return await s.get_final_message()
            return await agent.messages.create(**kwargs)

        task = asyncio.create_task(ask())
        item = await _poll_one(http, gw)
        bad = {"text": "", "tool_calls": [{"id": "toolu_1", "name": "f", "arguments": deep_args}],
               "finish_reason": "tool_calls"}
        async with http.post(f"{gw.url}/respond", json={"id": item["id"], "completion": bad}) as r:
            body = await r.json()
            assert r.status == 400, body
            assert "cannot render" in body["error"]
        assert not task.done()
        good = {"text": "", "tool_calls": [{"id": "toolu_1", "name": "f", "arguments": '{"a": 1}'}],
                "finish_reason": "tool_calls"}
        async with http.post(f"{gw.url}/respond", json={"id": item["id"], "completion": good}) as r:
            assert r.status == 200, await r.text()
        msg = await asyncio.wait_for(task, 10)
        assert msg.content[0].type == "tool_use" and msg.content[0].input == {"a": 1}
        await agent.close()
        assert len(gw.turn_log(info.session_id)) == 1


async def test_in_process_respond_refuses_what_cannot_render() -> None:
    async with Gateway(port=0, data_dir=False) as gw:
        info = await gw.create_session()
        env = GatewayEnv(gw, session_id=info.session_id, request_timeout=20)
        agent = openai.AsyncOpenAI(base_url=info.base_url + "/v1", api_key=info.token, max_retries=0)
        task = asyncio.create_task(
            agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
        ts = await env.reset()
        assert ts.observation is not None
        rid = ts.observation.id
        completion = Completion(text="fine")
        for bad in (
            _chat_response(_nested(300)),                               # a native dict
            NativeAnswer(_chat_response(_nested(300)), completion),     # a NativeAnswer built in process
            NativeAnswer(_chat_response({"k": {1, 2}}), completion),    # not JSON
            Completion(text="bad \udcff surrogate"),                    # not UTF-8
            ErrorAnswer(200, "not an error status"),
            ErrorAnswer(True, "not a status"),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidAnswerError):
                await gw.respond(rid, bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidAnswerError):
                await env.step(bad)
        assert not task.done()
        await gw.respond(rid, _chat_response(_nested(10)))
        got = await asyncio.wait_for(task, 10)
        assert got.choices[0].message.content == "fine"
        # An error's message that is not UTF-8 (an exception's text) is escaped, not refused.
        task = asyncio.create_task(
            agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}]))
        req = await gw.next_request(session=info.session_id, timeout=10)
        assert req is not None
        await gw.respond(req.id, ErrorAnswer(500, "broke on \udcff"))
        with pytest.raises(openai.InternalServerError, match=r"broke on \\udcff"):
            await asyncio.wait_for(task, 10)
        await agent.close()
        assert len(gw.turn_log(info.session_id)) == 1


@pytest.mark.parametrize("padding", [0, 2 * 1024 * 1024], ids=["parsed-on-the-loop", "parsed-off-the-loop"])
async def test_a_request_too_deep_to_poll_is_a_400_to_its_agent_and_spoils_no_batch(
        padding: int, caplog: pytest.LogCaptureFixture) -> None:
    """An agent's body nesting 300 levels in a free-form field parses, but its canonical form cannot be
    encoded (orjson stops at 255), which would make /poll a 500 for every batch it landed in. Its agent
    gets a 400 (from the body parser, before it is parked) and the other agents' requests are polled."""
    async with Gateway(port=0, data_dir=False) as gw, _agent_and_poller(gw) as http:
        deep_info, good_info = await gw.create_session(), await gw.create_session()
        deep = openai.AsyncOpenAI(base_url=deep_info.base_url + "/v1", api_key=deep_info.token, max_retries=0)
        good = openai.AsyncOpenAI(base_url=good_info.base_url + "/v1", api_key=good_info.token, max_retries=0)
        # Padded past parse_offload_bytes, the body is parsed (and its canonical form encoded) in the
        # body parser's worker process, which must refuse it the same way.
        deep_task = asyncio.create_task(deep.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi" + "x" * padding}],
            extra_body={"x_deep": _nested(300)}))
        good_task = asyncio.create_task(good.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]))
        while gw.broker.pending_count < 1:  # noqa: ASYNC110 (nothing to wait on: HTTP)
            await asyncio.sleep(0.01)
        async with http.get(f"{gw.url}/poll", params={"wait": "5", "max": "10"}) as r:
            assert r.status == 200, await r.text()
            items = await r.json()
        assert [i["session_id"] for i in items] == [good_info.session_id]
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.wait_for(deep_task, 10)
        assert "nests objects or arrays too deeply" in str(refused.value)
        async with http.post(f"{gw.url}/respond",
                             json={"id": items[0]["id"], "completion": {"text": "fine"}}) as r:
            assert r.status == 200, await r.text()
        assert (await asyncio.wait_for(good_task, 10)).choices[0].message.content == "fine"
        await deep.close()
        await good.close()
    assert "Traceback" not in caplog.text
