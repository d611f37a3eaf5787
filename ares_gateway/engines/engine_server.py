"""Serve an in-process :class:`~ares_gateway.engines.base.Engine` over HTTP, as SGLang's native ``/generate``.

Any engine (the trainer's live :class:`~ares_gateway.engines.transformers.TransformersEngine`, the
llama.cpp one) becomes reachable from other processes and machines with the existing
:class:`~ares_gateway.engines.sglang.SGLangEngine` client: a Ray actor on another node samples the
trainer's weights by ``SGLangEngine(url=server.url)``.

::

    server = EngineServer(engine, host="127.0.0.1", port=0, api_key=token)
    await server.start()
    remote = SGLangEngine(server.url, headers={"Authorization": f"Bearer {token}"})
    ...
    await server.close()

**The protocol** is what :class:`SGLangEngine` sends and parses (SGLang's ``GenerateReqInput``):
``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens`` (default 128, as
SGLang), ``temperature``, ``top_p``, ``top_k`` (-1 or 0: off), ``stop_token_ids``, ``sampling_seed``),
``return_logprob``, ``logprob_start_len`` (-1: no input logprobs), ``stream``, ``rid``. The answer is
``{"output_ids", "meta_info": {"id", "finish_reason": {"type": "stop", "matched": id} | {"type":
"length", "length": n}, "prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs":
[[logprob, id, null], ...], "e2e_latency", "sampling_seed"}}``; ``"sampling_seed"`` is the seed the
engine sampled with (drawn when the request set none; SGLang itself does not send it), and
``"weight_version"`` (SGLang's key) the engine's weight version as a decimal string, when its result has one.
Streaming
answers are server-sent events, one per sampled token, cumulative like SGLang's default (or incremental:
``incremental_streaming=True``, SGLang's ``--incremental-streaming-output``), the last one carrying the
finish reason, then ``data: [DONE]``. ``GET /health`` and ``GET /get_model_info`` answer as SGLang's.

Not served (a request for them is a 400, not silently ignored): text prompts (the server has no
tokenizer: the gateway renders), batches, input-token and top-k logprobs, and sampling options the
engine does not implement (penalties, ``min_p``, string stops, constrained decoding), unless set to
their neutral value. A request that breaks the schema is a 400 JSON error (``{"error": {"message",
"type"}}``): a body that is not a JSON object, nests objects or arrays deeper than
:data:`~ares_gateway.core.wire.MAX_JSON_DEPTH` levels (as the gateway's), holds a token id outside the
vocabulary, or sets a sampling value out of range (``temperature`` a finite number in ``[0,``
:data:`MAX_TEMPERATURE` ``]``, ``top_p`` in ``(0, 1]``, ``top_k`` -1, 0 or at least 1, ``max_new_tokens``
from 1 to the server's ``max_new_tokens``: a request past that cap is refused, never cut short
silently). An oversized body is a 413, a prompt longer than the engine's context a 400 (as SGLang),
any bad credential (none, another scheme, a wrong token, bytes that are not UTF-8) a 401 and never a
traceback in the log, too many requests at once a 503 (the client retries), and an engine failure a
500. Once a stream has started, an engine failure ends it with a last event whose
``finish_reason`` is ``{"type": "abort", "message": ...}`` (the client raises it).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from ares_gateway.core.sessions import bearer_token, same_secret
from ares_gateway.core.wire import MAX_JSON_DEPTH, nests_deeper
from ares_gateway.engines.base import (
    Engine,
    EngineError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)

log = logging.getLogger(__name__)

__all__ = ["EngineServer", "GenerateRequest", "RequestError", "parse_generate_request"]

#: SGLang's default ``max_new_tokens`` when a request sets none.
DEFAULT_MAX_NEW_TOKENS = 128
#: The most new tokens one request may ask for, by default (:class:`EngineServer`'s ``max_new_tokens``).
MAX_NEW_TOKENS_CAP = 32768
#: The highest ``temperature`` served: far past the point where sampling is uniform over the vocabulary.
MAX_TEMPERATURE = 100.0
#: The largest ``top_k`` taken (past the vocabulary size it means "off"); bounds what reaches the engine.
MAX_TOP_K = 2**31 - 1
_DEPTH_ERROR = (f"the body nests objects or arrays deeper than {MAX_JSON_DEPTH} levels: a /generate body "
                "is a flat object of token ids and sampling values")

# Sampling options the client sends that do not change what is sampled (the server returns ids).
_IGNORED_SAMPLING = frozenset({"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"})
# Sampling options the engines do not implement, accepted only at SGLang's neutral value.
_NEUTRAL_SAMPLING: Mapping[str, Any] = {
    "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "n": 1, "ignore_eos": False, "stop": None, "stop_regex": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None,
}
# Top-level request keys without meaning here, accepted when empty / false (SGLang clients may send them).
_IGNORED_TOP = frozenset(
    {"return_text_in_logprobs", "return_hidden_states", "log_metrics", "data_parallel_rank",
     "custom_logit_processor", "lora_path", "session_params", "bootstrap_host",
     "bootstrap_port", "bootstrap_room", "token_ids_logprob", "image_data", "audio_data",
     "video_data", "modalities", "input_embeds", "return_routed_experts"})


class RequestError(ValueError):
    """A ``/generate`` body that does not follow the protocol; the message says what to fix."""


class GenerateRequest:
    """One parsed ``/generate`` request: prompt ids, sampling, streaming, logprobs, request id."""

    __slots__ = ("prompt_ids", "return_logprob", "rid", "sampling", "stream")

    def __init__(self, prompt_ids: list[int], sampling: Sampling, *, stream: bool, return_logprob: bool,
                 rid: str) -> None:
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.stream = stream
        self.return_logprob = return_logprob
        self.rid = rid


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _shown(value: Any) -> str:
    """``repr(value)``, cut short: an error message never echoes a megabyte of the request back."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _neutral(value: Any, neutral: Any) -> bool:
    return value is None or value == neutral or value in ((), [], {}, "", False)


