"""Answers rendered for the wire: JSON bodies, error shapes, and the SSE streams of the three LLM APIs.

Nothing here decides anything: the agent API (:mod:`ares_gateway.http.agent_api`) picks what
to send, and this module writes it: a whole answer as the protocol's JSON body, a whole answer
to a streaming request as the protocol's synthesized SSE stream, and a policy's stream delta by
delta (each protocol's encoder, e.g. ``ResponsesStreamEncoder`` in
:mod:`ares_gateway.protocols.openai_responses`, spells out its events).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import Response, StreamResponse

from ares_gateway.core.answers import NativeAnswer
from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import Completion, CompletionDelta, WireProtocol
from ares_gateway.http.server import ACCEPTED_ENCODINGS
from ares_gateway.protocols import ProtocolAdapter, get_adapter

log = logging.getLogger(__name__)

_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
#: Statuses an agent may retry; they carry ``retry-after``.
_RETRYABLE = frozenset((429, 503, 529))


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body=orjson.dumps(body), status=status,
                    headers={**_JSON, **headers} if headers else _JSON)


#: The agent paths of each LLM API (at the root and under ``/s/{sid}``): the routes the gateway
#: serves (:func:`ares_gateway.http.app.build_routes`) and the shape of errors on any path.
AGENT_PATHS: dict[str, WireProtocol] = {
    "/v1/chat/completions": WireProtocol.OPENAI_CHAT,
    "/chat/completions": WireProtocol.OPENAI_CHAT,
    "/v1/messages": WireProtocol.ANTHROPIC_MESSAGES,
    "/v1/responses": WireProtocol.OPENAI_RESPONSES,
    "/responses": WireProtocol.OPENAI_RESPONSES,
}
# An unknown path takes the shape of the API whose resource it names (``/v1/messages/batches``,
# ``/proxy/responses``): the last segment of each API's paths; chat completions otherwise.
_RESOURCE_OF: dict[str, WireProtocol] = {
    "/" + p.rsplit("/", 1)[1]: proto for p,
    proto in AGENT_PATHS.items() if proto is not WireProtocol.OPENAI_CHAT
}


def protocol_for_path(path: str) -> WireProtocol:
    """The LLM API an agent path belongs to (errors on unknown paths take its shape too)."""
    return next((proto for resource, proto in _RESOURCE_OF.items() if resource in path),
                WireProtocol.OPENAI_CHAT)


def protocol_error(adapter: ProtocolAdapter, status: int, message: str, param: str | None = None) -> Response:
    """An error in the agent's protocol's own shape."""
    headers = {"retry-after": "1"} if status in _RETRYABLE else None
    if status == 415:  # only a body's Content-Encoding is refused so: RFC 9110 says name the accepted ones
        headers = {"accept-encoding": ACCEPTED_ENCODINGS}
    return json_response(adapter.error_body(status, message, param=param), status, headers)


def control_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error of the control API: ``{"status": "error", "code", "error"}``."""
    if status == 415 and headers is None:
        headers = {"accept-encoding": ACCEPTED_ENCODINGS}
    return json_response({"status": "error", "code": status, "error": message}, status, headers)


