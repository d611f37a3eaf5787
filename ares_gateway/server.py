"""The gateway's HTTP surface: the agent-facing LLM APIs and the policy-facing control API."""

from __future__ import annotations

import asyncio
import logging
import math
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from ares_gateway._http import Request, Response, StreamResponse
from ares_gateway._routing import Handler, RouteTable
from ares_gateway.broker import (
    Answer,
    ErrorAnswer,
    NativeAnswer,
    ParkedRequest,
    RequestClosed,
    StreamAnswer,
)
from ares_gateway.canonical import Completion, CompletionDelta, TokenRecord, WireProtocol
from ares_gateway.errors import GatewayError, InvalidAnswerError
from ares_gateway.protocols import ProtocolAdapter, RequestError, get_adapter
from ares_gateway.protocols.anthropic_messages import parse_count_tokens_request
from ares_gateway.sessions import Session, bearer_token
from ares_gateway.streaming import DeltaAccumulator

if TYPE_CHECKING:
    from ares_gateway.gateway import Gateway

log = logging.getLogger(__name__)

_JSON = "application/json"
_RESPONSE_ID_PREFIX = {
    WireProtocol.OPENAI_CHAT: "chatcmpl-",
    WireProtocol.ANTHROPIC_MESSAGES: "msg_",
    WireProtocol.OPENAI_RESPONSES: "resp_",
}


def _json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, _JSON, headers)


def _protocol_for_path(path: str) -> WireProtocol:
    if "/messages" in path:
        return WireProtocol.ANTHROPIC_MESSAGES
    if "/responses" in path:
        return WireProtocol.OPENAI_RESPONSES
    return WireProtocol.OPENAI_CHAT


