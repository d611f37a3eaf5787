"""What the trainer / policy side talks to: sessions, ``/poll``, ``/respond``, the policy version, health
and metrics."""

from __future__ import annotations

import logging
import math
from typing import Any

import orjson
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import Response, StreamResponse
from pydantic import ValidationError

from ares_gateway.core.answers import Answer, ErrorAnswer
from ares_gateway.core.broker import UNENCODABLE_REQUEST
from ares_gateway.core.canonical import Completion, read_policy_version
from ares_gateway.core.errors import GatewayError, InvalidAnswerError, StatusError
from ares_gateway.http.render import control_error, json_response
from ares_gateway.http.routes import Handler
from ares_gateway.http.served import ServedGateway
from ares_gateway.http.server import HttpLimits, read_body

log = logging.getLogger(__name__)

#: A ``/poll`` piece this large (an agent's body) is written to the socket by itself, never copied.
_SENT_AS_IS = 32 * 1024
_JSON = {"Content-Type": "application/json"}


class ControlAPI:
    """Handlers for the policy-facing paths of one gateway (all but /healthz behind :meth:`guard`)."""

    def __init__(self, gateway: ServedGateway, limits: HttpLimits) -> None:
        self.gw = gateway
        self.limits = limits

    def guard(self, handler: Handler) -> Handler:
        """Require the admin token (every gateway has one), and answer what the handler raises: every
        :class:`StatusError` of the control API (a bad query or body, a body that cannot be read, a
        gateway outcome such as an unknown session) meets the wire here, in the control API's shape."""
        gw = self.gw

        async def guarded(request: BaseRequest, sid: str | None) -> StreamResponse:
            if not gw.admin_ok(request.headers):
                return control_error(401,
                                     "missing or wrong admin token: send Authorization: Bearer <admin token>")
            try:
                return await handler(request, sid)
            except StatusError as exc:
                return control_error(exc.status, exc.message)

        return guarded

    async def _json(self, request: BaseRequest, default: Any = None) -> Any:
        raw = await read_body(request, self.limits)  # a BodyError: its status
        if not raw:
            if default is None:
                raise StatusError("request body is empty: send JSON", status=400)
            return default
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise StatusError(f"body is not valid JSON: {exc}", status=400) from None

    async def poll(self, request: BaseRequest, sid: str | None) -> StreamResponse:
        q = request.query
        try:
            wait = float(q.get("wait", "0"))
            max_items = int(q.get("max", "100"))
            lease = float(q["lease"]) if "lease" in q else -1.0
        except ValueError:
            raise StatusError("wait and lease must be numbers of seconds, max an integer",
                              status=400) from None
        if (not (0 <= wait <= 3600) or not (1 <= max_items <= 10_000)
            or (lease != -1.0 and not 0 < lease <= 86_400)):
            raise StatusError("wait must be 0..3600 s, max 1..10000, lease 0..86400 s", status=400)
        with_canonical = q.get("canonical", "1") not in ("0", "false", "no")
        session = q.get("session") or None
        if session is not None and self.gw.sessions.find(session) is None:
            raise StatusError(f"no session {session!r}", status=404)
        items = await self.gw.broker.poll(session, max_items=max_items, wait=wait, lease=lease)
        parts = [b"["]
        for p in items:
            try:
                item = p.poll_parts(canonical=with_canonical)
            except (orjson.JSONEncodeError, RecursionError, ValueError, TypeError) as exc:
                # A body the encoder cannot hand on (nested past orjson's 255 levels in a free-form
                # field): one agent's request must not fail every poller's batch. Its agent gets a 400.
                self._refuse_unpollable(p.id, exc)
                continue
            if len(parts) > 1:
                parts.append(b",")
            parts += item
        parts.append(b"]")
        # A batch of Claude-Code-sized bodies is megabytes: joined, it would be a fresh allocation
        # of that size each poll, every page of it faulted in, copied into, then unmapped. The
        # agents' bodies (the bytes as they came) go to the socket as they are instead, and only the
        # small pieces between them are joined.
        chunks: list[bytes] = []
        run: list[bytes] = []
        for part in parts:
            if len(part) < _SENT_AS_IS:
                run.append(part)
                continue
            if run:
                chunks.append(b"".join(run))
                run = []
            chunks.append(part)
        if run:
            chunks.append(b"".join(run))
        if len(chunks) == 1:
            return Response(body=chunks[0], headers=_JSON)
        resp = StreamResponse(headers=_JSON)
        resp.content_length = sum(map(len, chunks))
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    def _refuse_unpollable(self, rid: str, exc: Exception) -> None:
        log.warning("request %s cannot be encoded for /poll (%s): answered with 400", rid, type(exc).__name__)
        try:
            self.gw.answer(rid, ErrorAnswer(400, UNENCODABLE_REQUEST))
        except GatewayError:  # gone meanwhile (the agent disconnected): nothing to answer
            pass

    async def respond(self, request: BaseRequest, sid: str | None) -> Response:
        body = await self._json(request)
        if isinstance(body, list):
            # Each answer succeeds or fails on its own; the batch as a whole is a 200.
            results = [self._respond_one(item)[1] for item in body]
            status = 200
        else:
            status, one = self._respond_one(body)
            results = [one]
        if any(r["status"] == "ok" for r in results) and self.gw.config.wait_durable:
            # A 200 means the answered turns are committed to the data dir.
            try:
                await self.gw.durable()
            except GatewayError as exc:
                raise StatusError(f"answered, but recording the turn failed: {exc}",
                                  status=exc.status) from None
        return json_response(results if isinstance(body, list) else results[0], status)

    def _respond_one(self, item: Any) -> tuple[int, dict[str, Any]]:
        rid = item.get("id") if isinstance(item, dict) else None
        try:
            if not isinstance(rid, str):
                raise InvalidAnswerError('each answer needs "id" (a string, as /poll returned it)')
            answer, tokens = _parse_answer(item)
            attempt = item.get("attempt")
            if attempt is not None:
                if isinstance(attempt, bool) or not isinstance(attempt, int):
                    raise InvalidAnswerError('"attempt" must be an integer, as /poll returned it')
                self.gw.broker.check_attempt(rid, attempt)
            # Checked before the request is looked up (a 400 whatever became of it), as the tokens are.
            version = read_policy_version(item.get("policy_version"))
            self.gw.answer(rid, answer, tokens=tokens, policy_version=version)
        except GatewayError as exc:
            return exc.status, {"id": rid, "status": "error", "code": exc.status, "error": str(exc)}
        except (ValueError, TypeError) as exc:  # an answer no check above caught: still this item's 400
            return 400, {"id": rid, "status": "error", "code": 400, "error": f"invalid answer: {exc}"}
        return 200, {"id": rid, "status": "ok"}

    async def get_policy_version(self, request: BaseRequest, sid: str | None) -> Response:
        return json_response({"version": self.gw.policy_version})

    async def set_policy_version(self, request: BaseRequest, sid: str | None) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict) or "version" not in body:
            raise StatusError('body must be a JSON object {"version": N}, N a non-negative integer',
                              status=400)
        self.gw.set_policy_version(body["version"])  # 400 for a bad version, 409 for one going back
        return json_response({"version": self.gw.policy_version})

    async def create_session(self, request: BaseRequest, sid: str | None) -> Response:
        body = await self._json(request, default={})
        if not isinstance(body, dict):
            raise StatusError("body must be a JSON object", status=400)
        info = await self.gw.create_session(
            session_id=body.get("session_id"), metadata=body.get("metadata"), token=body.get("token")
        )
        return json_response(info.to_dict(), 201)

    async def list_sessions(self, request: BaseRequest, sid: str | None) -> Response:
        return json_response([self.gw.session_summary(s.id) for s in self.gw.sessions])

    async def get_session(self, request: BaseRequest, sid: str | None) -> Response:
        assert sid is not None
        return json_response(self.gw.session_summary(sid))

    async def delete_session(self, request: BaseRequest, sid: str | None) -> Response:
        assert sid is not None
        cancelled = await self.gw.delete_session(sid)
        return json_response({"status": "ok", "cancelled": cancelled})

    async def end_session(self, request: BaseRequest, sid: str | None) -> Response:
        assert sid is not None
        body = await self._json(request, default={})
        if not isinstance(body, dict):
            raise StatusError("body must be a JSON object", status=400)
        reward = body.get("reward")
        # Strictly JSON types: a bool is not a reward, and "no" is not false.
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise StatusError('"reward" must be a JSON number (or null)', status=400)
        truncated = body.get("truncated", False)
        if not isinstance(truncated, bool):
            raise StatusError('"truncated" must be true or false', status=400)
        await self.gw.end_session(sid, reward=reward, truncated=truncated)
        return json_response({"status": "ok"})

    async def trajectory(self, request: BaseRequest, sid: str | None) -> Response:
        assert sid is not None
        q = request.query
        try:
            reward = float(q.get("reward", "nan"))
            max_tokens = int(q.get("max_sample_tokens", "0"))
        except ValueError:
            raise StatusError("reward must be a number and max_sample_tokens an integer",
                              status=400) from None
        samples = self.gw.trajectory(sid, reward=None if math.isnan(reward) else reward,
                                     max_sample_tokens=max_tokens)
        return json_response([s.to_dict() for s in samples])

    async def turns(self, request: BaseRequest, sid: str | None) -> Response:
        assert sid is not None
        with_tokens = request.query.get("tokens", "1") not in ("0", "false", "no")
        turns = self.gw.turn_log(sid, tokens=with_tokens)
        return json_response(turns)

    async def sampling_state(self, request: BaseRequest, sid: str | None) -> Response:
        return json_response(self.gw.fence.snapshot())

    async def pause_sampling(self, request: BaseRequest, sid: str | None) -> Response:
        body = await self._json(request, default={})
        if not isinstance(body, dict):
            raise StatusError('body must be a JSON object: {"mode": "drain" | "abort", "timeout": seconds}',
                              status=400)
        unknown = sorted(set(body) - {"mode", "timeout"})
        if unknown:
            raise StatusError(f"unknown field(s) {unknown}: give \"mode\" and \"timeout\" only", status=400)
        mode = body.get("mode", "drain")
        if not isinstance(mode, str):
            raise StatusError('"mode" must be "drain" or "abort"', status=400)
        report = await self.gw.pause_sampling(mode, timeout=body.get("timeout"))
        return json_response({"status": "paused", **report.to_dict()})

    async def resume_sampling(self, request: BaseRequest, sid: str | None) -> Response:
        body = await self._json(request, default={})
        if not isinstance(body, dict):
            raise StatusError('body must be a JSON object: {"version": N}', status=400)
        unknown = sorted(set(body) - {"version"})
        if unknown:
            raise StatusError(f"unknown field(s) {unknown}: give \"version\" only", status=400)
        paused_for = self.gw.resume_sampling(body.get("version"))
        return json_response({"status": "sampling", "paused_seconds": paused_for,
                              "policy_version": self.gw.policy_version})

    async def healthz(self, request: BaseRequest, sid: str | None) -> Response:
        return json_response(
            {"status": "ok", "sessions": len(self.gw.sessions), "parked": self.gw.broker.pending_count})

    async def metrics(self, request: BaseRequest, sid: str | None) -> Response:
        body = self.gw.metrics.render(self.gw.broker.pending_count)
        return Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _parse_answer(item: dict[str, Any]) -> tuple[Answer | dict[str, Any], Any]:
    """The answer and the token ids of one ``/respond`` item, as sent: the gateway reads both (once)."""
    kinds = [k for k in ("completion", "response", "error") if k in item]
    if len(kinds) != 1:
        raise InvalidAnswerError('give exactly one of "completion", "response" or "error" with each answer')
    # prompt_ids / output_ids: a JSON list of ints or base64 of little-endian int32 (read by coerce_answer).
    tokens = item.get("tokens")
    kind = kinds[0]
    value = item[kind]
    if kind == "error":
        if not isinstance(value, dict):
            raise InvalidAnswerError('"error" must be an object {"status", "message"}')
        status = value.get("status", 500)
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            raise InvalidAnswerError('"error.status" must be an HTTP error status (400-599)')
        return ErrorAnswer(status, str(value.get("message", "error"))), tokens
    if not isinstance(value, dict):
        raise InvalidAnswerError(f'"{kind}" must be a JSON object')
    if kind == "completion":
        try:
            completion = Completion.model_validate(value)
        except ValidationError as exc:
            raise InvalidAnswerError(f"invalid completion: {exc}") from None
        return completion, tokens
    return value, tokens


__all__ = ["ControlAPI"]
