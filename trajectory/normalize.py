"""Message normalization: turn a canonical chat message into the key the tree matches on.

Two layers:

* **Client normalizers** (pluggable): functions ``message -> message`` that strip what a
  particular client changes between requests although the conversation did not change.
  They run first, in registration order.  Those registered for ``"*"`` run for every
  client; others only when ``record_turn(..., metadata={"client": name})`` names the client.
  Built in for ``"*"``: :func:`strip_claude_code_billing_header` (its marker is specific
  enough to be harmless for other clients, and an untagged Claude Code session would
  otherwise fork at the system prompt on every request).
* **The structural key** (:func:`message_key`): role, content and tool calls, with key
  order irrelevant, tool-call arguments compared as parsed JSON, and wire ids,
  cache hints, reasoning/thinking and names ignored, so that a client's replayed echo
  of a generated message equals the original.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

Message = Mapping[str, Any]
MessageNormalizer = Callable[[Message], Message]
MessageKey = tuple[str, Hashable, tuple[tuple[str, str], ...]]

ALL_CLIENTS = "*"
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# Keys inside content blocks that differ between requests without changing meaning:
# prompt-cache hints and wire ids.
_VOLATILE_BLOCK_KEYS = frozenset({"cache_control", "id", "tool_use_id", "call_id"})
# Text-like block types: their text is what the model reads.
_TEXT_BLOCK_TYPES = frozenset({"text", "input_text", "output_text"})
# Reasoning is often dropped or re-encoded by clients when they replay history; the
# token records (not the messages) are what training uses, so routing ignores it.
_REASONING_BLOCK_TYPES = frozenset({"thinking", "redacted_thinking", "reasoning"})


def strip_claude_code_billing_header(message: Message) -> Message:
    """Drop Claude Code's per-request ``x-anthropic-billing-header: ...`` system block.

    Claude Code prepends it to the system prompt and changes it on every request.  Only
    system messages are touched; in string content the header lines are removed.
    """
    if message.get("role") != "system":
        return message
    content = message.get("content")
    if isinstance(content, str):
        if BILLING_HEADER_PREFIX not in content:
            return message
        kept = [ln for ln in content.split("\n") if not ln.lstrip().startswith(BILLING_HEADER_PREFIX)]
        return {**message, "content": "\n".join(kept).lstrip("\n")}
    if isinstance(content, list):
        blocks = [
            b
            for b in content
            if not (
                isinstance(b, Mapping)
                and isinstance(b.get("text"), str)
                and b["text"].lstrip().startswith(BILLING_HEADER_PREFIX)
            )
        ]
        if len(blocks) != len(content):
            return {**message, "content": blocks}
    return message


class NormalizerRegistry:
    """Client normalizers, per client name; ``"*"`` applies to every client."""

    def __init__(self, *, builtins: bool = True) -> None:
        self._lock = threading.Lock()
        self._by_client: dict[str, tuple[MessageNormalizer, ...]] = {}
        if builtins:
            self.register(strip_claude_code_billing_header)

    def register(self, normalizer: MessageNormalizer, client: str = ALL_CLIENTS) -> None:
        """Add ``normalizer`` for ``client`` (``"*"``: all clients).  Registering twice is a no-op."""
        with self._lock:
            current = self._by_client.get(client, ())
            if normalizer not in current:
                self._by_client[client] = (*current, normalizer)

    def unregister(self, normalizer: MessageNormalizer, client: str = ALL_CLIENTS) -> bool:
        """Remove ``normalizer`` for ``client``; returns whether it was registered."""
        with self._lock:
            current = self._by_client.get(client, ())
            if normalizer not in current:
                return False
            self._by_client[client] = tuple(n for n in current if n is not normalizer)
            return True

    def for_client(self, client: str | None) -> tuple[MessageNormalizer, ...]:
        """The normalizers that run for ``client``: the ``"*"`` ones, then the client's own."""
        common = self._by_client.get(ALL_CLIENTS, ())
        if client is None or client == ALL_CLIENTS:
            return common
        return common + self._by_client.get(client, ())

    def key(self, message: Message, client: str | None = None) -> MessageKey:
        """The structural key of ``message`` after this registry's normalizers for ``client``."""
        return message_key(message, self.for_client(client))


#: The registry a :class:`~trajectory.TrajectoryManager` uses unless given another one.
default_registry = NormalizerRegistry()


def register_normalizer(normalizer: MessageNormalizer, client: str = ALL_CLIENTS) -> None:
    """Register a client normalizer in the default registry (``client="*"``: every client)."""
    default_registry.register(normalizer, client)


def unregister_normalizer(normalizer: MessageNormalizer, client: str = ALL_CLIENTS) -> bool:
    """Remove a client normalizer from the default registry."""
    return default_registry.unregister(normalizer, client)


def _canonical_json(value: Any) -> str:
    # sort_keys makes key order irrelevant at every depth; the C encoder does the walk.
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return _canonical_json(json.loads(arguments))
        except ValueError:
            return arguments  # not JSON (a truncated call): compare verbatim
    if arguments is None:
        return _canonical_json({})
    return _canonical_json(arguments)


def _content_key(content: Any) -> Hashable:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        return ("value", _canonical_json(content))
    texts: list[str] = []
    parts: list[tuple[str, str]] = []
    only_text = True
    for block in content:
        if type(block) is dict and block.get("type") in _TEXT_BLOCK_TYPES and type(block.get("text")) is str:
            # Fast path for the common case: a plain text block.
            texts.append(block["text"])
            parts.append(("text", block["text"]))
            continue
        if isinstance(block, str):
            texts.append(block)
            parts.append(("text", block))
            continue
        if not isinstance(block, Mapping):
            only_text = False
            parts.append(("value", _canonical_json(block)))
            continue
        kind = block.get("type")
        if kind in _REASONING_BLOCK_TYPES:
            continue
        if kind in _TEXT_BLOCK_TYPES and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append(("text", block["text"]))
            continue
        only_text = False
        parts.append(
            ("block", _canonical_json({k: v for k, v in block.items() if k not in _VOLATILE_BLOCK_KEYS}))
        )
    if only_text:
        # A list of text blocks and a plain string with the same text are the same message:
        # clients replay string content as blocks and back.
        return "".join(texts)
    return tuple(parts)


def _tool_calls_key(tool_calls: Any) -> tuple[tuple[str, str], ...]:
    if not tool_calls:
        return ()
    out: list[tuple[str, str]] = []
    for call in tool_calls:
        if not isinstance(call, Mapping):
            out.append(("", _canonical_json(call)))
            continue
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            fn = call
        out.append((str(fn.get("name") or ""), _canonical_arguments(fn.get("arguments"))))
    return tuple(out)


def message_key(message: Message, normalizers: Iterable[MessageNormalizer] = ()) -> MessageKey:
    """Structural key of a canonical chat message.

    Equal keys mean "the same message" for routing: ``role``, ``content`` (text blocks
    joined; other blocks as canonical JSON without ids or cache hints; reasoning blocks
    dropped) and ``tool_calls`` as ``(name, canonical arguments JSON)`` in order.  Ignored:
    ``tool_call_id``, message ids, ``name``, ``reasoning`` and any other field.
    """
    for normalize in normalizers:
        message = normalize(message)
    return (
        str(message.get("role") or ""),
        _content_key(message.get("content")),
        _tool_calls_key(message.get("tool_calls")),
    )


def tool_names(key: MessageKey) -> tuple[str, ...]:
    """Names of the tools called by the message with this key."""
    return tuple(name for name, _ in key[2])
