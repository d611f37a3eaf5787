"""Fixtures for gateway tests: a real gateway on a loopback port, sessions, and HTTP responders."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from ares_gateway import Gateway, SessionInfo

ADMIN = "test-admin-token-0123456789"


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with Gateway(port=0, admin_token=ADMIN, request_timeout=30, lease_seconds=30) as gw:
        yield gw


@pytest.fixture
async def session(gateway: Gateway) -> SessionInfo:
    return await gateway.create_session()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        yield s


def handler_tasks() -> list[asyncio.Task[Any]]:
    """The gateway's request handlers still running (aiohttp's ``_handle_request`` tasks)."""
    return [t for t in asyncio.all_tasks() if "_handle_request" in getattr(t.get_coro(), "__qualname__", "")]


Answerer = Callable[[dict[str, Any]], Awaitable[dict[str, Any]] | dict[str, Any]]


@contextlib.asynccontextmanager
async def http_responder(
    gateway: Gateway, answer: Answerer, *, max_items: int = 10
) -> AsyncIterator[list[dict[str, Any]]]:
    """A policy in the style of a separate trainer process: long-polls /poll and posts /respond.

    ``answer(item)`` returns the /respond payload without "id" (e.g. {"completion": {...}}).
    Yields the list of polled items, for assertions.
    """
    seen: list[dict[str, Any]] = []

    async def loop() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
            while True:
                async with s.get(f"{gateway.url}/poll", params={"wait": "5", "max": str(max_items)}) as r:
                    assert r.status == 200, await r.text()
                    items = await r.json()
                for item in items:
                    seen.append(item)
                    out = answer(item)
                    if asyncio.iscoroutine(out):
                        out = await out
                    async with s.post(f"{gateway.url}/respond", json={"id": item["id"], **out}) as r:
                        assert r.status == 200, await r.text()

    task = asyncio.create_task(loop())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
