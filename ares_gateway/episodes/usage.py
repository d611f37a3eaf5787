"""Per-call usage and timing summed over an episode's turns, and over a run's episodes.

Each turn-log entry's ``usage`` (:mod:`ares_gateway.core.record_codec`) holds its prompt, completion and
reused prompt tokens and its seconds parked, with the policy, to a stream's first piece and of the
agent's thinking before it, each ``None`` where not known. A sum counts the turns that know the
field and is ``None`` when none does (never 0 for "not known").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ares_gateway.core.record_codec import USAGE_KEYS

__all__ = ["USAGE_FIELDS", "episode_usage", "run_usage"]

#: The summed fields, as the turn log names them.
USAGE_FIELDS: tuple[str, ...] = tuple(USAGE_KEYS)


def _sum(values: Iterable[Mapping[str, Any] | None]) -> dict[str, int | float | None]:
    out: dict[str, int | float | None] = dict.fromkeys(USAGE_FIELDS)
    for use in values:
        if not isinstance(use, Mapping):
            continue
        for name in USAGE_FIELDS:
            v = use.get(name)
            if isinstance(v, int | float) and not isinstance(v, bool):
                got = out[name]
                out[name] = v if got is None else got + v
    for name, v in out.items():
        if isinstance(v, float):
            out[name] = round(v, 6)
    return out


def episode_usage(turns: Iterable[Mapping[str, Any]]) -> dict[str, int | float | None]:
    """An episode's usage: each field summed over its turn-log entries (``None``: no turn knows it)."""
    return _sum(t.get("usage") for t in turns)


def run_usage(usages: Iterable[Mapping[str, Any] | None]) -> dict[str, int | float | None]:
    """A run's usage: each field summed over its episodes' :func:`episode_usage` (``None``: none knows it)."""
    return _sum(usages)
