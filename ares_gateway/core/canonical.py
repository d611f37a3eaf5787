"""The canonical form of an LLM request and of its completion.

Every wire protocol (OpenAI chat completions, Anthropic messages, OpenAI
responses) is converted to and from these models by the pure functions in
:mod:`ares_gateway.protocols`. Messages follow the OpenAI chat style (role,
content as a string or a list of parts, tool calls, tool results) because
that is what trainers and chat templates consume.

Anything a protocol carries that has no canonical field is kept in ``extra``
(per message / part / tool) so that a round trip through the canonical form
loses nothing the target protocol can express; the verbatim request body is
always kept in :attr:`CanonicalRequest.raw`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from ares_gateway.core.errors import InvalidPolicyVersionError, PolicyVersionBackwardsError
from ares_gateway.core.token_ids import logprob_array, token_array


class WireProtocol(StrEnum):
    """The wire API an agent spoke; also the ``protocol`` field of a polled item."""

    OPENAI_CHAT = "openai.chat"
    ANTHROPIC_MESSAGES = "anthropic.messages"
    OPENAI_RESPONSES = "openai.responses"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ContentPart(_Model):
    """One part of a message's content.

    ``type`` is ``"text"``, ``"image"``, ``"audio"``, ``"file"``, ``"thinking"``,
    ``"redacted_thinking"`` or whatever the client sent (unknown types are kept).
    ``extra`` holds protocol specifics: ``cache_control``, a thinking
    ``signature``, an image ``source`` / ``detail``, the raw block of an unknown type.
    """

    type: str = "text"
    text: str | None = None
    #: For images / files: a URL or a ``data:`` URL.
    url: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Model):
    """A call the model asks the client to run.

    ``arguments`` is the JSON-encoded argument object for function tools (as
    OpenAI sends it), or the free-form input for ``custom`` tools (Codex's
    ``apply_patch``).
    """

    id: str
    name: str
    arguments: str = "{}"
    type: Literal["function", "custom"] = "function"
    extra: dict[str, Any] = Field(default_factory=dict)


class Message(_Model):
    """A chat message in OpenAI-chat style.

    Roles: ``system``, ``developer``, ``user``, ``assistant``, ``tool``.
    A tool result is a ``tool`` message with ``tool_call_id`` (and ``is_error``
    when the client flagged it). ``reasoning`` is the model's visible
    reasoning / thinking text for assistant messages.
    """

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    is_error: bool | None = None
    reasoning: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    def text(self) -> str:
        """The message's text content, parts joined, non-text parts skipped."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")

    def to_chat_dict(self) -> dict[str, Any]:
        """The message as a plain dict (role, content, tool_calls, ...), omitting empty fields.

        This is the form handed to the trajectory recorder and to chat templates.
        """
        out: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list):
            out["content"] = [_part_dict(p) for p in self.content]
        else:
            out["content"] = self.content
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": tc.id, "type": tc.type, "function": {"name": tc.name, "arguments": tc.arguments}}
                for tc in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.is_error:
            out["is_error"] = True
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out


def _part_dict(p: ContentPart) -> dict[str, Any]:
    d: dict[str, Any] = {"type": p.type}
    if p.text is not None:
        d["text"] = p.text
    if p.url is not None:
        d["url"] = p.url
    return d


