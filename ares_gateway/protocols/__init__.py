"""Wire protocols: one module per API the gateway impersonates.

``get_adapter(protocol)`` returns the :class:`ProtocolAdapter` of a
:class:`~ares_gateway.core.canonical.WireProtocol` (or its string value); the three
adapters are also importable directly (``OPENAI_CHAT``, ``ANTHROPIC_MESSAGES``,
``OPENAI_RESPONSES``). Each module's docstring documents its mapping.

Conventions shared by the three modules:

* ``parse_request`` never rejects an unknown field: unknown keys go to the
  ``extra`` dict of the request / message / part / tool / tool call they sat
  in and are rendered back verbatim; ``raw`` is the body object itself (not
  copied, never mutated). Only unusable input raises :class:`RequestError`
  (``param`` names the field, e.g. ``messages[2].content``).
* ``parse_request(body, reuse=..., ends=...)`` takes over what the session's previous request
  shares with this one byte for byte (:class:`~ares_gateway.core.wire.Reuse`; the gateway's
  ``ParseMemo`` finds it): the messages of the shared leading items and, when nothing outside the
  list changed, the tools, as the very objects. A canonical request is read-only.
* Non-function tools (server tools, ``custom``, ``namespace``, ...) keep their
  definition verbatim in ``Tool.extra["raw"]``.
* A few ``extra`` keys are markers that make native round trips exact:
  ``same_turn`` (Anthropic: this piece shared the previous piece's user turn),
  ``in_messages`` (a leading system message that was not ``system`` /
  ``instructions``), ``bare`` / ``input_string`` / ``reasoning_item`` /
  ``custom`` / ``item`` (Responses item forms), ``no_content`` /
  ``reasoning_key`` / ``legacy`` / ``no_type`` (chat variants). Consumers can
  ignore them; renderers of other protocols drop them.
* ``render_response`` / ``stream_encoder`` take the response id with or
  without its protocol prefix (``chatcmpl-``, ``msg_``, ``resp_``) and add it
  when missing. A completion with tool calls and ``finish_reason="stop"`` is
  rendered as a tool-call stop (``tool_calls`` / ``tool_use``).
* Completion ``extra`` keys read by the renderers: ``signature`` and
  ``redacted_thinking`` (Anthropic), ``encrypted_content`` (Responses
  reasoning item), ``refusal`` (chat), ``stop_sequence`` (Anthropic).
* ``anthropic_messages.parse_count_tokens_request`` parses a
  ``/v1/messages/count_tokens`` body (no ``max_tokens`` required).
"""

from __future__ import annotations

from ares_gateway.core.canonical import WireProtocol
from ares_gateway.core.wire import ProtocolAdapter, RequestError, StreamEncoder, adapter_for, register_adapter
from ares_gateway.protocols.anthropic_messages import ADAPTER as ANTHROPIC_MESSAGES
from ares_gateway.protocols.openai_chat import ADAPTER as OPENAI_CHAT
from ares_gateway.protocols.openai_responses import ADAPTER as OPENAI_RESPONSES

# Handed to the core here: it renders, reads and re-parses through these without importing this package.
for _adapter in (OPENAI_CHAT, ANTHROPIC_MESSAGES, OPENAI_RESPONSES):
    register_adapter(_adapter)


def get_adapter(protocol: WireProtocol | str) -> ProtocolAdapter:
    """The adapter for ``protocol`` (a :class:`WireProtocol` or its string value)."""
    return adapter_for(protocol)


__all__ = [
    "ANTHROPIC_MESSAGES",
    "OPENAI_CHAT",
    "OPENAI_RESPONSES",
    "ProtocolAdapter",
    "RequestError",
    "StreamEncoder",
    "get_adapter",
]