def parse_generate_request(body: Any, *, vocab_size: int | None = None,
                           max_new_tokens: int = MAX_NEW_TOKENS_CAP) -> GenerateRequest:
    """Validate a decoded ``/generate`` body (see the module docstring); raises :class:`RequestError`.

    ``max_new_tokens`` is the most new tokens a request may ask for (more: a :class:`RequestError`).
    """
    if nests_deeper(body):
        raise RequestError(_DEPTH_ERROR)
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    if body.get("text") is not None:
        raise RequestError("this server takes token ids (input_ids), not text: it has no tokenizer")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids must be a non-empty list of token ids")
    if any(isinstance(x, list) for x in ids):
        raise RequestError("batched input_ids (a list of lists) are not served: send one prompt per request")
    for i, t in enumerate(ids):
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise RequestError(f"input_ids[{i}] is {_shown(t)}: token ids are integers >= 0{bound}")
    for key, value in body.items():
        if key in ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "stream",
                   "rid", "top_logprobs_num"):
            continue
        if key not in _IGNORED_TOP or not _neutral(value, None):
            raise RequestError(f"{_shown(key)} is not supported by this server")
    if body.get("top_logprobs_num") not in (None, 0):
        raise RequestError(
            "top_logprobs_num is not supported: only the sampled tokens' logprobs are returned")
    start = body.get("logprob_start_len", -1)
    if start is not None and (not _is_int(start) or start != -1):
        raise RequestError("logprob_start_len must be -1: input-token logprobs are not served")
    for key in ("stream", "return_logprob"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"{key} must be true or false, got {_shown(body[key])}")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"rid must be a string, got {type(rid).__name__}")
    return GenerateRequest(list(ids), _sampling(body.get("sampling_params"), vocab_size, max_new_tokens),
                           stream=bool(body.get("stream")), return_logprob=bool(body.get("return_logprob")),
                           rid=rid or uuid.uuid4().hex)


