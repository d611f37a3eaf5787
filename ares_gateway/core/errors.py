"""Every exception the gateway raises to its caller, in one tree, under one base.

:class:`StatusError` is the base of every error that ends as an HTTP status: it carries the
``status``, the ``message`` for whoever gets it and, for a bad request body, the ``param`` it names.
The HTTP layer's handlers raise them, and each audience's errors meet the wire in one place:
``http.agent_api.AgentAPI.in_shape`` for agents (in their protocol's shape, with
``http.render.protocol_error``) and ``http.control_api.ControlAPI.guard`` for the control API
(``http.render.control_error``).

Each maps to one HTTP status, so the in-process API and the control API (``/respond``,
``/sessions``) report the same outcomes, and an agent is told the same in its protocol's shape::

    StatusError (500)                       status + message (+ param): what every error below carries
    GatewayError (500)                      base class of the public API's errors: catch this to catch them
    all
    ├── UnknownRequestError (404)           no parked request has this id (also a LookupError)
    ├── UnknownSessionError (404)           no session has this id (also a LookupError)
    ├── AlreadyAnsweredError (409)          the request was answered before
    ├── SessionExistsError (409)            a session with this id or token exists already
    ├── RequestGoneError (410)              the agent stopped waiting: disconnected, timed out, session closed
    ├── InvalidAnswerError (400)            an answer given to ``respond`` is malformed (also a ValueError)
    ├── InvalidSessionError (400)           a session id or token that cannot be used (also a ValueError)
    ├── InvalidPolicyVersionError (400)     a policy version that is not a non-negative integer (also a
    ValueError)
    ├── PolicyVersionBackwardsError (409)   a policy version lower than the one the gateway has
    ├── TooManyParkedError (429)            a session's waiting requests (count or bytes), or all sessions'
    bytes, at their limit
    ├── GatewayClosedError (503)            the gateway is shut down
    ├── DataDirError (500)                  the data directory cannot be used (not writable, full, locked,
    corrupt)
    └── FenceError (409)                    the weight-update fence (pause / resume sampling) refused a call
        ├── SamplingPausedError (409)       pause while paused (or while a pause drains)
        ├── SamplingNotPausedError (409)    resume without a pause that returned
        ├── FencedAnswerError (409)         an answer sampled before an abort fence: dropped, re-sampled later
        ├── InvalidFenceError (400)         an unknown pause mode or a bad timeout (also a ValueError)
        └── DrainTimeoutError (504)         the drain did not finish in time; sampling resumed

Other StatusErrors live next to the code that raises them: ``policies.PolicyError`` (a policy could
not answer; 502 by default) and ``http.server.BodyError`` (a body that cannot be read: 400, 408, 413,
415). Two more, since no caller of the public API sees
them: :class:`ares_gateway.core.wire.RequestError` (also ``ares_gateway.protocols.RequestError``: an
agent's body its protocol cannot accept; the agent gets a 400 in its protocol's shape) and
:class:`ares_gateway.core.broker.RequestClosed`
(raised into an agent's handler when its request ends unanswered: timeout, session closed,
shutdown).
"""

from __future__ import annotations


class StatusError(Exception):
    """An error that becomes an HTTP status: ``status``, ``message`` (what the receiver is told, and
    what to do) and ``param`` (the field of a request body at fault, when known). Subclasses set their
    default ``status``; an instance may carry another."""

    status: int = 500
    param: str | None = None

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if param is not None:
            self.param = param


class GatewayError(StatusError):
    """Base class of every error the gateway raises to its caller."""

    status = 500


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


class InvalidPolicyVersionError(GatewayError, ValueError):
    """A policy version that is not a non-negative integer (``null``: none, where one may be omitted)."""

    status = 400


class PolicyVersionBackwardsError(GatewayError):
    """The policy version given is lower than the gateway's: versions only go up. Set the version of
    the weights now loaded, which is at least the last one set."""

    status = 409


class TooManyParkedError(GatewayError):
    """The session has as many requests (or body bytes) waiting for the policy as the gateway allows,
    or every session's waiting bodies together reach ``max_parked_bytes``; answer some first."""

    status = 429


class GatewayClosedError(GatewayError):
    """The gateway is shut down; start a new one."""

    status = 503


class DataDirError(GatewayError):
    """The data directory cannot be used: not writable, full, in use by another gateway, or not a
    gateway database. Raised at start-up; the message says which and what to do."""

    status = 500


class FenceError(GatewayError):
    """Base of the weight-update fence's errors (:meth:`Gateway.pause_sampling` /
    :meth:`Gateway.resume_sampling`, ``POST /sampling/pause`` and ``/sampling/resume``)."""

    status = 409


class SamplingPausedError(FenceError):
    """Sampling is paused (or a pause is draining) already: resume it before pausing again."""

    status = 409


class SamplingNotPausedError(FenceError):
    """Sampling is not paused, or its pause has not returned yet: pause (and wait for it) before resuming."""

    status = 409


class FencedAnswerError(FenceError):
    """An answer to a request whose generation was aborted by a weight-update fence: it was sampled
    with the old weights and is dropped; the request is re-sampled after the resume."""

    status = 409


class InvalidFenceError(FenceError, ValueError):
    """A pause that cannot be done as asked: an unknown mode or a timeout that is not a positive number."""

    status = 400


class DrainTimeoutError(FenceError):
    """The in-flight generations did not finish within the pause's timeout; sampling was resumed, so
    nothing is left paused by a pause that failed. Retry with a longer timeout, or with mode "abort"."""

    status = 504
