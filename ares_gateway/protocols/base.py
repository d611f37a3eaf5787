"""Deprecated module: the wire-protocol interface lives in :mod:`ares_gateway.core.wire` (and is
re-exported from :mod:`ares_gateway.protocols`). Kept for one release so old imports work; importing it
warns."""

from __future__ import annotations

import warnings

from ares_gateway.core.wire import ProtocolAdapter, RequestError, Reuse, StreamEncoder

warnings.warn("ares_gateway.protocols.base is deprecated: import ProtocolAdapter, RequestError, Reuse and "
              "StreamEncoder from ares_gateway.protocols or ares_gateway.core.wire", DeprecationWarning,
              stacklevel=2)

__all__ = ["ProtocolAdapter", "RequestError", "Reuse", "StreamEncoder"]
