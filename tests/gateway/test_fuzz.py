"""Random bodies posted to every endpoint: never a 5xx, never a crash, nothing left parked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ares_gateway import Gateway

from .conftest import ADMIN

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20), lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=20,
)
# Bodies shaped like the real APIs' (so parsing goes deep), with random values in every slot.
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"]) | json_values},
    optional={
        "content": json_values
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(
                    ["text", "image", "tool_use", "tool_result", "thinking", "input_text", "image_url"])},
                optional={"text": json_values, "input": json_values, "content": json_values,
                          "id": json_values, "image_url": json_values, "source": json_values},
            ),
            max_size=3,
        ),
        "tool_calls": json_values,
        "tool_call_id": json_values,
    },
)
api_body = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": st.lists(message, max_size=4) | json_values,
        "input": st.lists(message, max_size=3) | json_values,
        "system": json_values,
        "tools": json_values,
        "max_tokens": json_values,
        "stream": st.booleans() | json_values,
        "instructions": json_values,
        "tool_choice": json_values,
    },
)
raw_bytes = st.binary(max_size=200)

ENDPOINTS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("POST", "/respond"),
    ("POST", "/sessions"),
    ("POST", "/sessions/x/end"),
    ("GET", "/poll"),
]


def test_random_bodies_never_5xx() -> None:
    async def run(cases: list[tuple[str, str, bytes]]) -> list[tuple[str, int]]:
        statuses: list[tuple[str, int]] = []
        # A short request timeout: a body that parses is parked and must time out cleanly (504 is the
        # designed outcome then, not a crash), so the test stays fast.
        async with Gateway(port=0, admin_token=ADMIN, request_timeout=0.05) as gw:
            info = await gw.create_session()
            headers = {"authorization": f"Bearer {info.token}", "x-api-key": info.token}
            async with aiohttp.ClientSession() as s:
                for method, path, data in cases:
                    url = (info.base_url if path.startswith("/v1") else gw.url) + path
                    h = headers if path.startswith("/v1") else {"authorization": f"Bearer {ADMIN}"}
                    async with s.request(method, url, data=data, headers=h, params={"wait": "0"}) as r:
                        await r.read()
                        statuses.append((path, r.status))
            await asyncio.sleep(0.1)
            assert gw.broker.pending_count == 0
        return statuses

    collected: list[tuple[str, str, bytes]] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(ENDPOINTS), api_body | json_values, raw_bytes, st.booleans())
    def gen(endpoint: tuple[str, str], body: Any, raw: bytes, use_raw: bool) -> None:
        data = raw if use_raw else json.dumps(body).encode()
        collected.append((endpoint[0], endpoint[1], data))

    gen()
    statuses = asyncio.run(run(collected))
    bad = [(p, s) for p, s in statuses if s >= 500 and s != 504]
    assert not bad, bad
    assert any(s == 400 for _, s in statuses)
