"""What the HTTP layer needs from the gateway it serves, as a protocol.

The APIs of :mod:`~ares_gateway.http.agent_api` and :mod:`~ares_gateway.http.control_api` are
handed the :class:`~ares_gateway.gateway.Gateway` that composes them, but they know it only as a
:class:`ServedGateway`: the core objects it holds (broker, sessions, metrics), the few settings
they read, and its session methods. So ``http/`` never imports ``gateway.py``, which imports ``http/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ares_gateway.core.broker import Broker
from ares_gateway.core.canonical import CanonicalRequest
from ares_gateway.core.metrics import GatewayMetrics
from ares_gateway.core.sessions import Session, SessionInfo, SessionRegistry
from trajectory import Sample


class ServedSettings(Protocol):
    """The settings of a :class:`~ares_gateway.gateway.GatewayConfig` the HTTP layer reads."""

    @property
    def admin_token(self) -> str | None: ...
    @property
    def auto_sessions(self) -> bool: ...
    @property
    def models(self) -> list[str]: ...
    @property
    def stream_idle_timeout(self) -> float: ...
    @property
    def access_log(self) -> bool: ...


class ServedGateway(Protocol):
    """The gateway as its HTTP APIs see it (:class:`~ares_gateway.gateway.Gateway` is one)."""

    @property
    def config(self) -> ServedSettings: ...
    @property
    def broker(self) -> Broker: ...
    @property
    def sessions(self) -> SessionRegistry: ...
    @property
    def metrics(self) -> GatewayMetrics: ...

    def admin_ok(self, headers: Mapping[str, str]) -> bool: ...
    def is_side_call(self, session: Session, request: CanonicalRequest, headers: Mapping[str, str]) -> bool: ...
    async def create_session(
        self, session_id: str | None = None, *, metadata: dict[str, Any] | None = None, token: str | None = None
    ) -> SessionInfo: ...
    def session_summary(self, session_id: str) -> dict[str, Any]: ...
    async def end_session(
        self, session_id: str, *, reward: float | None = None, truncated: bool = False, **info: Any
    ) -> None: ...
    async def delete_session(self, session_id: str) -> int: ...
    def trajectory(self, session_id: str, *, reward: float | None = None, max_sample_tokens: int = 0) -> list[Sample]: ...
    def turn_log(self, session_id: str) -> list[dict[str, Any]]: ...
