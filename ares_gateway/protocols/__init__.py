"""Wire protocols: one module per API the gateway impersonates.

``get_adapter(protocol)`` returns the :class:`ProtocolAdapter` of a
:class:`~ares_gateway.canonical.WireProtocol`; the three adapters are also
importable directly (``OPENAI_CHAT``, ``ANTHROPIC_MESSAGES``, ``OPENAI_RESPONSES``).
"""

from __future__ import annotations

from ares_gateway.canonical import WireProtocol
from ares_gateway.protocols.anthropic_messages import ADAPTER as ANTHROPIC_MESSAGES
from ares_gateway.protocols.base import ProtocolAdapter, RequestError, StreamEncoder
from ares_gateway.protocols.openai_chat import ADAPTER as OPENAI_CHAT
from ares_gateway.protocols.openai_responses import ADAPTER as OPENAI_RESPONSES

_ADAPTERS: dict[WireProtocol, ProtocolAdapter] = {
    WireProtocol.OPENAI_CHAT: OPENAI_CHAT,
    WireProtocol.ANTHROPIC_MESSAGES: ANTHROPIC_MESSAGES,
    WireProtocol.OPENAI_RESPONSES: OPENAI_RESPONSES,
}


def get_adapter(protocol: WireProtocol | str) -> ProtocolAdapter:
    """The adapter for ``protocol`` (a :class:`WireProtocol` or its string value)."""
    return _ADAPTERS[WireProtocol(protocol)]


__all__ = [
    "ANTHROPIC_MESSAGES",
    "OPENAI_CHAT",
    "OPENAI_RESPONSES",
    "ProtocolAdapter",
    "RequestError",
    "StreamEncoder",
    "get_adapter",
]
