"""Deprecated module name: :mod:`ares_gateway.engines.engine_server` holds :class:`EngineServer`.

Kept for one release so old imports work; importing it warns.
"""

from __future__ import annotations

import warnings

from ares_gateway.engines.engine_server import *  # noqa: F403
from ares_gateway.engines.engine_server import MAX_NEW_TOKENS_CAP, MAX_TEMPERATURE, EngineServer

warnings.warn("ares_gateway.engines.server is renamed ares_gateway.engines.engine_server; "
              "import EngineServer from there", DeprecationWarning, stacklevel=2)

__all__ = ["MAX_NEW_TOKENS_CAP", "MAX_TEMPERATURE", "EngineServer"]
