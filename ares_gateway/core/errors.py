"""Every exception the gateway raises to its caller, in one tree.

Each maps to one HTTP status, so the in-process API and the control API (``/respond``,
``/sessions``) report the same outcomes, and an agent is told the same in its protocol's shape::

    GatewayError (500)                      base class: catch this to catch them all
    ├── UnknownRequestError (404)           no parked request has this id (also a LookupError)
    ├── UnknownSessionError (404)           no session has this id (also a LookupError)
    ├── AlreadyAnsweredError (409)          the request was answered before
    ├── SessionExistsError (409)            a session with this id or token exists already
    ├── RequestGoneError (410)              the agent stopped waiting: disconnected, timed out, session closed
    ├── InvalidAnswerError (400)            an answer given to ``respond`` is malformed (also a ValueError)
    ├── InvalidSessionError (400)           a session id or token that cannot be used (also a ValueError)
    ├── TooManyParkedError (429)            a session has ``max_parked_per_session`` requests waiting already
    ├── GatewayClosedError (503)            the gateway is shut down
    └── DataDirError (500)                  the data directory cannot be used (not writable, full, locked, corrupt)

Two exceptions live next to the code that raises them, since no caller of the public API sees
them: :class:`ares_gateway.core.wire.RequestError` (also ``ares_gateway.protocols.RequestError``: an
agent's body its protocol cannot accept; the agent gets a 400 in its protocol's shape) and :class:`ares_gateway.core.broker.RequestClosed`
(raised into an agent's handler when its request ends unanswered: timeout, session closed,
shutdown).
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
    """A session with this id (or token) already exists; pick another, or omit it to get a fresh one."""

    status = 409


class InvalidAnswerError(GatewayError, ValueError):
    """The answer given to ``respond`` is not a completion, a native response body or an error."""

    status = 400


class InvalidSessionError(GatewayError, ValueError):
    """A session id, token or metadata that cannot be used; the message says which rule it breaks."""

    status = 400


class TooManyParkedError(GatewayError):
    """The session has as many requests waiting for the policy as the gateway allows; answer some first."""

    status = 429


class GatewayClosedError(GatewayError):
    """The gateway is shut down; start a new one."""

    status = 503


class DataDirError(GatewayError):
    """The data directory cannot be used: not writable, full, in use by another gateway, or not a
    gateway database. Raised at start-up; the message says which and what to do."""

    status = 500
