"""Fixtures for the rollout building blocks: a fake upstream LLM server and a gateway on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ares_gateway import Gateway

from .fake_llm import FakeLLM, running


@pytest.fixture
async def llm() -> AsyncIterator[FakeLLM]:
    async for server in running(FakeLLM()):
        yield server


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with Gateway(port=0, request_timeout=30) as gw:
        yield gw
