"""The ``upstream`` policy: forward each request to an OpenAI-compatible chat-completions server.

Works with vLLM, SGLang or a hosted API. Every request, whatever protocol the agent spoke, is
rendered as a chat-completions body (``protocols.openai_chat.render_request``) and sent to
``{base_url}/chat/completions``; the answer comes back as a canonical :class:`Completion`.

Token-faithful trajectories: the policy asks for token ids and logprobs (vLLM's
``"return_token_ids": true``, ``"logprobs": true``, ``"top_logprobs": 0``) and records the server's
``prompt_token_ids``, ``choices[0].token_ids`` and ``choices[0].logprobs.content[].logprob`` as the
turn's :class:`TokenRecord`. With ``token_ids="auto"`` (the default) a server that rejects those
fields with a 400 is asked again without them, once, and never again.

Retries (tenacity, exponential back-off with jitter, ``Retry-After`` honoured): 429, 408 and 5xx
answers, timeouts and connection errors. Retrying is safe because an LLM call has no side effect.
A streamed answer is retried only until the server accepts it: once deltas reach the agent, a
retry would repeat them.

Cost: with :class:`Prices`, each turn's completion carries ``extra["cost_usd"]`` (it shows in the
turn log), and :attr:`UpstreamPolicy.usage` sums tokens and cost per session.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
)

from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    CompletionDelta,
    TokenRecord,
    Usage,
    WireProtocol,
)
from ares_gateway.core.streaming import DeltaAccumulator
from ares_gateway.policies.base import PolicyError, PolicyRequest, canonical_of
from ares_gateway.protocols import RequestError, get_adapter
from ares_gateway.protocols.openai_chat import parse_usage

log = logging.getLogger(__name__)

#: Request fields that make vLLM return the token record.
TOKEN_FIELDS: dict[str, Any] = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}
_RETRY_STATUSES = frozenset({408, 429})
_PART_KEYS = frozenset({"type", "text", "image_url", "input_audio", "file", "refusal"})
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "content_filter": "content_filter",
           "function_call": "tool_calls"}


@dataclass(frozen=True)
class Prices:
    """USD per million tokens. ``cached_input`` defaults to the ``input`` price."""

    input: float
    output: float
    cached_input: float | None = None

    def cost(self, usage: Usage) -> float:
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        cached_price = self.input if self.cached_input is None else self.cached_input
        return (
            (usage.input_tokens - cached) * self.input
            + cached * cached_price
            + usage.output_tokens * self.output
        ) / 1_000_000


@dataclass
class UsageTotals:
    """Tokens, cost and turns summed over one session (or all)."""

    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, usage: Usage | None, cost: float | None) -> None:
        self.turns += 1
        if usage is not None:
            self.input_tokens += usage.input_tokens
            self.output_tokens += usage.output_tokens
            self.cached_input_tokens += usage.cached_input_tokens
        if cost is not None:
            self.cost_usd += cost


@dataclass
class UpstreamConfig:
    """Settings of an :class:`UpstreamPolicy`."""

    #: The server's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended).
    base_url: str
    api_key: str | None = None
    #: The model to ask for; ``None`` passes on the agent's own model name.
    model: str | None = None
    #: Ask for token ids and logprobs: ``"auto"`` (ask; stop asking if the server rejects it), True, False.
    token_ids: bool | Literal["auto"] = "auto"
    #: Relay the upstream stream to the agent delta by delta (else one request, one answer).
    stream: bool = False
    #: Seconds for one attempt (connect + whole response); a streamed answer's gaps are bounded by it too.
    timeout: float = 600.0
    connect_timeout: float = 10.0
    max_attempts: int = 6
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    #: Lower the agent's max_tokens to this (agents ask for 32k; a small server context rejects that).
    max_tokens_cap: int | None = None
    #: Merged into every request body (e.g. ``{"temperature": 1.0}`` or vLLM sampling extras).
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    prices: Prices | None = None
    max_connections: int = 256


class UpstreamError(PolicyError):
    """The upstream server failed (after retries, when retryable); ``status`` is passed to the agent."""

    def __init__(self, message: str, *, status: int = 502, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message, status=status)
        self.retryable = retryable
        self.retry_after = retry_after


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, UpstreamError):
        return exc.retryable
    return isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | TimeoutError)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from inference servers; fall back to back-off


def _error_message(status: int, text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return f"upstream answered {status}: {text.strip()[:500]}"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return f"upstream answered {status}: {err['message']}"
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return f"upstream answered {status}: {body['message']}"
    return f"upstream answered {status}: {text.strip()[:500]}"


def _key_refused(base: str, status: int) -> str:
    return (f"upstream {base} refused the API key ({status}): put the key in an environment variable and "
            "pass its name with --api-key-env VAR")


class UpstreamPolicy:
    """Forward requests to an OpenAI-compatible server (see the module docstring).

    ``UpstreamPolicy(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B")`` or
    ``UpstreamPolicy(UpstreamConfig(...))``. Close it with :meth:`aclose` (or ``async with``).
    """

    def __init__(self, config: UpstreamConfig | None = None, **settings: Any) -> None:
        if config is None:
            config = UpstreamConfig(**settings)
        elif settings:
            raise TypeError("pass either an UpstreamConfig or keyword settings, not both")
        if not config.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {config.base_url!r}")
        if config.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.config = config
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._http: aiohttp.ClientSession | None = None
        self._ask_tokens = config.token_ids is not False
        self._warned_no_tokens = False
        #: Totals per session id ("" for requests given without a session).
        self.usage: dict[str, UsageTotals] = {}
        self.total = UsageTotals()

    def __repr__(self) -> str:
        return f"UpstreamPolicy({self.url!r}, model={self.config.model!r})"

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    async def __aenter__(self) -> UpstreamPolicy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            headers = {"content-type": "application/json", **self.config.headers}
            if self.config.api_key:
                headers["authorization"] = f"Bearer {self.config.api_key}"
            self._http = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(limit=self.config.max_connections),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self.config.connect_timeout, sock_read=self.config.timeout
                ),
            )
        return self._http

    # ------------------------------------------------------------------ start-up check

    async def check(self, *, timeout: float = 10.0) -> str:
        """Ask the server whether it answers, once, within ``timeout`` seconds (no retries): ``GET
        {base_url}/models``, or one chat completion of ``max_tokens: 1`` when it has no ``/models``.

        Returns a line saying what answered. Raises :class:`UpstreamError` with a message saying what to
        do when the server cannot be reached, does not answer in time, refuses the API key, or (with a
        ``model`` set) does not list that model.
        """
        base = self.config.base_url.rstrip("/")
        limit = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, self.config.connect_timeout))
        try:
            async with self._session().get(base + "/models", timeout=limit) as resp:
                status, text = resp.status, await resp.text(errors="replace")
            if status in (404, 405):  # no /models here: one tiny request instead
                body = {"model": self.config.model or "ares-preflight", "max_tokens": 1, "stream": False,
                        "messages": [{"role": "user", "content": "Reply with one word."}]}
                async with self._session().post(self.url, json=body, timeout=limit) as resp:
                    status, text = resp.status, await resp.text(errors="replace")
                if status in (401, 403):
                    raise UpstreamError(_key_refused(base, status), status=status)
                if status >= 400 and (self.config.model or status >= 500):
                    raise UpstreamError(
                        f"{_error_message(status, text)} (POST {self.url}, the start-up check)",
                        status=status)
                return f"upstream {base} answers (no /models; a one-token chat completion answered {status})"
        except TimeoutError:
            raise UpstreamError(
                f"upstream {base} did not answer within {timeout:g} s: is the server up, and is "
                "--base-url its OpenAI base URL (ending in /v1)?", status=504) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"cannot reach upstream {base}: {exc}: start the server or fix --base-url",
                                status=502) from None
        if status in (401, 403):
            raise UpstreamError(_key_refused(base, status), status=status)
        if status >= 400:
            raise UpstreamError(f"{_error_message(status, text)} (GET {base}/models, the start-up check)",
                                status=status)
        try:
            listed = [m["id"] for m in json.loads(text).get("data", []) if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError, TypeError):
            raise UpstreamError(
                f"upstream {base}/models answered {status} with something that is not a model list: "
                f"is --base-url the OpenAI base URL (ending in /v1)? It said: {text.strip()[:200]}",
                status=502) from None
        model = self.config.model
        if model and listed and model not in listed:
            shown = ", ".join(listed[:10]) + (", ..." if len(listed) > 10 else "")
            raise UpstreamError(
                f"upstream {base} does not serve model {model!r}; it serves {shown}: pass one of "
                "them as --model", status=404)
        return f"upstream {base} answers" + (f" (serves {model})" if model and listed else
                                              f" ({len(listed)} model(s) listed)")

    # ------------------------------------------------------------------ the request body

    def build_body(self, request: CanonicalRequest, *, stream: bool) -> dict[str, Any]:
        """The chat-completions body sent upstream for ``request``."""
        foreign = request.protocol is not WireProtocol.OPENAI_CHAT
        if foreign:
            # Request-level extras of Anthropic / Responses (thinking, metadata, store, include, ...)
            # mean nothing to a chat-completions server and strict servers reject them.
            request = request.model_copy(update={"extra": {}})
        body = get_adapter(WireProtocol.OPENAI_CHAT).render_request(request)
        if foreign:
            _clean_foreign(body)
        model = self.config.model or request.model
        if not model:
            raise UpstreamError("no model to ask the upstream server for: set the policy's model", status=400)
        body["model"] = model
        cap = self.config.max_tokens_cap
        if cap is not None:
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(key), int) and body[key] > cap:
                    body[key] = cap
        body.pop("stream_options", None)
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self._ask_tokens:
            body.update(TOKEN_FIELDS)
        body.update(self.config.extra_body)
        return body

    # ------------------------------------------------------------------ the policy

    async def __call__(self, request: PolicyRequest,
                       /) -> Completion | AsyncIterator[CompletionDelta | Completion]:
        if self.config.stream:
            return await self.stream(request)
        return await self.complete(request)

    async def complete(self, request: PolicyRequest) -> Completion:
        """One non-streamed upstream call (with retries) -> the canonical completion with its token record."""
        canonical = canonical_of(request)
        started = time.monotonic()
        body, attempts = await self._with_retries(lambda b: self._post_json(b), canonical, stream=False)
        try:
            completion = get_adapter(WireProtocol.OPENAI_CHAT).parse_response(body, canonical)
        except RequestError as exc:
            raise UpstreamError(f"the upstream response is not a chat completion: {exc.message}",
                                status=502) from None
        return self._finish(request, completion, attempts, time.monotonic() - started)

    async def stream(self, request: PolicyRequest) -> AsyncIterator[CompletionDelta | Completion]:
        """Open an upstream stream (with retries) and return an iterator of CompletionDelta items as
        they arrive, then the whole Completion. Failing to open raises :class:`UpstreamError` here, so
        the agent gets the upstream's status rather than a broken stream."""
        canonical = canonical_of(request)
        started = time.monotonic()
        resp, attempts = await self._with_retries(lambda b: self._open_stream(b), canonical, stream=True)
        return _Relay(self._relay(request, resp, attempts, started), resp)

    async def _relay(
        self, request: PolicyRequest, resp: aiohttp.ClientResponse, attempts: int, started: float
    ) -> AsyncIterator[CompletionDelta | Completion]:
        acc = DeltaAccumulator()
        prompt_ids: list[int] | None = None
        output_ids: list[int] = []
        logprobs: list[float] = []
        logprobs_ok = True
        finish: str | None = None
        usage: Usage | None = None
        model: str | None = None
        try:
            async for data in _sse_events(resp):
                if isinstance(data.get("error"), dict):
                    raise UpstreamError(_error_message(502, json.dumps(data)), status=502)
                if isinstance(data.get("model"), str):
                    model = data["model"]
                if isinstance(data.get("usage"), dict):
                    usage = parse_usage(data["usage"])
                if isinstance(data.get("prompt_token_ids"), list):
                    prompt_ids = data["prompt_token_ids"]
                for choice in data.get("choices") or ():
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    if isinstance(choice.get("prompt_token_ids"), list):
                        prompt_ids = choice["prompt_token_ids"]
                    if isinstance(choice.get("token_ids"), list):
                        output_ids.extend(choice["token_ids"])
                    lp = choice.get("logprobs")
                    content = lp.get("content") if isinstance(lp, dict) else None
                    if isinstance(content, list):
                        for e in content:
                            if isinstance(e, dict) and isinstance(e.get("logprob"), int | float):
                                logprobs.append(float(e["logprob"]))
                            else:
                                logprobs_ok = False
                    if isinstance(choice.get("finish_reason"), str):
                        finish = choice["finish_reason"]
                    for delta in _deltas(choice.get("delta")):
                        acc.add(delta)
                        yield delta
        finally:
            resp.release()
        completion = acc.completion(_FINISH.get(finish or "", None))
        tokens = None
        if prompt_ids is not None and output_ids:
            tokens = TokenRecord.model_validate({  # validated into int32 / float64 arrays
                "prompt_ids": prompt_ids,
                "output_ids": output_ids,
                "output_logprobs": logprobs if logprobs_ok and len(logprobs) == len(output_ids) else [],
                "finish_reason": finish,
            })
        completion = completion.model_copy(update={"usage": usage, "tokens": tokens, "model": model})
        yield self._finish(request, completion, attempts, time.monotonic() - started)

    # ------------------------------------------------------------------ internals

    def _finish(self, request: PolicyRequest, completion: Completion, attempts: int,
                latency: float) -> Completion:
        if self._ask_tokens and completion.tokens is None and not self._warned_no_tokens:
            self._warned_no_tokens = True
            log.warning(
                "%s returned no token ids: trajectories will hold no training samples (vLLM >= "
                "0.10.2 returns them for return_token_ids=true)", self.url,
            )
        cost = self.config.prices.cost(completion.usage) if self.config.prices and completion.usage else None
        sid = request.session_id if isinstance(request, ParkedRequest) else ""
        self.usage.setdefault(sid, UsageTotals()).add(completion.usage, cost)
        self.total.add(completion.usage, cost)
        extra = {**completion.extra, "upstream": {"attempts": attempts, "latency_s": round(latency, 6)}}
        if cost is not None:
            extra["cost_usd"] = cost
        return completion.model_copy(update={"extra": extra})

    async def _with_retries(self, send: Any, request: CanonicalRequest, *, stream: bool) -> tuple[Any, int]:
        cfg = self.config
        def wait(state: RetryCallState) -> float:
            # Exponential back-off with jitter (spelled out: tenacity renamed wait_exponential_jitter's
            # arguments between the versions this package accepts).
            exc = state.outcome.exception() if state.outcome else None
            pause = min(cfg.backoff_max, cfg.backoff_initial * 2 ** (state.attempt_number - 1))
            pause += random.uniform(0, cfg.backoff_initial)
            if isinstance(exc, UpstreamError) and exc.retry_after is not None:
                pause = max(pause, min(exc.retry_after, cfg.backoff_max))
            return pause

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.info("upstream attempt %d failed (%s); retrying", state.attempt_number, exc)

        fallback_done = False
        while True:
            body = self.build_body(request, stream=stream)
            attempts = 0
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception(_retryable),
                    stop=stop_after_attempt(cfg.max_attempts),
                    wait=wait,
                    before_sleep=before_sleep,
                    reraise=True,
                ):
                    with attempt:
                        attempts = attempt.retry_state.attempt_number
                        return await send(body), attempts
            except UpstreamError as exc:
                if (
                    exc.status == 400
                    and self._ask_tokens
                    and self.config.token_ids == "auto"
                    and not fallback_done
                    and any(k in exc.message for k in TOKEN_FIELDS)
                ):
                    # The server does not know the token-record fields: ask without them from now on.
                    log.warning("%s rejected token-id fields (%s); continuing without token records",
                                self.url, exc)
                    self._ask_tokens = False
                    fallback_done = True
                    continue
                if exc.retryable:
                    raise UpstreamError(
                        f"{exc.message} (gave up after {attempts} attempts)", status=exc.status
                    ) from None
                raise
            except TimeoutError:
                raise UpstreamError(
                    f"upstream {self.url} timed out (gave up after {attempts} attempts)", status=504
                ) from None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                raise UpstreamError(
                    f"cannot reach upstream {self.url}: {exc} (gave up after {attempts} attempts)", status=502
                ) from None

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        text = await resp.text(errors="replace")
        resp.release()
        status = resp.status
        retryable = status in _RETRY_STATUSES or status >= 500
        raise UpstreamError(
            _error_message(status, text),
            # 5xx of the upstream is a bad gateway for the agent; 4xx pass through (429 lets agents back off).
            status=502 if status >= 500 else status,
            retryable=retryable,
            retry_after=_retry_after(resp.headers.get("retry-after")),
        )

    async def _post_json(self, body: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout, connect=self.config.connect_timeout)
        async with self._session().post(self.url, json=body, timeout=timeout) as resp:
            await self._check(resp)
            try:
                return await resp.json(content_type=None)
            except ValueError as exc:
                raise UpstreamError(f"upstream answered {resp.status} with invalid JSON: {exc}",
                                    status=502) from None

    async def _open_stream(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        resp = await self._session().post(self.url, json=body)
        try:
            await self._check(resp)
        except BaseException:
            resp.release()
            raise
        return resp


class _Relay:
    """The relayed stream. ``aclose()`` also releases the upstream connection when the stream was
    never iterated (an async generator's ``finally`` does not run then), e.g. when the agent left
    before the answer could be delivered."""

    def __init__(self, gen: AsyncIterator[CompletionDelta | Completion],
                 resp: aiohttp.ClientResponse) -> None:
        self._gen = gen
        self._resp = resp

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> CompletionDelta | Completion:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()  # type: ignore[attr-defined]
        finally:
            self._resp.release()


def _clean_foreign(body: dict[str, Any]) -> None:
    """Make a body rendered from another protocol's request acceptable to strict chat servers."""
    for msg in body.get("messages", ()):
        content = msg.get("content")
        if isinstance(content, list):
            parts = [{k: v for k, v in p.items() if k in _PART_KEYS} for p in content if isinstance(p, dict)]
            if all(p.get("type") == "text" for p in parts):
                # Text-only lists become a string: some chat templates accept nothing else.
                msg["content"] = "\n".join(p.get("text", "") for p in parts)
            else:
                msg["content"] = parts
        for key in [k for k in msg if k not in ("role", "content", "name", "tool_calls", "tool_call_id",
                                                "reasoning_content")]:
            del msg[key]
    tools = body.get("tools")
    if isinstance(tools, list):
        # Server tools (web search, ...) of other APIs cannot run on a chat-completions server.
        kept = [t for t in tools if isinstance(t, dict) and t.get("type") == "function"]
        if kept:
            body["tools"] = kept
        else:
            body.pop("tools", None)
            body.pop("tool_choice", None)


def _deltas(delta: Any) -> list[CompletionDelta]:
    """The CompletionDelta items of one chat-completions chunk's ``delta``."""
    if not isinstance(delta, dict):
        return []
    out: list[CompletionDelta] = []
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        out.append(CompletionDelta(reasoning=reasoning))
    if isinstance(delta.get("content"), str) and delta["content"]:
        out.append(CompletionDelta(text=delta["content"]))
    for i, tc in enumerate(delta.get("tool_calls") or ()):
        if not isinstance(tc, dict):
            continue
        index = tc.get("index", i)
        raw_fn = tc.get("function")
        fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else {}
        if tc.get("id") or fn.get("name"):
            # The first piece names the call; arguments follow in their own delta (one kind per delta).
            out.append(CompletionDelta(tool_index=index, tool_call_id=tc.get("id"), tool_name=fn.get("name")))
        if isinstance(fn.get("arguments"), str) and fn["arguments"]:
            out.append(CompletionDelta(tool_index=index, arguments=fn["arguments"]))
    return out


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's ``data:`` lines, until ``[DONE]`` or the end."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while True:
            nl = buffer.find(b"\n")
            if nl < 0:
                break
            line, buffer = buffer[:nl].rstrip(b"\r"), buffer[nl + 1 :]
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            if not payload:
                continue
            try:
                data = json.loads(payload)
            except ValueError:
                raise UpstreamError(f"upstream sent an unreadable stream event: {payload[:200]!r}",
                                    status=502) from None
            if isinstance(data, dict):
                yield data
