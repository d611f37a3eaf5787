"""The whole HTTP surface of one gateway: which path goes to which handler, and the server around it."""

from __future__ import annotations

from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from ares_gateway.core.canonical import WireProtocol
from ares_gateway.http import render
from ares_gateway.http.agent_api import AgentAPI
from ares_gateway.http.control_api import ControlAPI
from ares_gateway.http.render import error_for_path
from ares_gateway.http.routes import MountHandler, RouteTable
from ares_gateway.http.served import ServedGateway
from ares_gateway.http.server import HttpLimits, HttpServer


async def _not_routed(request: BaseRequest, allowed: frozenset[str]) -> StreamResponse:
    """Unknown paths (404) and wrong methods (405), in the shape of the API the client speaks."""
    status, reason = (405, "Method Not Allowed") if allowed else (404, "Not Found")
    headers = {"allow": ",".join(sorted(allowed))} if allowed else None
    return error_for_path(request.path, status, f"{reason}: {request.method} {request.path}", headers)


def build_routes(gateway: ServedGateway, limits: HttpLimits,
                 mounts: dict[str, MountHandler] | None = None) -> RouteTable:
    """Every path the gateway serves, agent-facing and policy-facing, and the applications mounted
    under a prefix (``mounts``, kept by reference: e.g. the trajectory viewer at ``/ui``)."""
    agent = AgentAPI(gateway, limits)
    control = ControlAPI(gateway, limits)
    routes = RouteTable(fallback=_not_routed, mounts={} if mounts is None else mounts)
    # Agent paths: at the root and under /s/{sid} (the session's base URL).
    # Each handler raises its errors; in_shape answers them in the agent's protocol's shape.
    shaped = agent.in_shape
    for path, protocol in render.AGENT_PATHS.items():
        routes.add_agent("POST", path, shaped(agent.completion_handler(protocol, path), protocol))
    routes.add_agent("POST", "/v1/messages/count_tokens",
                     shaped(agent.count_tokens, WireProtocol.ANTHROPIC_MESSAGES))
    routes.add_agent("GET", "/v1/models", shaped(agent.models))
    routes.add_agent("GET", "/models", shaped(agent.models))
    routes.add_agent("GET", "/v1/responses", agent.responses_websocket)
    # Claude Code probes HEAD <base>/ at start-up.
    routes.add_agent("GET,HEAD", "", agent.probe)
    routes.add_agent("GET,HEAD", "/", agent.probe)
    # Control paths (the admin token guards all but /healthz).
    guard = control.guard
    routes.add_control("GET,HEAD", "/healthz", control.healthz)
    routes.add_control("GET", "/poll", guard(control.poll))  # not HEAD: polling leases items
    routes.add_control("POST", "/respond", guard(control.respond))
    routes.add_control("POST", "/sessions", guard(control.create_session))
    routes.add_control("GET,HEAD", "/sessions", guard(control.list_sessions))
    routes.add_control("GET,HEAD", "/metrics", guard(control.metrics))
    routes.add_control("GET,HEAD", "/sampling", guard(control.sampling_state))
    routes.add_control("POST", "/sampling/pause", guard(control.pause_sampling))
    routes.add_control("POST", "/sampling/resume", guard(control.resume_sampling))
    routes.add_control("GET,HEAD", "/policy_version", guard(control.get_policy_version))
    routes.add_control("POST", "/policy_version", guard(control.set_policy_version))
    routes.add_session("GET,HEAD", "", guard(control.get_session))
    routes.add_session("DELETE", "", guard(control.delete_session))
    routes.add_session("POST", "/end", guard(control.end_session))
    routes.add_session("GET,HEAD", "/trajectory", guard(control.trajectory))
    routes.add_session("GET,HEAD", "/turns", guard(control.turns))
    return routes


def build_server(gateway: ServedGateway, limits: HttpLimits,
                 mounts: dict[str, MountHandler] | None = None) -> HttpServer:
    """The gateway's HTTP server (not yet listening)."""
    routes = build_routes(gateway, limits, mounts)

    async def dispatch(request: BaseRequest) -> StreamResponse:
        expect = request.headers.get("expect")
        if expect is not None and request.version >= (1, 1) and expect.lower() != "100-continue":
            resp = error_for_path(
                request.path, 417, f"unknown Expect: {expect!r}; only 100-continue is supported"
            )
            resp.force_close()
            return resp
        return await routes(request)

    return HttpServer(dispatch, error_for_path, limits, access_log=gateway.config.access_log)


__all__ = ["build_routes", "build_server"]
