"""What agents talk to: the three LLM APIs and the probes around them.

One agent turn, in order: auth (the session from the path or the token) → read the body, its
bytes held against the session's byte budget from its ``Content-Length`` on (a body over the
whole budget: 413; a session whose bodies would pass it, or every session's together the
gateway's ``max_parked_bytes``: 429) → parse it in its protocol (a
large one off the event loop, :mod:`ares_gateway.http.body_parser`) → park it with the broker,
which takes over the held bytes until it is answered → await the policy's answer → render it
(:mod:`ares_gateway.http.render`). If the agent disconnects while it waits, aiohttp cancels
the handler, which withdraws the parked request (the broker treats a cancelled waiter as gone
at once, so a ``respond`` in the same instant gets 410, never a half-delivered answer).
"""

from __future__ import annotations

import asyncio
import math
from functools import partial

import orjson
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import Response, StreamResponse

from ares_gateway.core.answers import Answer, ErrorAnswer, NativeAnswer, StreamAnswer
from ares_gateway.core.broker import Broker, ParkedRequest
from ares_gateway.core.canonical import WireProtocol
from ares_gateway.core.errors import InvalidSessionError, SessionExistsError, StatusError
from ares_gateway.core.sessions import Session, bearer_token, valid_token
from ares_gateway.http import render
from ares_gateway.http.body_parser import ParsedBody, ParseMemo
from ares_gateway.http.routes import Handler
from ares_gateway.http.served import ServedGateway
from ares_gateway.http.server import BodyError, HttpLimits, on_disconnect, read_body
from ares_gateway.protocols import ProtocolAdapter, get_adapter
from ares_gateway.protocols.anthropic_messages import parse_count_tokens_request

#: Bodies smaller than this are converted whole, without the session's :class:`ParseMemo`.
_REUSE_MIN_BYTES = 8 * 1024


def body_budget(broker: Broker) -> tuple[float, str]:
    """The most bytes one body may have, and whose budget sets it ("per session" / "across sessions")."""
    if broker.max_parked_bytes < broker.max_parked_bytes_per_session:
        return broker.max_parked_bytes, "across sessions"
    return broker.max_parked_bytes_per_session, "per session"


