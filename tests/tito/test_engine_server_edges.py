"""EngineServer against hostile or careless callers: the real llama.cpp engine served over loopback.

Whoever reaches the trainer's ``/generate`` without its key gets a 401, whatever bytes the
``Authorization`` header holds, and leaves no traceback in the trainer's log; with the key, a body
nested past the gateway's depth limit, a non-finite or out-of-range sampling value or a request for
more new tokens than the server's cap is a 400 naming what to fix, and never reaches the engine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from ares_gateway.core.wire import MAX_JSON_DEPTH
from ares_gateway.engines.engine_server import MAX_NEW_TOKENS_CAP, MAX_TEMPERATURE, EngineServer

TOKEN = "edges-engine-token-0123456789"


def _logged_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("ares_gateway", "aiohttp"))
            and (r.levelno >= logging.ERROR or r.exc_info)]


@pytest.fixture
async def served(llama_engine: Any) -> AsyncIterator[tuple[EngineServer, httpx.AsyncClient]]:
    server = EngineServer(llama_engine, api_key=TOKEN, max_new_tokens=64)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            yield server, http
    finally:
        await server.close()


async def _post(http: httpx.AsyncClient, body: bytes, auth: bytes | None = b"Bearer " + TOKEN.encode()
                ) -> httpx.Response:
    headers = [(b"content-type", b"application/json")]
    if auth is not None:
        headers.append((b"authorization", auth))
    return await http.post("/generate", content=body, headers=headers)


BAD_CREDENTIALS: list[bytes | None] = [
    None,                                           # no header
    b"Bearer wrong-token",                          # a wrong token
    b"Bearer \xff\xfe",                             # bytes that are not UTF-8, instead of the key
    b"Bearer " + TOKEN.encode() + b"\xff",          # the key with a byte that is not UTF-8 after it
    b"\xc3\x28 " + TOKEN.encode(),                  # a scheme that is not UTF-8
    b"\x80" * 64,                                   # no scheme, nothing but bad bytes
    b"Basic " + TOKEN.encode(),                     # another scheme
    b"Token " + TOKEN.encode(),
    b"Bearer",                                      # the scheme alone
    TOKEN.encode(),                                 # the key without a scheme
]


async def test_any_bad_credential_is_a_401_and_no_traceback(served: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    server, http = served
    caplog.set_level(logging.DEBUG)
    ok = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1}}'
    for auth in BAD_CREDENTIALS:
        r = await _post(http, ok, auth)
        assert r.status_code == 401, (auth, r.text)
        assert "Bearer" in r.json()["error"]["message"], (auth, r.text)
        for method, path in (("GET", "/get_model_info"), ("POST", "/nowhere")):
            r = await http.request(method, path, headers=[] if auth is None else [(b"authorization", auth)])
            assert r.status_code == 401, (auth, path, r.text)
    assert server.generations == 0
    assert not _logged_failures(caplog), [r.getMessage() for r in _logged_failures(caplog)]
    # The key itself still works, and /health needs none.
    r = await _post(http, ok)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    assert (await http.get("/health")).status_code == 200


def _nested(depth: int) -> bytes:
    """A JSON array nesting ``depth`` levels (the array itself is level 1)."""
    return b"[" * depth + b"]" * depth


async def test_a_body_nested_too_deep_is_a_400(served: Any, caplog: pytest.LogCaptureFixture) -> None:
    server, http = served
    caplog.set_level(logging.DEBUG)
    bodies = [
        _nested(100_000),                                                    # far past any parser's limit
        _nested(MAX_JSON_DEPTH + 1),                                         # just past the gateway's
        b'{"input_ids": [1], "return_hidden_states": ' + _nested(MAX_JSON_DEPTH) + b"}",
        b'{"input_ids": [1], "sampling_params": {"stop": ' + _nested(5_000) + b"}}",
        b'{"input_ids": ' + _nested(100_000) + b"}",
    ]
    for body in bodies:
        r = await _post(http, body)
        assert r.status_code == 400, (body[:60], r.text)
        message = r.json()["error"]["message"]
        assert f"deeper than {MAX_JSON_DEPTH} levels" in message, message
    assert server.generations == 0
    assert not _logged_failures(caplog), [r.getMessage() for r in _logged_failures(caplog)]


BAD_SAMPLING: list[tuple[bytes, str]] = [
    # JSON's non-standard literals, which Python's json module reads as floats, and a number past a double.
    (b'"temperature": NaN', "not JSON"),
    (b'"temperature": Infinity', "not JSON"),
    (b'"temperature": -Infinity', "not JSON"),
    (b'"temperature": 1e999', "not JSON"),
    (b'"top_p": NaN', "not JSON"),
    (b'"temperature": ' + str(MAX_TEMPERATURE * 2).encode(), "temperature"),
    (b'"temperature": -0.5', "temperature"),
    (b'"temperature": "1"', "temperature"),
    (b'"temperature": true', "temperature"),
    (b'"top_p": 1.5', "top_p"),
    (b'"top_p": 0', "top_p"),
    (b'"top_p": -1', "top_p"),
    (b'"top_k": -2', "top_k"),
    (b'"top_k": 1099511627776', "top_k"),
    (b'"top_k": 1.5', "top_k"),
    (b'"max_new_tokens": 65', "more than this server's limit of 64"),
    (b'"max_new_tokens": 1000000000000', "more than this server's limit of 64"),
    (b'"max_new_tokens": 123456789012345678901234567890', "max_new_tokens"),
    (b'"max_new_tokens": 4.0', "max_new_tokens"),
    (b'"sampling_seed": 1e30', "sampling_seed"),
]


async def test_non_finite_or_out_of_range_sampling_is_a_400(served: Any, llama_engine: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    server, http = served
    caplog.set_level(logging.DEBUG)
    for field, fragment in BAD_SAMPLING:
        r = await _post(http, b'{"input_ids": [1, 2, 3], "sampling_params": {' + field + b"}}")
        assert r.status_code == 400, (field, r.text)
        assert fragment in r.json()["error"]["message"], (field, r.text)
    # Token ids outside the engine's vocabulary, in the prompt or the stop list.
    vocab = llama_engine._llm.n_vocab()
    for body in (b'{"input_ids": [1, %d]}' % vocab,
                 b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [%d]}}' % vocab):
        r = await _post(http, body)
        assert r.status_code == 400 and f"vocabulary size {vocab}" in r.json()["error"]["message"], r.text
    assert server.generations == 0
    # The bounds themselves are served, and a temperature so small that the logits overflow samples the
    # top token (it drew from NaN probabilities: a 500).
    for field in (b'"temperature": %g, "top_k": -1' % MAX_TEMPERATURE, b'"temperature": 0, "top_p": 1',
                  b'"temperature": 1e-310', b'"temperature": 5e-324, "top_k": 3, "top_p": 0.5',
                  b'"max_new_tokens": 64, "stop_token_ids": [%d]' % (vocab - 1)):
        r = await _post(http,
                        b'{"input_ids": [1, 2, 3], "sampling_params": {' + field + b', "sampling_seed": 4}}')
        assert r.status_code == 200, (field, r.text)
    greedy = await _post(http, b'{"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, '
                               b'"max_new_tokens": 4}}')
    tiny = await _post(http, b'{"input_ids": [1, 2, 3], "sampling_params": {"temperature": 1e-310, '
                             b'"max_new_tokens": 4, "sampling_seed": 8}}')
    assert tiny.json()["output_ids"] == greedy.json()["output_ids"]
    assert not _logged_failures(caplog), [r.getMessage() for r in _logged_failures(caplog)]


async def test_new_tokens_are_capped_by_default(llama_engine: Any) -> None:
    async with EngineServer(llama_engine) as server, httpx.AsyncClient(base_url=server.url,
                                                                       timeout=60) as http:
        assert server.max_new_tokens == MAX_NEW_TOKENS_CAP
        for n in (MAX_NEW_TOKENS_CAP + 1, 2**62):
            r = await _post(http, b'{"input_ids": [1], "sampling_params": {"max_new_tokens": %d}}' % n, None)
            assert r.status_code == 400, r.text
            assert f"limit of {MAX_NEW_TOKENS_CAP}" in r.json()["error"]["message"]
        r = await _post(http,
                        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 3, "sampling_seed": 2}}',
                        None)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
        assert server.generations == 1
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            EngineServer(llama_engine, max_new_tokens=bad)
