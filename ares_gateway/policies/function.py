"""In-process policies: any callable ``request -> completion`` (how a Python trainer plugs in without
HTTP)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ares_gateway.policies.base import PolicyAnswer, PolicyRequest, call_policy, canonical_of


class FunctionPolicy:
    """Wrap a callable as a :class:`~ares_gateway.policies.base.Policy`.

    ``fn`` may be an ``async def`` (returning a Completion, an ErrorAnswer, a string or a native
    response dict), an async generator function (yielding CompletionDelta items, then a Completion),
    or a plain function (run on the event loop: keep it quick). With ``canonical=True`` it receives
    the :class:`~ares_gateway.CanonicalRequest` instead of the :class:`~ares_gateway.ParkedRequest`
    (which also carries the session id, protocol and side-call flag).
    """

    def __init__(self, fn: Callable[[Any], Any], *, canonical: bool = False, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionPolicy needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.canonical = canonical
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)

    def __repr__(self) -> str:
        return f"FunctionPolicy({self.name})"

    async def __call__(self, request: PolicyRequest, /) -> PolicyAnswer:
        arg = canonical_of(request) if self.canonical else request
        return await call_policy(self.fn, arg)


def as_policy(obj: Any, *, canonical: bool = False) -> Any:
    """``obj`` if it is already a policy object (has ``__call__`` and is not a bare function), else a
    :class:`FunctionPolicy` around it."""
    if inspect.isfunction(obj) or inspect.ismethod(obj) or canonical:
        return FunctionPolicy(obj, canonical=canonical)
    return obj
