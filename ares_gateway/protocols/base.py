"""The interface every wire-protocol module implements: defined by the core
(:mod:`ares_gateway.core.wire`, which the core uses without knowing any protocol module) and
re-exported here for the protocol modules."""

from __future__ import annotations

from ares_gateway.core.wire import ProtocolAdapter, RequestError, Reuse, StreamEncoder

__all__ = ["ProtocolAdapter", "RequestError", "Reuse", "StreamEncoder"]
