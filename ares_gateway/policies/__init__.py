"""Policies: who answers the agents' LLM requests.

* :class:`UpstreamPolicy` (``upstream``): forward to an OpenAI-compatible server, token-faithful.
* :class:`HttpPolicy` (``http``): leave requests parked for an external trainer on ``/poll``.
* :class:`~ares_gateway.policies.tito.TitoPolicy` (``tito``): token in / token out through an engine
  (in-process llama.cpp, SGLang, vLLM); the gateway renders and parses (``docs/tito.md``).
* :class:`FunctionPolicy`: any async callable ``request -> completion``, in process.

:class:`PolicyServer` serves a :class:`~ares_gateway.Gateway` with a policy under bounded concurrency.
What an episode asks of a policy beyond answering is declared: :class:`SessionBound` (bound to each
episode's session, agent and task), :class:`EpisodeReporter` (a per-episode report),
:class:`ExternalPolicy` (answers outside the process).
:func:`make_policy` builds one by name; :func:`register_policy` adds names. ``scripted`` / ``oracle``
(:class:`SessionScriptedPolicy`) play fixed scripts or a task's solution in each agent's action format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ares_gateway.policies.base import (
    EpisodeReporter,
    ExternalPolicy,
    Policy,
    PolicyAnswer,
    PolicyError,
    PolicyRequest,
    PolicyServer,
    ServeStats,
    SessionBound,
    call_policy,
    canonical_of,
    is_external,
    serve,
)
from ares_gateway.policies.function import FunctionPolicy, as_policy
from ares_gateway.policies.http import HttpPolicy
from ares_gateway.policies.scripted import SessionScriptedPolicy, make_oracle, make_scripted
from ares_gateway.policies.upstream import Prices, UpstreamConfig, UpstreamError, UpstreamPolicy, UsageTotals


def _make_tito(**options: Any) -> Any:
    # Imported on use: the tito policy needs the optional ``model`` extra (renderers, tokenizers).
    from ares_gateway.policies.tito import TitoPolicy

    return TitoPolicy(**options)


_FACTORIES: dict[str, Callable[..., Any]] = {
    "upstream": UpstreamPolicy,
    "tito": _make_tito,
    "http": lambda **options: HttpPolicy(**options),
    "scripted": make_scripted,
    "oracle": make_oracle,
}


def register_policy(name: str, factory: Callable[..., Any], *, replace: bool = False) -> None:
    """Make ``make_policy(name, **options)`` call ``factory(**options)``."""
    if name in _FACTORIES and not replace:
        raise ValueError(f"policy {name!r} is already registered; pass replace=True to change it")
    _FACTORIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def make_policy(name: str, **options: Any) -> Any:
    """A policy by name (``upstream``, ``http``, or a registered one) built with ``options``."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}: use one of {', '.join(policy_names())}") from None
    return factory(**options)


__all__ = [
    "EpisodeReporter",
    "ExternalPolicy",
    "FunctionPolicy",
    "HttpPolicy",
    "Policy",
    "PolicyAnswer",
    "PolicyError",
    "PolicyRequest",
    "PolicyServer",
    "Prices",
    "ServeStats",
    "SessionBound",
    "SessionScriptedPolicy",
    "UpstreamConfig",
    "UpstreamError",
    "UpstreamPolicy",
    "UsageTotals",
    "as_policy",
    "call_policy",
    "canonical_of",
    "is_external",
    "make_policy",
    "policy_names",
    "register_policy",
    "serve",
]