def _sampling(sp: Any, vocab_size: int | None, cap: int) -> Sampling:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError(f"sampling_params must be an object, got {type(sp).__name__}")
    for key, value in sp.items():
        if key in ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed"):
            continue
        if key in _IGNORED_SAMPLING:
            continue
        if key not in _NEUTRAL_SAMPLING:
            raise RequestError(f"sampling_params.{key[:80]} is not supported by this server")
        if not _neutral(value, _NEUTRAL_SAMPLING[key]):
            raise RequestError(f"sampling_params.{key}={_shown(value)} is not supported by this server (only "
                               f"{_NEUTRAL_SAMPLING[key]!r}, its neutral value)")

    def number(key: str, default: float, low: float, high: float, low_open: bool, what: str) -> float:
        v = sp.get(key)
        if v is None:
            return default
        try:
            f = float(v) if _is_number(v) else math.nan
        except OverflowError:  # an integer too large for a float (a Python caller's; JSON brings none)
            f = math.nan
        # NaN and the infinities fail every check below (the engine would sample garbage with them).
        if not (math.isfinite(f) and (f > low if low_open else f >= low) and f <= high):
            raise RequestError(f"sampling_params.{key} must be {what}, got {_shown(v)}")
        return f

    max_new = sp.get("max_new_tokens")
    if max_new is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, cap)
    if not _is_int(max_new) or max_new < 1:
        raise RequestError(f"sampling_params.max_new_tokens must be an integer >= 1, got {_shown(max_new)}")
    if max_new > cap:
        raise RequestError(
            f"sampling_params.max_new_tokens is {max_new}, more than this server's limit of {cap}: "
            "ask for fewer (or start the EngineServer with a larger max_new_tokens)")
    top_k = sp.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    if not _is_int(top_k) or not 0 <= top_k <= MAX_TOP_K:
        raise RequestError(
            f"sampling_params.top_k must be -1 or 0 (off) or an integer from 1 to {MAX_TOP_K}, "
            f"got {_shown(sp.get('top_k'))}")
    seed = sp.get("sampling_seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise RequestError(
            f"sampling_params.sampling_seed must be an integer in [0, 2**63), got {_shown(seed)}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) and t >= 0 for t in stops):
        raise RequestError("sampling_params.stop_token_ids must be a list of token ids")
    if vocab_size is not None and any(t >= vocab_size for t in stops):
        raise RequestError(f"sampling_params.stop_token_ids must be below the vocabulary size {vocab_size}")
    try:
        return Sampling(max_tokens=int(max_new),
                        temperature=number("temperature", 1.0, 0.0, MAX_TEMPERATURE, False,
                                           f"a number from 0 (greedy) to {MAX_TEMPERATURE:g}"),
                        top_p=number("top_p", 1.0, 0.0, 1.0, True, "a number in (0, 1]"),
                        top_k=int(top_k), seed=seed, stop_token_ids=tuple(stops))
    except ValueError as exc:  # Sampling's own range checks
        raise RequestError(f"sampling_params: {exc}") from None


def vocab_size_of(engine: Any) -> int | None:
    """The engine's vocabulary size where it can tell (bounds the ids a request may send), else ``None``."""
    module = getattr(engine, "module", None)  # TransformersEngine: the torch model
    if module is not None:
        emb = getattr(module, "get_input_embeddings", None)
        layer = emb() if callable(emb) else None
        n = getattr(layer, "num_embeddings", None)
        if isinstance(n, int):
            return n
        n = getattr(getattr(module, "config", None), "vocab_size", None)
        return n if isinstance(n, int) else None
    llm = getattr(engine, "_llm", None)  # LlamaCppEngine once loaded
    if llm is not None and callable(getattr(llm, "n_vocab", None)):
        return int(llm.n_vocab())
    return None


def _finish(result: GenerateResult) -> dict[str, Any]:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.output_ids[-1] if result.output_ids else None}
    return {"type": "length", "length": len(result.output_ids)}


