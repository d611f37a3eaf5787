"""What a policy may answer a parked request with, and reading any accepted answer into one.

A policy answers with a :class:`~ares_gateway.core.canonical.Completion`, a native response body
of the agent's protocol (a dict), an :class:`ErrorAnswer`, or an async iterable of
:class:`~ares_gateway.core.canonical.CompletionDelta` ending with a ``Completion``
(a :class:`StreamAnswer`). :func:`coerce_answer` turns each into the one :data:`Answer` the agent's
handler renders, or raises :class:`~ares_gateway.core.errors.InvalidAnswerError` saying what is wrong;
the broker calls it before it resolves anything, so a bad answer leaves the request pending.

A whole answer is also proven to render for its request before it is accepted (else a native
body nested 300 deep would be a 200 at ``/respond`` and a 500 to the agent, the turn unrecorded): a
native body sent verbatim is encoded here and its bytes kept (``NativeAnswer.raw``, what the agent
is sent), and any other whole answer is rendered once in the agent's protocol, whole or as its
synthesized stream. What cannot be rendered is refused to the responder (400); the request stays
parked, answerable by a correct answer. Only a stream (:class:`StreamAnswer`) is rendered as it
arrives; a delta that cannot be ends the agent's stream with an error event in its shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    CompletionDelta,
    TokenRecord,
    WireProtocol,
)
from ares_gateway.core.errors import InvalidAnswerError
from ares_gateway.core.token_ids import logprob_array, token_array
from ares_gateway.core.wire import MAX_JSON_DEPTH, RequestError, adapter_for, nests_deeper


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """Answer a request with an API error; the agent sees ``status`` in its protocol's error shape."""

    status: int
    message: str


#: Deepest nesting of objects and arrays accepted in a native answer body (the body itself is level 1):
#: the wire's one rule, :data:`~ares_gateway.core.wire.MAX_JSON_DEPTH`.
MAX_ANSWER_DEPTH = MAX_JSON_DEPTH
# A response id to render a Completion with when it is only being proven to render.
_TRIAL_ID = "req_trial"


@dataclass(frozen=True, slots=True)
class NativeAnswer:
    """A response body in the agent's own protocol, plus its canonical reading (for recording).

    ``raw`` is ``body`` encoded as JSON, set when the answer is accepted (what the agent is sent)."""

    body: dict[str, Any]
    completion: Completion
    raw: bytes | None = None


class StreamAnswer:
    """A streamed answer: deltas as they arrive, then the whole :class:`Completion`.

    The source yields :class:`CompletionDelta` items and finally one
    :class:`Completion` (which may repeat what the deltas said).
    """

    def __init__(self, source: AsyncIterable[CompletionDelta | Completion]) -> None:
        self.source = source


#: What the agent's handler is resolved with.
Answer = Completion | NativeAnswer | ErrorAnswer | StreamAnswer
#: What ``respond`` accepts.
AnswerLike = Answer | dict[str, Any] | AsyncIterable[CompletionDelta | Completion] | str


def read_tokens(tokens: TokenRecord | dict[str, Any] | None) -> TokenRecord | None:
    """A checked :class:`TokenRecord` from what ``respond`` was given (``None`` stays ``None``).

    Ids may be JSON lists, base64 of little-endian int32 or numpy arrays; they come out as int32
    arrays. Raises :class:`InvalidAnswerError` saying what is wrong: ids that are not integers,
    negative or beyond int32, logprobs that are not one per output token, unknown fields.
    """
    if tokens is None:
        return None
    if isinstance(tokens, TokenRecord):
        p, o = tokens.prompt_ids, tokens.output_ids
        if isinstance(p, np.ndarray) and isinstance(o, np.ndarray) and p.dtype == o.dtype == np.int32:
            return tokens  # validated when it was built
        fields: dict[str, Any] = {
            "prompt_ids": p,
            "output_ids": o,
            "output_logprobs": tokens.output_logprobs,
            "finish_reason": tokens.finish_reason,
        }
    elif isinstance(tokens, dict):
        fields = tokens
    else:
        raise InvalidAnswerError('"tokens" must be an object with prompt_ids, output_ids, output_logprobs')
    unknown = set(fields) - {"prompt_ids", "output_ids", "output_logprobs", "finish_reason"}
    if unknown:
        raise InvalidAnswerError(f"tokens: unknown field(s) {sorted(unknown)}")
    for name in ("prompt_ids", "output_ids"):
        if name not in fields:
            raise InvalidAnswerError(f"tokens: {name} is missing")
    prompt = token_array(fields["prompt_ids"], "prompt_ids")
    output = token_array(fields["output_ids"], "output_ids")
    logprobs = logprob_array(fields.get("output_logprobs"), int(output.shape[0]))
    finish = fields.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise InvalidAnswerError("tokens: finish_reason must be a string")
    return TokenRecord.model_construct(
        prompt_ids=prompt, output_ids=output, output_logprobs=logprobs, finish_reason=finish
    )


