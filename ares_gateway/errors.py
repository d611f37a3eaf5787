"""Exceptions raised by the gateway's public API.

Each maps to one HTTP status on the policy-facing surface, so the in-process
API and ``/respond`` report the same outcomes.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class of every error the gateway raises to its caller."""

    status: int = 500


class UnknownRequestError(GatewayError, LookupError):
    """No parked request has this id (never existed, or forgotten long ago). Check the id you polled."""

    status = 404


class AlreadyAnsweredError(GatewayError):
    """The request was already answered; a request is answered exactly once."""

    status = 409


class RequestGoneError(GatewayError):
    """The agent is no longer waiting: it disconnected, the request timed out, or its session closed."""

    status = 410


class UnknownSessionError(GatewayError, LookupError):
    """No session has this id. Create one with ``create_session()`` or ``POST /sessions`` first."""

    status = 404


class SessionExistsError(GatewayError):
    """A session with this id already exists; pick another id or omit it to get a fresh one."""

    status = 409


class InvalidAnswerError(GatewayError, ValueError):
    """The answer given to ``respond`` is not a completion, a native response body or an error."""

    status = 400


class GatewayClosedError(GatewayError):
    """The gateway is shut down; start a new one."""

    status = 503