class EngineServer:
    """Serves ``engine`` on ``host:port`` as SGLang's ``/generate`` (see the module docstring).

    Args:
        engine: an in-process engine; the server never closes it (its owner does).
        host: the address to listen on. ``127.0.0.1`` (default) reaches this machine's processes only; on a
            cluster give this machine's address that the other nodes reach (it is also :attr:`url`'s host).
        port: the port (0: a free one, read it from :attr:`port` / :attr:`url` after :meth:`start`).
        api_key: when set, every request but ``/health`` needs ``Authorization: Bearer <api_key>``
            (SGLang's ``--api-key``; :class:`SGLangEngine` sends it with ``headers=``).
        max_body_bytes: the largest request body (a prompt of 100k ids is ~700 KB of JSON).
        max_new_tokens: the most new tokens one request may ask for (``sampling_params.max_new_tokens``);
            a request asking for more is a 400 saying so, not cut short (the sampler's configured
            ``max_tokens`` must fit under it). In-process engines also stop at their context's end.
        max_requests: requests admitted at once (running or waiting for the engine); more get a 503.
        incremental_streaming: stream only each event's new tokens (default: cumulative, SGLang's default).
        vocab_size: token ids must be below it (default: the engine's, where it can tell).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        max_new_tokens: int = MAX_NEW_TOKENS_CAP,
        max_requests: int = 256,
        incremental_streaming: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {max_body_bytes}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {max_requests}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer of at least 1, got {max_new_tokens!r}")
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string (or None: no authentication)")
        self.engine = engine
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.max_new_tokens = max_new_tokens
        self.max_requests = max_requests
        self.incremental_streaming = incremental_streaming
        self.vocab_size = vocab_size
        self._api_key = api_key
        self._runner: web.AppRunner | None = None
        self._active = 0
        #: Requests answered (any status) and generations completed, over the server's life.
        self.requests = 0
        self.generations = 0

    @property
    def url(self) -> str:
        """The base URL to give :class:`SGLangEngine` (after :meth:`start`)."""
        if self._runner is None:
            raise RuntimeError("the engine server is not started: await server.start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Listen; :attr:`port` is the bound port afterwards."""
        if self._runner is not None:
            return
        if self.vocab_size is None:
            self.vocab_size = vocab_size_of(self.engine)
        # client_max_size bounds the body aiohttp reads; the handler turns its refusal into a JSON 413.
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = int(runner.addresses[0][1])
        self._runner = runner
        log.info("serving the %s engine at %s", getattr(self.engine, "name", "?"), self.url)

    async def close(self) -> None:
        """Stop listening and end open requests (the engine stays open)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> EngineServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------- handlers
    @staticmethod
    def _error(status: int, message: str, kind: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind}}, status=status)

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        self.requests += 1
        if self._api_key is not None and request.path != "/health":
            # Constant time, and total over what aiohttp hands over (header bytes that are not UTF-8
            # arrive as lone surrogates): the token is all that stands between the network and the model.
            token = bearer_token(request.headers)
            if token is None or not same_secret(token, self._api_key):
                return self._error(401, "missing or wrong API key: send Authorization: Bearer <api key>",
                                   "Unauthorized")
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPException as exc:  # 404 / 405 / 413 from aiohttp: JSON like the rest
            if exc.status >= 400:
                return self._error(exc.status, exc.reason or exc.text or "request refused",
                                   type(exc).__name__)
            raise

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": getattr(self.engine, "model", ""), "tokenizer_path": None,
                                  "is_generation": True})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return self._error(413, f"the body has {request.content_length} bytes, more than the server's "
                                    f"max_body_bytes ({self.max_body_bytes})", "PayloadTooLarge")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._error(413,
                               f"the body is larger than the server's max_body_bytes ({self.max_body_bytes})",
                               "PayloadTooLarge")
        try:
            # orjson, as the gateway: no recursion (any depth is an error, not a RecursionError), and no
            # NaN, Infinity or number that overflows to one.
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if "depth" in str(exc):
                return self._error(400, _DEPTH_ERROR, "BadRequestError")
            return self._error(400, f"the body is not JSON: {exc}", "BadRequestError")
        if self.vocab_size is None:  # an engine that loads lazily tells once loaded
            self.vocab_size = vocab_size_of(self.engine)
        try:
            req = parse_generate_request(body, vocab_size=self.vocab_size, max_new_tokens=self.max_new_tokens)
        except RequestError as exc:
            return self._error(400, str(exc), "BadRequestError")
        if self._active >= self.max_requests:
            resp = self._error(503,
                               f"{self._active} requests are running or waiting, the server's max_requests; "
                                    "retry later", "ServiceUnavailable")
            resp.headers["Retry-After"] = "1"
            return resp
        self._active += 1
        try:
            if req.stream:
                return await self._streamed(request, req)
            return await self._whole(req)
        finally:
            self._active -= 1

    def _answer(self, req: GenerateRequest, ids: list[int], lps: list[float], *, prompt_tokens: int,
                cached: int, finish: dict[str, Any] | None, t0: float, seed: Any = None,
                version: int | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids), "cached_tokens": cached,
            "e2e_latency": round(time.perf_counter() - t0, 6),
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
        if seed is not None:
            meta["sampling_seed"] = seed
        if version is not None:  # as SGLang's label: a string
            meta["weight_version"] = str(version)
        return {"output_ids": ids, "meta_info": meta}

    def _failure(self, exc: EngineError) -> web.Response:
        if isinstance(exc, PromptTooLongError):  # SGLang answers a too-long input with a 400 too
            return self._error(400, str(exc), "BadRequestError")
        return self._error(500, f"the {getattr(self.engine, 'name', '')} engine failed: {exc}", "EngineError")

    async def _whole(self, req: GenerateRequest) -> web.Response:
        t0 = time.perf_counter()
        try:
            result = await self.engine.generate(req.prompt_ids, req.sampling)
        except EngineError as exc:
            return self._failure(exc)
        self.generations += 1
        return web.json_response(self._answer(
            req, list(result.output_ids), list(result.logprobs),
            prompt_tokens=result.prompt_tokens or len(req.prompt_ids),
            cached=result.cached_tokens, finish=_finish(result), t0=t0, seed=result.extra.get("seed"),
            version=result.weight_version))

    async def _streamed(self, request: web.Request, req: GenerateRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        ids: list[int] = []
        lps: list[float] = []
        sent = 0  # tokens already written
        resp: web.StreamResponse | None = None

        async def write(finish: dict[str, Any] | None, **extra: Any) -> None:
            nonlocal sent
            start = sent if self.incremental_streaming else 0
            data = self._answer(req, ids[start:], lps[start:],
                                prompt_tokens=extra.pop("prompt_tokens", len(req.prompt_ids)),
                                cached=extra.pop("cached", 0), finish=finish, t0=t0,
                                seed=extra.pop("seed", None), version=extra.pop("version", None))
            # completion_tokens is the total so far in both modes (the client tells them apart by it).
            data["meta_info"]["completion_tokens"] = len(ids)
            assert resp is not None
            await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            sent = len(ids)

        stream: AsyncIterator[TokenChunk | GenerateResult] = self.engine.stream(req.prompt_ids, req.sampling)
        try:
            async for item in stream:
                if resp is None:
                    # The first item came: the prompt was accepted, the stream starts (errors before this
                    # point are plain HTTP errors).
                    resp = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                    await resp.prepare(request)
                if isinstance(item, GenerateResult):
                    if list(item.output_ids[: len(ids)]) != ids:
                        raise EngineError("the engine's result does not extend the tokens it streamed")
                    ids, lps = list(item.output_ids), list(item.logprobs)
                    await write(_finish(item), prompt_tokens=item.prompt_tokens or len(req.prompt_ids),
                                cached=item.cached_tokens, seed=item.extra.get("seed"),
                                version=item.weight_version)
                    self.generations += 1
                    break
                # One event behind the engine: the last tokens go out with the finish reason, as SGLang's.
                if len(ids) > sent:
                    await write(None)
                ids.extend(item.ids)
                lps.extend(item.logprobs)
            else:
                raise EngineError("the engine's stream ended without a result")
        except EngineError as exc:
            if resp is None:
                return self._failure(exc)
            await write(
                {"type": "abort", "message": f"the {getattr(self.engine, 'name', '')} engine failed: {exc}"})
        finally:
            # Also when the client left (a failed write, a cancelled handler): the engine stops at its next
            # token.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        if resp is None:  # pragma: no cover - a stream always yields at least its result
            return self._error(500, "the engine's stream ended without a result", "EngineError")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
