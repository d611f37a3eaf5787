"""Shared plumbing of the HTTP engines: one aiohttp session, JSON POSTs with tenacity retries."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from ares_gateway.engines.base import EngineError, EngineResponseError, EngineUnavailableError

# Statuses worth retrying: the engine is busy, restarting, or behind a proxy that hiccupped.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class _Retryable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class HttpEngineBase:
    """Base of :class:`SGLangEngine` / :class:`VLLMEngine`: connection, timeouts, retries.

    Args:
        url: the engine's base URL (``http://127.0.0.1:30000``).
        timeout_s: total time one attempt may take (long generations need minutes).
        connect_timeout_s: time to open a connection.
        max_attempts: attempts per request (connection errors and 408/429/5xx are retried with
            exponential backoff between ``backoff_s`` and ``max_backoff_s``).
        headers: extra request headers (e.g. ``Authorization``); never logged.
    """

    name = "http"

    def __init__(
        self,
        url: str,
        *,
        model: str = "",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self.retries = 0  # attempts beyond the first, over the engine's life

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s),
                headers=self._headers,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http_error(self, url: str, status: int, text: str) -> EngineError:
        """The error a 4xx answer (not retried) becomes; an engine names the ones it can tell apart."""
        return EngineResponseError(f"{self.name} at {url} answered HTTP {status}: {text[:500]}")

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            retry=retry_if_exception(lambda e: isinstance(e, _Retryable)),
            reraise=True,
        )

    async def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body``, return the parsed JSON answer; retried; errors as :class:`EngineError`."""
        url = self.url + path
        try:
            async for attempt in self._retrying():
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self.retries += 1
                    return await self._once(url, body)
        except _Retryable as exc:
            raise EngineUnavailableError(
                f"{self.name} at {self.url}: {exc.message} (after {self.max_attempts} attempts)") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(self, url: str, body: dict[str, Any]) -> Any:
        try:
            async with self._client().post(url, json=body) as resp:
                text = await resp.text()
                if resp.status in _RETRY_STATUSES:
                    raise _Retryable(f"HTTP {resp.status}: {text[:300]}")
                if resp.status >= 400:
                    raise self._http_error(url, resp.status, text)
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        try:
            return json.loads(text)
        except ValueError:
            raise EngineResponseError(f"{self.name} at {url} answered non-JSON: {text[:300]!r}") from None

    async def _post_sse(self, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """POST ``body`` and yield each ``data:`` event's JSON until ``[DONE]``.

        Only opening the stream is retried: once tokens flowed, a retry would sample them again.
        """
        url = self.url + path
        resp: aiohttp.ClientResponse | None = None
        try:
            async for attempt in self._retrying():
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self.retries += 1
                    try:
                        r = await self._client().post(url, json=body)
                    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                        raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
                    if r.status in _RETRY_STATUSES:
                        text = await r.text()
                        r.release()
                        raise _Retryable(f"HTTP {r.status}: {text[:300]}")
                    if r.status >= 400:
                        text = await r.text()
                        r.release()
                        raise self._http_error(url, r.status, text)
                    resp = r
        except _Retryable as exc:
            raise EngineUnavailableError(
                f"{self.name} at {self.url}: {exc.message} (after {self.max_attempts} attempts)") from None
        assert resp is not None
        try:
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    yield json.loads(data)
                except ValueError:
                    raise EngineResponseError(
                        f"{self.name} at {url} streamed non-JSON: {data[:300]!r}") from None
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            raise EngineUnavailableError(
                f"{self.name} at {url}: the stream broke: {type(exc).__name__}: {exc}") from exc
        finally:
            resp.release()