def error_for_path(path: str, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error in the shape of the API the path belongs to (an LLM API's, or the control API's)."""
    if path.startswith(("/v1", "/s/")) or "/v1/" in path:
        adapter = get_adapter(protocol_for_path(path))
        return json_response(adapter.error_body(status, message), status, headers)
    return control_error(status, message, headers)


def response_id(parked: ParkedRequest) -> str:
    """The id of the agent's response: the request's number, to which the protocol's renderer adds
    its own prefix (``chatcmpl-``, ``msg_``, ``resp_``: the one place it is added)."""
    return parked.id.removeprefix("req_")


def whole(adapter: ProtocolAdapter, parked: ParkedRequest, answer: Completion | NativeAnswer) -> Response:
    """The response to a request that did not ask for a stream, from a whole answer (an
    ``ErrorAnswer`` never gets here: the agent API answers it before choosing how to render)."""
    if isinstance(answer, NativeAnswer):
        # Encoded when the answer was accepted (core/answers.py), so it cannot fail here.
        return Response(body=answer.raw if answer.raw is not None else orjson.dumps(answer.body),
                        headers=_JSON)
    assert isinstance(answer, Completion)
    return json_response(adapter.render_response(answer, parked.request, response_id(parked)))


#: What a parked streaming request is sent while sampling is paused: Anthropic's own no-op event
#: (its SDKs skip it), and an SSE comment line for the OpenAI APIs (their SDKs skip comments).
KEEPALIVE: dict[WireProtocol, bytes] = {
    WireProtocol.ANTHROPIC_MESSAGES: b'event: ping\ndata: {"type": "ping"}\n\n',
    WireProtocol.OPENAI_CHAT: b": keep-alive\n\n",
    WireProtocol.OPENAI_RESPONSES: b": keep-alive\n\n",
}


async def open_stream(request: BaseRequest) -> StreamResponse:
    """The SSE response, its status and headers sent (before the answer, to send keep-alives)."""
    resp = StreamResponse(status=200, headers=_SSE)
    await resp.prepare(request)
    return resp


async def stream_error(
    resp: StreamResponse, adapter: ProtocolAdapter, parked: ParkedRequest, status: int, message: str
) -> StreamResponse:
    """End an SSE response whose headers went out already with an error event in the protocol's shape."""
    encoder = adapter.stream_encoder(parked.request, response_id(parked))
    await resp.write(encoder.error(status, message))
    await resp.write_eof()
    return resp


async def synthesized_stream(
    request: BaseRequest, adapter: ProtocolAdapter, parked: ParkedRequest, completion: Completion,
    resp: StreamResponse | None = None,
) -> StreamResponse:
    """A whole answer to a request that asked for a stream: the protocol's full event sequence at once
    (into ``resp`` when its headers went out already)."""
    encoder = adapter.stream_encoder(parked.request, response_id(parked))
    if resp is None:
        resp = await open_stream(request)
    await resp.write(encoder.start() + encoder.finish(completion))
    await resp.write_eof()
    return resp


async def _next(items: AsyncIterator[CompletionDelta | Completion], timer: asyncio.Timeout,
                idle: float) -> Any:
    timer.reschedule(asyncio.get_running_loop().time() + idle)
    return await anext(items, None)


async def delta_stream(
    request: BaseRequest,
    adapter: ProtocolAdapter,
    parked: ParkedRequest,
    items: AsyncIterator[CompletionDelta | Completion],
    idle_timeout: float,
    resp: StreamResponse | None = None,
) -> StreamResponse:
    """The policy's stream as the protocol's SSE, delta by delta (into ``resp`` when its headers went
    out already).

    ``items`` (the broker's recording view of the policy's stream) yields deltas and ends with
    one whole :class:`Completion`. A stream that fails, or sends nothing for ``idle_timeout``
    seconds, ends the agent's stream with an error event in its protocol's shape.
    """
    encoder = adapter.stream_encoder(parked.request, response_id(parked))
    if resp is None:
        resp = await open_stream(request)
    await resp.write(encoder.start())
    try:
        try:
            async with asyncio.timeout(None) as timer:
                while (item := await _next(items, timer, idle_timeout)) is not None:
                    if isinstance(item, Completion):
                        timer.reschedule(None)
                        await resp.write(encoder.finish(item))
                        break
                    await resp.write(encoder.feed(item))
        except TimeoutError:
            log.warning("policy stream for %s stalled for %g s; ending the agent's stream", parked.id,
                        idle_timeout)
            await resp.write(encoder.error(504, f"the policy's stream sent nothing for {idle_timeout:g} s"))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the policy's stream broke: end the agent's stream with an error event
            log.warning("policy stream for %s failed: %s", parked.id, exc)
            await resp.write(encoder.error(502, f"the policy's stream failed: {exc}"))
    finally:
        await _aclose(items)
    await resp.write_eof()
    return resp


async def drained(
    adapter: ProtocolAdapter,
    parked: ParkedRequest,
    items: AsyncIterator[CompletionDelta | Completion],
    idle_timeout: float,
) -> Response:
    """A policy's stream answering a request that did not ask for one: read whole, sent as JSON."""
    final: Completion | None = None
    try:
        async with asyncio.timeout(None) as timer:
            while (item := await _next(items, timer, idle_timeout)) is not None:
                if isinstance(item, Completion):
                    final = item
                    break
    except TimeoutError:
        log.warning("policy stream for %s stalled for %g s", parked.id, idle_timeout)
        return protocol_error(adapter, 504, f"the policy's stream sent nothing for {idle_timeout:g} s")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the policy's stream broke: the agent gets a 502 in its shape
        log.warning("policy stream for %s failed: %s", parked.id, exc)
        return protocol_error(adapter, 502, f"the policy's stream failed: {exc}")
    finally:
        await _aclose(items)
    if final is None:
        return protocol_error(adapter, 502, "the policy's stream ended without a completion")
    return whole(adapter, parked, final)


async def _aclose(items: AsyncIterator[Any]) -> None:
    aclose = getattr(items, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # closing a broken stream must not hide what broke it
            log.debug("closing a policy stream failed", exc_info=True)


__all__ = [
    "AGENT_PATHS",
    "KEEPALIVE",
    "control_error",
    "delta_stream",
    "drained",
    "error_for_path",
    "json_response",
    "open_stream",
    "protocol_error",
    "protocol_for_path",
    "response_id",
    "stream_error",
    "synthesized_stream",
    "whole",
]