class _Reject(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _response_id(parked: ParkedRequest) -> str:
    """The id of the agent's response: its protocol's prefix on the request's number."""
    return _RESPONSE_ID_PREFIX[parked.protocol] + parked.id.removeprefix("req_")


def _too_large(gateway: Gateway) -> str:
    return f"request body exceeds the gateway's limit of {gateway.config.max_body_bytes} bytes"


def _credential(request: Request) -> str | None:
    # Anthropic clients send x-api-key, OpenAI clients (and Claude Code with ANTHROPIC_AUTH_TOKEN) a Bearer token.
    return request.headers.get("x-api-key") or bearer_token(request.headers)


class _AgentAPI:
    """Handlers for what agents talk to: the three LLM APIs and the probes around them."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    # -- helpers ------------------------------------------------------------------------------

    def _error(self, adapter: ProtocolAdapter, status: int, message: str, param: str | None = None) -> Response:
        headers = {"retry-after": "1"} if status in (429, 503, 529) else None
        return _json_response(adapter.error_body(status, message, param=param), status, headers)

    def _session(self, request: Request, sid: str | None) -> Session:
        gw = self.gw
        token = _credential(request)
        if sid is not None:
            session = gw.sessions.find(sid)
            if session is None:
                if gw.config.auto_sessions and token:
                    return gw._auto_session(sid, token)
                raise _Reject(404, f"unknown session {sid!r}: create it with POST /sessions first")
            if not gw.sessions.token_matches(session, token):
                raise _Reject(401, "invalid or missing API key for this session")
            return session
        if token is None:
            raise _Reject(401, "missing API key: send the session token as x-api-key or Authorization: Bearer")
        found = gw.sessions.by_token(token)
        if found is None:
            if gw.config.auto_sessions:
                return gw._auto_session(None, token)
            raise _Reject(401, "invalid API key: no session has this token")
        return found

    def _body(self, request: Request) -> tuple[bytes, Any]:
        """The body's bytes and its parsed JSON."""
        if request.body_too_large:
            raise _Reject(413, _too_large(self.gw))
        raw = request.body
        if not raw:
            raise _Reject(400, "request body is empty: send a JSON object")
        try:
            return raw, orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _Reject(400, f"request body is not valid JSON: {exc}") from None

    # -- LLM endpoints --------------------------------------------------------------------------

    def completion_handler(self, protocol: WireProtocol, endpoint: str) -> Handler:
        adapter = get_adapter(protocol)

        async def handle(request: Request, sid: str | None) -> Response | StreamResponse:
            gw = self.gw
            try:
                session = self._session(request, sid)
                raw, body = self._body(request)
                try:
                    canonical = adapter.parse_request(body)
                except RequestError as exc:
                    raise _Reject(exc.status, exc.message, exc.param) from None
            except _Reject as rej:
                gw.metrics.rejected(rej.status)
                return self._error(adapter, rej.status, rej.message, rej.param)
            if session.ended:
                return self._error(adapter, 409, "this session has ended; start a new session")
            side_call = gw.is_side_call(session, canonical, request.headers)
            try:
                parked = gw.broker.park(
                    session.id, canonical, endpoint, side_call=side_call, raw_body=raw
                )
            except GatewayError as exc:
                return self._error(adapter, exc.status, str(exc))
            if not canonical.stream:
                parked.deliver = partial(self._send_whole, request, adapter, parked)
            try:
                answer = await gw.broker.wait(parked)
            except RequestClosed as closed:
                return self._error(adapter, closed.status, closed.message)
            session.turns += 1
            if request.sent is not None:  # written from inside the policy's respond()
                return request.sent
            return await self._render(request, adapter, parked, answer)

        return handle

    async def _render(
        self, request: Request, adapter: ProtocolAdapter, parked: ParkedRequest, answer: Answer
    ) -> Response | StreamResponse:
        canonical = parked.request
        rid = _response_id(parked)
        if isinstance(answer, ErrorAnswer):
            return self._error(adapter, answer.status, answer.message)
        if isinstance(answer, StreamAnswer):
            if canonical.stream:
                return await self._stream_deltas(request, adapter, parked, answer, rid)
            try:
                completion = await self._drain(answer)
            except Exception as exc:  # the policy's stream broke: the agent gets a 502 in its shape
                log.warning("policy stream for %s failed: %s", parked.id, exc)
                return self._error(adapter, 502, f"the policy's stream failed: {exc}")
            self.gw.broker.record(parked, completion)
            return self._whole(adapter, parked, completion, rid)
        if not canonical.stream:
            return self._whole(adapter, parked, answer, rid)
        completion = answer.completion if isinstance(answer, NativeAnswer) else answer
        encoder = adapter.stream_encoder(canonical, rid)
        resp = self._sse_response()
        await resp.prepare(request)
        await resp.write(encoder.start() + encoder.finish(completion))
        await resp.write_eof()
        return resp

    def _whole(self, adapter: ProtocolAdapter, parked: ParkedRequest, answer: Answer, rid: str) -> Response:
        """The response to a request that did not ask for a stream, from a whole answer."""
        if isinstance(answer, ErrorAnswer):
            return self._error(adapter, answer.status, answer.message)
        if isinstance(answer, NativeAnswer):
            return _json_response(answer.body)
        assert isinstance(answer, Completion)
        return _json_response(adapter.render_response(answer, parked.request, rid))

    def _send_whole(self, request: Request, adapter: ProtocolAdapter, parked: ParkedRequest, answer: Answer) -> bool:
        """``ParkedRequest.deliver``: write the agent's answer from inside ``respond()`` (not a
        streamed answer: draining that needs the handler's task)."""
        if isinstance(answer, StreamAnswer):
            return False
        rid = _response_id(parked)
        return request.send(self._whole(adapter, parked, answer, rid))

    @staticmethod
    def _sse_response() -> StreamResponse:
        return StreamResponse(200, {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"})

    async def _drain(self, answer: StreamAnswer) -> Completion:
        acc = DeltaAccumulator()
        final: Completion | None = None
        async for item in answer.source:
            if isinstance(item, Completion):
                final = item
            else:
                acc.add(item)
        return acc.settle(final)

    async def _stream_deltas(
        self, request: Request, adapter: ProtocolAdapter, parked: ParkedRequest, answer: StreamAnswer, rid: str
    ) -> Response | StreamResponse:
        encoder = adapter.stream_encoder(parked.request, rid)
        resp = self._sse_response()
        await resp.prepare(request)
        await resp.write(encoder.start())
        acc = DeltaAccumulator()
        source = answer.source
        final: Completion | None = None
        try:
            async for item in source:
                if isinstance(item, Completion):
                    final = item
                    break
                if isinstance(item, CompletionDelta):
                    acc.add(item)
                    await resp.write(encoder.feed(item))
            final = acc.settle(final)
            await resp.write(encoder.finish(final))
            self.gw.broker.record(parked, final)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the policy's stream broke: end the agent's stream with an error event
            log.warning("policy stream for %s failed: %s", parked.id, exc)
            await resp.write(encoder.error(502, f"the policy's stream failed: {exc}"))
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: Request, sid: str | None) -> Response:
        adapter = get_adapter(WireProtocol.ANTHROPIC_MESSAGES)
        try:
            self._session(request, sid)
            _, body = self._body(request)
            try:
                parse_count_tokens_request(body)
            except RequestError as exc:
                raise _Reject(exc.status, exc.message, exc.param) from None
        except _Reject as rej:
            return self._error(adapter, rej.status, rej.message, rej.param)
        # An estimate (about 4 characters a token): the gateway has no tokenizer for the policy's model.
        size = len(orjson.dumps([body.get("system"), body["messages"], body.get("tools")]))
        return _json_response({"input_tokens": max(1, math.ceil(size / 4))})

    async def models(self, request: Request, sid: str | None) -> Response:
        adapter = get_adapter(_protocol_for_path(request.path))
        try:
            self._session(request, sid)
        except _Reject as rej:
            return self._error(adapter, rej.status, rej.message)
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
        return _json_response(
            {"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}
        )

    async def probe(self, request: Request, sid: str | None) -> Response:
        # Claude Code sends HEAD <base>/ at start-up, without credentials.
        return _json_response({"service": "ares-gateway", "status": "ok"})

    async def responses_websocket(self, request: Request, sid: str | None) -> Response:
        adapter = get_adapter(WireProtocol.OPENAI_RESPONSES)
        # 426 makes Codex's built-in provider fall back to POST /v1/responses.
        return self._error(adapter, 426, "WebSocket transport is not supported; use POST /v1/responses")


class _ControlAPI:
    """Handlers for the trainer / policy side: sessions, /poll, /respond, health and metrics."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def poll(self, request: Request, sid: str | None) -> Response:
        q = request.query
        try:
            wait = float(q.get("wait", "0"))
            max_items = int(q.get("max", "100"))
            lease = float(q["lease"]) if "lease" in q else -1.0
        except ValueError:
            return _control_error(400, "wait and lease must be numbers of seconds, max an integer")
        if not (0 <= wait <= 3600) or not (1 <= max_items <= 10_000) or (lease != -1.0 and not 0 < lease <= 86_400):
            return _control_error(400, "wait must be 0..3600 s, max 1..10000, lease 0..86400 s")
        with_canonical = q.get("canonical", "1") not in ("0", "false", "no")
        session = q.get("session") or None
        if session is not None and self.gw.sessions.find(session) is None:
            return _control_error(404, f"no session {session!r}")
        try:
            items = await self.gw.broker.poll(session, max_items=max_items, wait=wait, lease=lease)
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))
        return Response(b"[" + b",".join(p.poll_json(canonical=with_canonical) for p in items) + b"]")

    async def respond(self, request: Request, sid: str | None) -> Response:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            return _control_error(400, f"body is not valid JSON: {exc}")
        if isinstance(body, list):
            results = [self._respond_one(item) for item in body]
            return _json_response([r for _, r in results])
        status, result = self._respond_one(body)
        return _json_response(result, status)

    def _respond_one(self, item: Any) -> tuple[int, dict[str, Any]]:
        rid = item.get("id") if isinstance(item, dict) else None
        try:
            if not isinstance(rid, str):
                raise InvalidAnswerError('each answer needs "id" (a string, as /poll returned it)')
            answer, tokens = _parse_answer(item)
            self.gw.broker.respond(rid, answer, tokens=tokens)
        except GatewayError as exc:
            return exc.status, {"id": rid, "status": "error", "code": exc.status, "error": str(exc)}
        return 200, {"id": rid, "status": "ok"}

    async def create_session(self, request: Request, sid: str | None) -> Response:
        body: Any = {}
        if request.can_read_body:
            try:
                body = orjson.loads(request.body or b"{}")
            except orjson.JSONDecodeError as exc:
                return _control_error(400, f"body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _control_error(400, "body must be a JSON object")
        try:
            info = self.gw.create_session_sync(
                session_id=body.get("session_id"), metadata=body.get("metadata"), token=body.get("token")
            )
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))
        except (ValueError, TypeError) as exc:
            return _control_error(400, str(exc))
        return _json_response(info.to_dict(), 201)

    async def list_sessions(self, request: Request, sid: str | None) -> Response:
        return _json_response([self.gw.session_summary(s.id) for s in self.gw.sessions])

    async def get_session(self, request: Request, sid: str | None) -> Response:
        assert sid is not None
        try:
            return _json_response(self.gw.session_summary(sid))
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))

    async def delete_session(self, request: Request, sid: str | None) -> Response:
        assert sid is not None
        try:
            cancelled = self.gw.delete_session_sync(sid)
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))
        return _json_response({"status": "ok", "cancelled": cancelled})

    async def end_session(self, request: Request, sid: str | None) -> Response:
        assert sid is not None
        try:
            body = orjson.loads(request.body or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            reward = body.get("reward")
            if reward is not None and not isinstance(reward, int | float):
                raise ValueError("reward must be a number")
            self.gw.end_session(
                sid, reward=reward, truncated=bool(body.get("truncated", False))
            )
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))
        except (ValueError, orjson.JSONDecodeError) as exc:
            return _control_error(400, str(exc))
        return _json_response({"status": "ok"})

    async def trajectory(self, request: Request, sid: str | None) -> Response:
        assert sid is not None
        q = request.query
        try:
            reward = float(q.get("reward", "nan"))
            max_tokens = int(q.get("max_sample_tokens", "0"))
        except ValueError:
            return _control_error(400, "reward must be a number and max_sample_tokens an integer")
        try:
            samples = self.gw.trajectory(
                sid, reward=None if math.isnan(reward) else reward, max_sample_tokens=max_tokens
            )
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))
        return _json_response([s.to_dict() for s in samples])

    async def turns(self, request: Request, sid: str | None) -> Response:
        assert sid is not None
        try:
            turns = self.gw.turn_log(sid)
        except GatewayError as exc:
            return _control_error(exc.status, str(exc))
        return _json_response(turns)

    async def healthz(self, request: Request, sid: str | None) -> Response:
        return _json_response({"status": "ok", "sessions": len(self.gw.sessions), "parked": self.gw.broker.pending_count})

    async def metrics(self, request: Request, sid: str | None) -> Response:
        body = self.gw.metrics.render(self.gw.broker.pending_count)
        return Response(body, content_type="text/plain; version=0.0.4; charset=utf-8")


def _control_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json_response({"status": "error", "code": status, "error": message}, status, headers)


def _parse_answer(item: dict[str, Any]) -> tuple[Answer | dict[str, Any], dict[str, Any] | None]:
    kinds = [k for k in ("completion", "response", "error") if k in item]
    if len(kinds) != 1:
        raise InvalidAnswerError('give exactly one of "completion", "response" or "error" with each answer')
    tokens = item.get("tokens")
    if tokens is not None and not isinstance(tokens, dict):
        raise InvalidAnswerError('"tokens" must be an object with prompt_ids, output_ids, output_logprobs')
    kind = kinds[0]
    value = item[kind]
    if kind == "error":
        if not isinstance(value, dict):
            raise InvalidAnswerError('"error" must be an object {"status", "message"}')
        status = value.get("status", 500)
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise InvalidAnswerError('"error.status" must be an HTTP error status (400-599)')
        return ErrorAnswer(status, str(value.get("message", "error"))), tokens
    if not isinstance(value, dict):
        raise InvalidAnswerError(f'"{kind}" must be a JSON object')
    if kind == "completion":
        try:
            completion = Completion.model_validate(value)
        except ValidationError as exc:
            raise InvalidAnswerError(f"invalid completion: {exc}") from None
        if tokens is not None:
            try:
                record = TokenRecord.model_validate(tokens)
            except ValidationError as exc:
                raise InvalidAnswerError(f"invalid tokens: {exc}") from None
            completion = completion.model_copy(update={"tokens": record})
        return completion, None
    return value, tokens


def error_response(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error in the shape of the API the request's path belongs to (an LLM API's, or the control API's)."""
    path = request.path
    if path.startswith(("/v1", "/s/")) or "/v1/" in path:
        adapter = get_adapter(_protocol_for_path(path))
        return _json_response(adapter.error_body(status, message), status, headers)
    return _control_error(status, message, headers)


async def _not_routed(request: Request, allowed: frozenset[str]) -> Response:
    """Unknown paths (404) and wrong methods (405), in the shape of the API the client speaks."""
    status, reason = (405, "Method Not Allowed") if allowed else (404, "Not Found")
    headers = {"allow": ",".join(sorted(allowed))} if allowed else None
    return error_response(request, status, f"{reason}: {request.method} {request.path}", headers)


def build_routes(gateway: Gateway) -> RouteTable:
    """The whole HTTP surface of one gateway: the handler of its :class:`~ares_gateway._http.HttpServer`."""
    agent = _AgentAPI(gateway)
    control = _ControlAPI(gateway)
    routes = RouteTable(fallback=_not_routed)
    # Agent paths: at the root and under /s/{sid} (the session's base URL).
    for path, protocol in (
        ("/v1/chat/completions", WireProtocol.OPENAI_CHAT),
        ("/chat/completions", WireProtocol.OPENAI_CHAT),
        ("/v1/messages", WireProtocol.ANTHROPIC_MESSAGES),
        ("/v1/responses", WireProtocol.OPENAI_RESPONSES),
        ("/responses", WireProtocol.OPENAI_RESPONSES),
    ):
        routes.add_agent("POST", path, agent.completion_handler(protocol, path))
    routes.add_agent("POST", "/v1/messages/count_tokens", agent.count_tokens)
    routes.add_agent("GET", "/v1/models", agent.models)
    routes.add_agent("GET", "/models", agent.models)
    routes.add_agent("GET", "/v1/responses", agent.responses_websocket)
    # Claude Code probes HEAD <base>/ at start-up.
    routes.add_agent("GET,HEAD", "", agent.probe)
    routes.add_agent("GET,HEAD", "/", agent.probe)
    # Control paths (the admin token guards all but /healthz).
    routes.add_control("GET,HEAD", "/healthz", control.healthz)
    guard = partial(_admin_only, gateway)
    routes.add_control("GET", "/poll", guard(control.poll))  # not HEAD: polling leases items
    routes.add_control("POST", "/respond", guard(control.respond))
    routes.add_control("POST", "/sessions", guard(control.create_session))
    routes.add_control("GET,HEAD", "/sessions", guard(control.list_sessions))
    routes.add_control("GET,HEAD", "/metrics", guard(control.metrics))
    routes.add_session("GET,HEAD", "", guard(control.get_session))
    routes.add_session("DELETE", "", guard(control.delete_session))
    routes.add_session("POST", "/end", guard(control.end_session))
    routes.add_session("GET,HEAD", "/trajectory", guard(control.trajectory))
    routes.add_session("GET,HEAD", "/turns", guard(control.turns))
    return routes


def _admin_only(gateway: Gateway, handler: Handler) -> Handler:
    async def guarded(request: Request, sid: str | None) -> Response | StreamResponse:
        if gateway.config.admin_token and not gateway._admin_ok(request.headers):
            return _control_error(401, "missing or wrong admin token: send Authorization: Bearer <admin token>")
        if request.body_too_large:
            return _control_error(413, _too_large(gateway))
        return await handler(request, sid)

    return guarded


__all__ = ["build_routes", "error_response"]
