"""What a policy may answer a parked request with, and reading any accepted answer into one.

A policy answers with a :class:`~ares_gateway.core.canonical.Completion`, a native response body
of the agent's protocol (a dict), an :class:`ErrorAnswer`, or an async iterable of
:class:`~ares_gateway.core.canonical.CompletionDelta` ending with a ``Completion``
(a :class:`StreamAnswer`). :func:`coerce_answer` turns each into the one :data:`Answer` the agent's
handler renders, or raises :class:`~ares_gateway.core.errors.InvalidAnswerError` saying what is wrong;
the broker calls it before it resolves anything, so a bad answer leaves the request pending.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    CompletionDelta,
    TokenRecord,
    WireProtocol,
)
from ares_gateway.core.errors import InvalidAnswerError
from ares_gateway.core.token_ids import logprob_array, token_array
from ares_gateway.protocols import RequestError, get_adapter


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """Answer a request with an API error; the agent sees ``status`` in its protocol's error shape."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class NativeAnswer:
    """A response body in the agent's own protocol, plus its canonical reading (for recording)."""

    body: dict[str, Any]
    completion: Completion


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
AnswerLike = Answer | dict[str, Any] | AsyncIterable[CompletionDelta | Completion]


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

    Raises :class:`InvalidAnswerError` for an answer of another type, a native body that is not a
    valid response of ``protocol`` (nor a chat-completions body, which ares-proxy pollers send for
    every protocol), or malformed ``tokens``.
    """
    token_record = read_tokens(tokens)
    if isinstance(answer, Completion):
        return answer.model_copy(update={"tokens": token_record}) if token_record else answer
    if isinstance(answer, StreamAnswer | ErrorAnswer | NativeAnswer):
        return answer
    if isinstance(answer, AsyncIterable):
        return StreamAnswer(answer)
    if not isinstance(answer, dict):
        raise InvalidAnswerError(
            f"cannot answer with {type(answer).__name__}: give a Completion, a native response body, "
            "an ErrorAnswer, or an async iterable of CompletionDelta"
        )
    try:
        completion, verbatim = read_native(protocol, request, answer)
    except InvalidAnswerError:
        raise
    except ValueError as exc:
        raise InvalidAnswerError(f"response is not a valid {protocol.value} body: {exc}") from None
    if token_record is not None:
        completion = completion.model_copy(update={"tokens": token_record})
    return NativeAnswer(answer, completion) if verbatim else completion


def read_native(protocol: WireProtocol, request: CanonicalRequest, body: dict[str, Any]) -> tuple[Completion, bool]:
    """Read a native answer; the flag says whether the body can be sent to the agent verbatim."""
    try:
        return get_adapter(protocol).parse_response(body, request), True
    except RequestError as first:
        # ares-proxy pollers answer every request with a chat-completions body.
        if "choices" in body and protocol is not WireProtocol.OPENAI_CHAT:
            try:
                return get_adapter(WireProtocol.OPENAI_CHAT).parse_response(body, request), False
            except RequestError:
                pass
        raise InvalidAnswerError(f"response is not a valid {protocol.value} response body: {first.message}") from None