class Tool(_Model):
    """A tool offered to the model.

    ``type`` is ``"function"`` for JSON-schema tools; other types (``custom``,
    ``namespace``, ``web_search``, ``tool_search``, Anthropic server tools) are
    kept with their original definition in ``extra["raw"]``.
    """

    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class SamplingParams(_Model):
    """Generation parameters common to the three APIs; the rest stay in ``extra``."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class CanonicalRequest(_Model):
    """One LLM request in canonical form, with the verbatim body beside it."""

    protocol: WireProtocol
    model: str | None = None
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    #: OpenAI ``stream_options.include_usage``.
    include_usage: bool = False
    #: Protocol fields that have no canonical slot (thinking config, metadata, reasoning, ...).
    extra: dict[str, Any] = Field(default_factory=dict)
    #: The request body exactly as the agent sent it (parsed JSON).
    raw: dict[str, Any] = Field(default_factory=dict, repr=False)


class Usage(_Model):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0


def _ids_in(value: Any, info: ValidationInfo) -> npt.NDArray[np.int32]:
    return token_array(value, info.field_name or "token ids")


def _logprobs_in(value: Any) -> npt.NDArray[np.float64]:
    # Counted against output_ids in TokenRecord's after-validator.
    return logprob_array(value, None)


#: Token ids: an int32 array (given as a list of ints, base64 of little-endian int32 or an array),
#: dumped as a list of ints.
TokenIds = Annotated[
    npt.NDArray[np.int32],
    PlainValidator(_ids_in),
    PlainSerializer(lambda a: a.tolist(), return_type=list[int]),
    WithJsonSchema({"type": "array", "items": {"type": "integer", "minimum": 0}}),
]
#: Logprobs: a float64 array (given as a list of numbers, base64 of little-endian float32 or an
#: array), dumped as a list of floats.
Logprobs = Annotated[
    npt.NDArray[np.float64],
    PlainValidator(_logprobs_in),
    PlainSerializer(lambda a: a.tolist(), return_type=list[float]),
    WithJsonSchema({"type": "array", "items": {"type": "number"}}),
]


class TokenRecord(_Model):
    """The generation as the inference engine saw it: the token-faithful record for training.

    The ids are int32 arrays and the logprobs float64 arrays, never lists of Python ints (a
    157k-token prompt is 628 KB as int32 and ~6 MB as a list); they may be given as lists, base64
    or arrays, and dump as lists.
    """

    prompt_ids: TokenIds
    output_ids: TokenIds
    output_logprobs: Logprobs = Field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    finish_reason: str | None = None

    @model_validator(mode="after")
    def _same_length(self) -> TokenRecord:
        n, m = int(self.output_logprobs.shape[0]), int(self.output_ids.shape[0])
        if n and n != m:
            raise ValueError(
                f"output_logprobs has {n} entries but output_ids has {m}; give one logprob per output "
                "token or none"
            )
        return self

    def __eq__(self, other: object) -> bool:
        # Arrays compare element-wise; two records are equal when every field is.
        if not isinstance(other, TokenRecord):
            return NotImplemented
        return (
            np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.output_ids, other.output_ids)
            and np.array_equal(self.output_logprobs, other.output_logprobs)
            and self.finish_reason == other.finish_reason
        )


FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


def read_policy_version(value: object, what: str = "policy_version") -> int | None:
    """A policy version as given (``None``: none), checked: a non-negative integer, never a bool, a
    float or a string. Raises :class:`~ares_gateway.core.errors.InvalidPolicyVersionError` (400)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidPolicyVersionError(
            f"{what} must be a non-negative integer (the version of the weights that sampled the answer) "
            f"or null, not {value!r}",
            param=what,
        )
    return int(value)


def next_policy_version(version: object, current: int | None) -> int:
    """The version to set after ``current`` (``None``: none set yet): ``version``, checked. Raises
    :class:`~ares_gateway.core.errors.InvalidPolicyVersionError` (400) for anything but a non-negative
    integer and :class:`~ares_gateway.core.errors.PolicyVersionBackwardsError` (409) for one lower than
    ``current`` (the same again is allowed: a no-op)."""
    if version is None:
        raise InvalidPolicyVersionError("version must be a non-negative integer, not None", param="version")
    checked = read_policy_version(version, "version")
    assert checked is not None
    if current is not None and checked < current:
        raise PolicyVersionBackwardsError(
            f"policy version {checked} is lower than the gateway's current version {current}: versions only "
            "go up; set the version of the weights now loaded"
        )
    return checked


def _policy_version_in(value: Any) -> int | None:
    try:
        return read_policy_version(value)
    except InvalidPolicyVersionError as exc:
        raise ValueError(exc.message) from None


#: A policy version: a non-negative integer, or ``None`` (no version known).
PolicyVersion = Annotated[
    int | None,
    PlainValidator(_policy_version_in),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}),
]


class Completion(_Model):
    """The policy's answer to one request, in canonical form.

    ``tool_calls`` may hold several calls (parallel tool calls are preserved in
    order). ``finish_reason`` uses OpenAI-chat vocabulary and is mapped to each
    protocol's own (``end_turn`` / ``tool_use`` / ``max_tokens`` for Anthropic).
    """

    text: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason = "stop"
    usage: Usage | None = None
    tokens: TokenRecord | None = None
    model: str | None = None
    #: The version of the weights that sampled this answer, as the engine or policy reports it
    #: (``None``: it does not say; the turn then takes the gateway's version, docs/training.md).
    policy_version: PolicyVersion = None
    #: Protocol specifics to carry back (e.g. a thinking ``signature``).
    extra: dict[str, Any] = Field(default_factory=dict)

    def to_message(self) -> Message:
        """The assistant message this completion becomes in the conversation."""
        return Message(
            role="assistant",
            content=self.text,
            tool_calls=list(self.tool_calls),
            reasoning=self.reasoning,
        )


class CompletionDelta(_Model):
    """One increment of a streamed completion.

    Exactly one kind per delta: ``text``, ``reasoning``, or a piece of tool call
    number ``tool_index`` (its ``tool_call_id`` / ``tool_name`` on the first
    piece, then ``arguments`` fragments). ``signature`` (an Anthropic thinking
    signature) closes the current thinking block; it comes alone or with that
    block's last ``reasoning`` piece, before the text that follows.
    """

    text: str | None = None
    reasoning: str | None = None
    tool_index: int | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    tool_type: Literal["function", "custom"] = "function"
    arguments: str | None = None
    #: Ends the thinking block being streamed; the completion keeps it as ``extra["signature"]``.
    signature: str | None = None
