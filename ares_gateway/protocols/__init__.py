"""Wire protocols: one module per API the gateway impersonates."""

from ares_gateway.protocols.base import ProtocolAdapter, RequestError, StreamEncoder

__all__ = ["ProtocolAdapter", "RequestError", "StreamEncoder"]