class _Held:
    """Body bytes of one request counted against its session's budget, until parked or given back."""

    __slots__ = ("broker", "nbytes", "session_id")

    def __init__(self, broker: Broker, session_id: str) -> None:
        self.broker = broker
        self.session_id = session_id
        self.nbytes = 0

    def __call__(self, nbytes: int) -> None:
        budget, scope = body_budget(self.broker)
        if self.nbytes + nbytes > budget:
            # This body alone passes the whole budget (a coded one is found out as it inflates, its
            # Content-Length being the compressed size): a 413, as from Content-Length; no retry helps.
            raise BodyError(413, f"request body exceeds the gateway's limit of {budget} bytes "
                                 f"of waiting bodies {scope}")
        self.broker.hold_bytes(self.session_id, nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        self.broker.release_bytes(self.session_id, nbytes)


def _credential(request: BaseRequest) -> str | None:
    # Anthropic clients send x-api-key, OpenAI clients (and Claude Code with ANTHROPIC_AUTH_TOKEN) a Bearer
    # token.
    token = request.headers.get("x-api-key") or bearer_token(request.headers)
    if token is not None and not valid_token(token):
        # Not UTF-8 (aiohttp's lone surrogates), not ASCII, or too long: no session has such a token
        # (they are checked at creation), and none may be auto-created with it.
        raise StatusError(
            "invalid API key: a session token is visible ASCII (send it exactly as it was given)", status=401)
    return token


class AgentAPI:
    """Handlers for the agent-facing paths of one gateway."""

    def __init__(self, gateway: ServedGateway, limits: HttpLimits) -> None:
        self.gw = gateway
        self.limits = limits

    # -- auth and body ------------------------------------------------------------------------

    def _session(self, request: BaseRequest, sid: str | None) -> Session:
        gw = self.gw
        token = _credential(request)
        if sid is not None:
            session = gw.sessions.find(sid)
            if session is None:
                if gw.config.auto_sessions and token:
                    return self._auto_session(sid, token)
                raise StatusError(f"unknown session {sid!r}: create it with POST /sessions first", status=404)
            if not gw.sessions.token_matches(session, token):
                raise StatusError("invalid or missing API key for this session", status=401)
            return session
        if token is None:
            raise StatusError("missing API key: send the session token as x-api-key or Authorization: Bearer",
                              status=401)
        found = gw.sessions.by_token(token)
        if found is None:
            if gw.config.auto_sessions:
                return self._auto_session(None, token)
            raise StatusError("invalid API key: no session has this token", status=401)
        return found

    def _auto_session(self, sid: str | None, token: str) -> Session:
        try:
            return self.gw.sessions.create(sid, token=token, metadata={"auto": True})
        except InvalidSessionError as exc:
            raise StatusError(str(exc), status=400) from None
        except SessionExistsError:
            # The token is another session's: using it on a new session id is a wrong key here.
            raise StatusError("this API key belongs to another session; use that session's base URL",
                              status=401) from None

    async def _body(
        self, request: BaseRequest, session: Session, held: _Held, protocol: WireProtocol | None
    ) -> tuple[bytes, ParsedBody]:
        """The body's bytes (held in ``held``) and the body parsed (converted in ``protocol``, if given)."""
        budget, scope = body_budget(self.gw.broker)
        length = request.content_length
        if length is not None and length > budget:
            raise StatusError(f"request body of {length} bytes exceeds the gateway's limit of {budget} bytes "
                              f"of waiting bodies {scope}", status=413)
        # A BodyError (413, 408, 415, 400), or a GatewayError (429: the session's waiting bodies would
        # pass its byte budget): the caller answers either with its status.
        raw = await read_body(request, self.limits, held)
        if not raw:
            raise StatusError("request body is empty: send a JSON object", status=400)
        memo = None
        # A small body converts in microseconds: comparing it with the last one would save nothing.
        if protocol is not None and len(raw) >= _REUSE_MIN_BYTES and self.gw.config.parse_reuse:
            memo = session.parse_memo
            if memo is None:
                memo = session.parse_memo = ParseMemo()
        return raw, await self.gw.body_parser.parse(raw, protocol, memo)  # a RequestError names its param

    # -- errors ---------------------------------------------------------------------------------

    @staticmethod
    def in_shape(handler: Handler, protocol: WireProtocol | None = None) -> Handler:
        """``handler`` with every :class:`StatusError` it raises (a missing key, a body that cannot be
        read or used, a request closed unanswered, a policy's error answer) answered here, the one
        place agent errors meet the wire: in the shape of ``protocol`` (``None``: the path's API)."""
        fixed = None if protocol is None else get_adapter(protocol)

        async def shaped(request: BaseRequest, sid: str | None) -> StreamResponse:
            try:
                return await handler(request, sid)
            except StatusError as exc:
                adapter = fixed or get_adapter(render.protocol_for_path(request.path))
                return render.protocol_error(adapter, exc.status, exc.message, exc.param)

        return shaped

    # -- LLM endpoints --------------------------------------------------------------------------

    def completion_handler(self, protocol: WireProtocol, endpoint: str) -> Handler:
        """The handler of one LLM endpoint; its errors are raised (wrap it in :meth:`in_shape`)."""
        adapter = get_adapter(protocol)

        async def handle(request: BaseRequest, sid: str | None) -> StreamResponse:
            gw = self.gw
            try:
                session = self._session(request, sid)
                held = _Held(gw.broker, session.id)
                try:
                    raw, parsed = await self._body(request, session, held, protocol)
                    canonical = parsed.request
                    assert canonical is not None
                    if session.ended:
                        raise StatusError("this session has ended; start a new session", status=409)
                    side_call = gw.is_side_call(session, canonical, request.headers)
                    # A GatewayError: 429, too many parked for this session; 503, closing.
                    parked = gw.broker.park(session.id, canonical, endpoint, side_call=side_call,
                                            raw_body=raw, held_bytes=held.nbytes,
                                            canonical_json=parsed.canonical_json,
                                            encoder=parsed.encoder, layout=parsed.layout)
                    held.nbytes = 0  # the parked request holds them now, until it is answered
                finally:
                    held.release()
            except StatusError as rej:
                gw.metrics.rejected(rej.status)
                raise
            # Withdrawn the moment the client goes, in aiohttp's connection_lost, before the
            # handler's cancellation is even delivered: nothing can answer it after that.
            on_disconnect(request, partial(gw.broker.withdraw, parked, "agent disconnected"))
            if parked.request.stream:
                return await self._stream_when_answered(request, adapter, parked)
            try:
                answer = await gw.broker.wait(parked)  # a RequestClosed: timed out, session closed
            finally:
                on_disconnect(request, None)
            return await self._render(request, adapter, parked, answer)

        return handle

    async def _stream_when_answered(
        self, request: BaseRequest, adapter: ProtocolAdapter, parked: ParkedRequest
    ) -> StreamResponse:
        """Wait for a streaming request's answer; while sampling is paused for a weight update, send the
        agent keep-alives every ``pause_keepalive_seconds`` (the SSE headers go out with the first), so
        its client's read timeout does not fire. Once they started they go on until the answer."""
        gw = self.gw
        fence = gw.fence
        future = parked.future
        resp: StreamResponse | None = None
        try:
            while not future.done():
                if resp is None and not fence.paused:
                    # Sampling: wait for the answer, or for a pause to begin.
                    await asyncio.wait((future, fence.pause_signal()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                done, _ = await asyncio.wait((future,), timeout=gw.config.pause_keepalive_seconds)
                if not done:
                    if resp is None:
                        resp = await render.open_stream(request)
                    await resp.write(render.KEEPALIVE[adapter.protocol])
        except asyncio.CancelledError:
            gw.broker.withdraw(parked, "agent disconnected")
            raise
        finally:
            on_disconnect(request, None)
        try:
            answer = future.result()  # a RequestClosed: timed out, session closed
        except StatusError as exc:
            if resp is None:
                raise
            return await render.stream_error(resp, adapter, parked, exc.status, exc.message)
        return await self._render(request, adapter, parked, answer, resp)

    async def _render(
        self, request: BaseRequest, adapter: ProtocolAdapter, parked: ParkedRequest, answer: Answer,
        resp: StreamResponse | None = None,
    ) -> StreamResponse:
        """The answer as the agent's response; ``resp``: the SSE response of a streaming request whose
        headers went out already (keep-alives were sent while sampling was paused)."""
        idle = self.gw.config.stream_idle_timeout
        if isinstance(answer, ErrorAnswer):
            if resp is not None:
                return await render.stream_error(resp, adapter, parked, answer.status, answer.message)
            raise StatusError(answer.message, status=answer.status)
        if isinstance(answer, StreamAnswer):
            items = aiter(answer.source)
            if parked.request.stream:
                return await render.delta_stream(request, adapter, parked, items, idle, resp)
            return await render.drained(adapter, parked, items, idle)
        if not parked.request.stream:
            return render.whole(adapter, parked, answer)
        completion = answer.completion if isinstance(answer, NativeAnswer) else answer
        return await render.synthesized_stream(request, adapter, parked, completion, resp)

    async def count_tokens(self, request: BaseRequest, sid: str | None) -> Response:
        session = self._session(request, sid)
        held = _Held(self.gw.broker, session.id)
        try:
            _, parsed = await self._body(request, session, held, None)
        finally:
            held.release()
        body = parsed.body
        parse_count_tokens_request(body)
        # An estimate (about 4 characters a token): the gateway has no tokenizer for the policy's model.
        size = len(orjson.dumps([body.get("system"), body["messages"], body.get("tools")]))
        return render.json_response({"input_tokens": max(1, math.ceil(size / 4))})

    async def models(self, request: BaseRequest, sid: str | None) -> Response:
        self._session(request, sid)
        data = [
            {
                "id": m,
                "object": "model",
                "type": "model",
                "created": 0,
                "created_at": "2026-01-01T00:00:00Z",
                "owned_by": "ares-gateway",
                "display_name": m,
            }
            for m in self.gw.config.models
        ]
        return render.json_response(
            {"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"],
             "last_id": data[-1]["id"]}
        )

    async def probe(self, request: BaseRequest, sid: str | None) -> Response:
        # Claude Code sends HEAD <base>/ at start-up, without credentials.
        return render.json_response({"service": "ares-gateway", "status": "ok"})

    async def responses_websocket(self, request: BaseRequest, sid: str | None) -> Response:
        adapter = get_adapter(WireProtocol.OPENAI_RESPONSES)
        # 426 makes Codex's built-in provider fall back to POST /v1/responses.
        resp = render.protocol_error(adapter, 426,
                                     "WebSocket transport is not supported; use POST /v1/responses")
        if request.headers.get("upgrade"):
            resp.force_close()  # what follows an upgrade request is not HTTP
        return resp


__all__ = ["AgentAPI"]
