"""Harnesses by name: ``claude-code``, ``codex``, ``mini-swe-agent``, ``terminus-2``, plus your own.

>>> from harnesses import registry
>>> registry.register("my-agent", MyHarness)          # a BaseHarness subclass (or any factory)
>>> harness = registry.create("codex", version="0.171.0")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import BaseHarness

HarnessFactory = Callable[..., BaseHarness]
_REGISTRY: dict[str, HarnessFactory] = {}


def register(name: str, factory: HarnessFactory, *, replace: bool = False) -> None:
    """Make ``create(name)`` build a harness with ``factory(**options)``."""
    if not name or not isinstance(name, str):
        raise ValueError("a harness name must be a non-empty string")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not factory:
        raise ValueError(f"a harness named {name!r} is already registered (pass replace=True to override)")
    _REGISTRY[name] = factory


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    return sorted(_REGISTRY)


def get_class(name: str) -> HarnessFactory:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no harness named {name!r}; registered: {', '.join(names())}") from None


def create(name: str, **options: Any) -> BaseHarness:
    """A new harness instance of the registered ``name``."""
    return get_class(name)(**options)


def _register_builtins() -> None:
    from .claude_code import ClaudeCodeHarness
    from .codex import CodexHarness
    from .mini_swe_agent import MiniSweAgentHarness
    from .terminus2 import Terminus2Harness
    from .tiny_agent import TinyAgentHarness

    for cls in (ClaudeCodeHarness, CodexHarness, MiniSweAgentHarness, Terminus2Harness, TinyAgentHarness):
        register(cls.name, cls, replace=True)


_register_builtins()