def coerce_answer(
    protocol: WireProtocol,
    request: CanonicalRequest,
    answer: AnswerLike,
    tokens: TokenRecord | dict[str, Any] | None = None,
) -> Answer:
    """One :data:`Answer` from anything ``respond`` accepts, with ``tokens`` attached to a completion.

    The one place an answer is read, for every caller (``Gateway.respond`` in process, ``/respond``
    over HTTP): a string is a text completion; token ids are read here once (``tokens``, else the
    completion's own ``tokens``; lists, base64 or arrays become checked int32 arrays).

    Raises :class:`InvalidAnswerError` for an answer of another type, a native body that is not a
    valid response of ``protocol`` (nor a chat-completions body, which ares-proxy pollers send for
    every protocol), or malformed ``tokens``.
    """
    if isinstance(answer, str):
        answer = Completion(text=answer)
    token_record = read_tokens(tokens)
    if isinstance(answer, Completion):
        if token_record is None and answer.tokens is not None:
            token_record = read_tokens(answer.tokens)
        _prove_renders(protocol, request, answer)
        return (answer.model_copy(update={"tokens": token_record}) if token_record is not answer.tokens
                else answer)
    if isinstance(answer, ErrorAnswer):
        return _checked_error(protocol, answer)
    if isinstance(answer, NativeAnswer):
        return _checked_native(protocol, request, answer)
    if isinstance(answer, StreamAnswer):
        return answer
    if isinstance(answer, AsyncIterable):
        return StreamAnswer(answer)
    if not isinstance(answer, dict):
        raise InvalidAnswerError(
            f"cannot answer with {type(answer).__name__}: give a Completion, a native response body, "
            "an ErrorAnswer, or an async iterable of CompletionDelta"
        )
    if nests_deeper(answer, MAX_ANSWER_DEPTH):
        raise _too_deep_error()
    try:
        completion, verbatim = read_native(protocol, request, answer)
    except InvalidAnswerError:
        raise
    except ValueError as exc:
        raise InvalidAnswerError(f"response is not a valid {protocol.value} body: {exc}") from None
    if token_record is not None:
        completion = completion.model_copy(update={"tokens": token_record})
    if verbatim:
        return _checked_native(protocol, request, NativeAnswer(answer, completion))
    _prove_renders(protocol, request, completion)
    return completion


def _too_deep_error() -> InvalidAnswerError:
    return InvalidAnswerError(
        f"response nests objects and arrays more than {MAX_ANSWER_DEPTH} levels deep (MAX_ANSWER_DEPTH); "
        "the gateway sends no such body to an agent"
    )


def _cannot_render(protocol: WireProtocol, exc: Exception) -> InvalidAnswerError:
    return InvalidAnswerError(f"the gateway cannot render this answer for a {protocol.value} agent: {exc}")


def _prove_renders(protocol: WireProtocol, request: CanonicalRequest, completion: Completion) -> None:
    """Render ``completion`` as the agent will get it (JSON body, or the synthesized stream), or raise."""
    adapter = adapter_for(protocol)
    try:
        if request.stream:
            encoder = adapter.stream_encoder(request, _TRIAL_ID)
            encoder.start()
            encoder.finish(completion)
        else:
            orjson.dumps(adapter.render_response(completion, request, _TRIAL_ID))
    except Exception as exc:  # whatever the renderer or the encoder refuses (depth, types, not UTF-8, ...)
        raise _cannot_render(protocol, exc) from None


def _checked_native(protocol: WireProtocol, request: CanonicalRequest, answer: NativeAnswer) -> NativeAnswer:
    """``answer`` with the bytes the agent will get (a non-streaming request gets the body verbatim)."""
    if request.stream:  # a streaming agent gets the completion, rendered as its protocol's stream
        _prove_renders(protocol, request, answer.completion)
        return answer
    if answer.raw is not None:
        return answer
    if not isinstance(answer.body, dict):
        raise InvalidAnswerError("NativeAnswer.body must be a dict (the response body)")
    if nests_deeper(answer.body, MAX_ANSWER_DEPTH):
        raise _too_deep_error()
    try:
        raw = orjson.dumps(answer.body)
    except TypeError as exc:  # orjson.JSONEncodeError: nested too deep, not JSON, not UTF-8
        raise _cannot_render(protocol, exc) from None
    return dataclasses.replace(answer, raw=raw)


def _checked_error(protocol: WireProtocol, answer: ErrorAnswer) -> ErrorAnswer:
    status, message = answer.status, answer.message
    if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
        raise InvalidAnswerError(f"ErrorAnswer.status must be an HTTP error status (400-599), not {status!r}")
    if not isinstance(message, str):
        raise InvalidAnswerError("ErrorAnswer.message must be a string")
    try:
        message.encode()
    except UnicodeEncodeError:
        # Lone surrogates (an exception's text, in process): the message is for people; escape them
        # rather than refuse the error, which is often the policy's last resort.
        return ErrorAnswer(status, message.encode("utf-8", "backslashreplace").decode())
    return answer


def read_native(protocol: WireProtocol, request: CanonicalRequest, body: dict[str, Any]) -> tuple[Completion,
                                                                                                  bool]:
    """Read a native answer; the flag says whether the body can be sent to the agent verbatim."""
    try:
        return adapter_for(protocol).parse_response(body, request), True
    except RequestError as first:
        # ares-proxy pollers answer every request with a chat-completions body.
        if "choices" in body and protocol is not WireProtocol.OPENAI_CHAT:
            try:
                return adapter_for(WireProtocol.OPENAI_CHAT).parse_response(body, request), False
            except RequestError:
                pass
        raise InvalidAnswerError(
            f"response is not a valid {protocol.value} response body: {first.message}") from None
