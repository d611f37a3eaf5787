"""Presets (``{dataset}-{harness}``) and selectors (which tasks of a dataset to run).

Selector grammar, after a preset or dataset name::

    examples-mswea            every task
    examples-mswea:5          task 5 only (0-based)
    examples-mswea:fix-median-bug          the task of that name (``:a,b`` for several, in that order)
    examples-mswea:0:10       tasks 0..9 (a slice; START or STOP may be left out: ``:3:``, ``::4``)
    examples-mswea@2/8        shard 2 of 8

Indices, slices and shards are **0-based** like Python's: shard ``i/n`` takes ``i`` in ``0..n-1``.
Shards are contiguous and deterministic, their sizes differ by at most one (the first
``len % n`` shards hold one more), and shards ``0..n-1`` together cover every task exactly once.
When ``n`` exceeds the number of tasks the last shards are empty (so a fixed pool of workers can
always shard a small dataset).

A selector that is not a number, a slice or a shard names tasks (``Task.name``, the task's directory
name); a name the dataset does not have raises :class:`SelectorError` listing the names it has.

Malformed text and out-of-range numbers raise :class:`SelectorError` naming the valid range; with a
dataset size (``parse_selector(text, size=N)`` or :func:`resolve`), that happens before anything runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from ares_gateway.episodes.tasks import Dataset, Task, load_dataset

T = TypeVar("T")

#: Canonical harness names, and the aliases presets may use for them.
HARNESSES: tuple[str, ...] = ("mini-swe-agent", "claude-code", "codex", "terminus-2", "tiny-agent")
_ALIASES: dict[str, str] = {
    "mini-swe-agent": "mini-swe-agent",
    "mswea": "mini-swe-agent",
    "claude-code": "claude-code",
    "cc": "claude-code",
    "codex": "codex",
    "terminus-2": "terminus-2",
    "terminus": "terminus-2",
    "tiny-agent": "tiny-agent",
    "tiny": "tiny-agent",
}


class SelectorError(ValueError):
    """A preset or selector that cannot be used; the message says what is valid."""


def register_harness(name: str, *aliases: str) -> None:
    """Make ``name`` (and its ``aliases``) usable in presets (for harnesses added later)."""
    for key in (name, *aliases):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", key):
            raise ValueError(f"harness name {key!r} must be lower-case letters, digits, '.' or '-'")
        _ALIASES[key] = name


def harness_aliases() -> dict[str, str]:
    """Every name a preset may use for a harness -> the harness's canonical name."""
    return dict(_ALIASES)


def canonical_harness(name: str) -> str:
    """The canonical name of a harness or alias (``mswea`` -> ``mini-swe-agent``)."""
    try:
        return _ALIASES[name]
    except KeyError:
        raise SelectorError(
            f"unknown harness {name!r}: use one of {', '.join(sorted(_ALIASES))}"
        ) from None


@dataclass(frozen=True)
class Preset:
    """A dataset x harness pair, written ``{dataset}-{harness}``."""

    dataset: str
    harness: str

    @property
    def name(self) -> str:
        return f"{self.dataset}-{self.harness}"

    def __str__(self) -> str:
        return self.name


def parse_preset(text: str) -> Preset:
    """``examples-mswea`` -> ``Preset("examples", "mini-swe-agent")``.

    The harness is the longest known harness name or alias the text ends with (after a ``-``), so
    dataset names may contain hyphens (``terminal-bench-claude-code``). The dataset part may also be a
    directory path (``./my-tasks-codex``).
    """
    for alias in sorted(_ALIASES, key=len, reverse=True):
        suffix = "-" + alias
        if text.endswith(suffix) and len(text) > len(suffix):
            return Preset(text[: -len(suffix)], _ALIASES[alias])
    raise SelectorError(
        f"cannot read preset {text!r}: presets are {{dataset}}-{{harness}} (e.g. examples-mswea) with the "
        f"harness one of {', '.join(sorted(_ALIASES))}"
    )


# ============================================================================ selections


@dataclass(frozen=True)
class Selection:
    """Which tasks of a dataset: all, one index, a slice, a shard, or tasks by name."""

    kind: Literal["all", "index", "slice", "shard", "names"] = "all"
    index: int | None = None
    start: int | None = None
    stop: int | None = None
    shard: int | None = None
    num_shards: int | None = None
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.kind == "names":
            return ":" + ",".join(self.names)
        if self.kind == "index":
            return f":{self.index}"
        if self.kind == "slice":
            return f":{'' if self.start is None else self.start}:{'' if self.stop is None else self.stop}"
        if self.kind == "shard":
            return f"@{self.shard}/{self.num_shards}"
        return ""

    def validate(self, size: int) -> None:
        """Raise :class:`SelectorError` naming the valid range when this selection does not fit ``size`` tasks
        (names are checked by :meth:`apply`, which sees them)."""
        if self.kind == "index":
            assert self.index is not None
            if not 0 <= self.index < size:
                raise SelectorError(f"task index {self.index} is out of range: {_range_text(size)}")
        elif self.kind == "slice":
            start, stop = self.bounds(size)
            if self.start is not None and not 0 <= self.start < size:
                raise SelectorError(f"slice start {self.start} is out of range: {_range_text(size)}")
            if self.stop is not None and not 0 < self.stop <= size:
                raise SelectorError(
                    f"slice stop {self.stop} is out of range: it must be in 1..{size} (exclusive end) "
                    f"for a dataset of {size} task{'s' if size != 1 else ''}"
                    if size
                    else f"slice stop {self.stop} is out of range: the dataset has no tasks"
                )
            if start >= stop:
                raise SelectorError(
                    f"slice {self} selects no task: START must be below STOP ({_range_text(size)})")

    def bounds(self, size: int) -> tuple[int, int]:
        """The ``[start, stop)`` range this selection takes from ``size`` tasks (call :meth:`validate`
        first)."""
        if self.kind == "index":
            assert self.index is not None
            return self.index, self.index + 1
        if self.kind == "slice":
            return (self.start or 0), (size if self.stop is None else self.stop)
        if self.kind == "shard":
            assert self.shard is not None and self.num_shards is not None
            return shard_bounds(size, self.shard, self.num_shards)
        return 0, size

    def apply(self, items: Sequence[T]) -> list[T]:
        """The selected items, in order. Raises :class:`SelectorError` when out of range (or, for
        names, when an item of that ``name`` is missing)."""
        if self.kind == "names":
            by_name = {getattr(item, "name", None): item for item in items}
            missing = [n for n in self.names if n not in by_name]
            if missing:
                have = ", ".join(str(k) for k in by_name) or "none"
                raise SelectorError(
                    f"no task named {', '.join(repr(m) for m in missing)}: the tasks are {have} "
                    f"(or select by 0-based index: {_range_text(len(items))})"
                )
            return [by_name[n] for n in self.names]
        self.validate(len(items))
        start, stop = self.bounds(len(items))
        return list(items[start:stop])


def _range_text(size: int) -> str:
    if size == 0:
        return "the dataset has no tasks"
    return (f"valid task indices are 0..{size - 1} (0-based; the dataset has {size} "
            f"task{'s' if size != 1 else ''})")


def shard_bounds(size: int, shard: int, num_shards: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``shard`` (0-based) of ``num_shards`` over ``size`` items.

    The first ``size % num_shards`` shards hold ``size // num_shards + 1`` items, the rest one fewer.
    """
    if num_shards < 1:
        raise SelectorError(f"the number of shards must be at least 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise SelectorError(
            f"shard {shard} is out of range: shards are 0..{num_shards - 1} (0-based) for /{num_shards}")
    base, extra = divmod(size, num_shards)
    start = shard * base + min(shard, extra)
    return start, start + base + (1 if shard < extra else 0)


@dataclass(frozen=True)
class Selector:
    """A parsed ``NAME[:I | :START:STOP | @I/N]``: the name (a preset or dataset) and the selection."""

    name: str
    selection: Selection = Selection()

    def __str__(self) -> str:
        return f"{self.name}{self.selection}"


_INT = r"(?:0|[1-9][0-9]*)"
#: A task name (all digits are refused: ``01`` is no index, and no task is meant by it).
_TASK = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_SELECTOR_RE = re.compile(
    rf"(?P<name>[^:@]+?)(?:"
    rf"(?P<shard>@(?P<i>{_INT})/(?P<n>{_INT}))"
    rf"|:(?P<index>{_INT})"
    rf"|:(?P<start>{_INT})?:(?P<stop>{_INT})?"
    rf"|:(?P<names>{_TASK}(?:,{_TASK})*)"
    rf")?"
)
_HELP = (
    "use NAME (all tasks), NAME:I (one task), NAME:START:STOP (a slice), NAME@I/N (shard I of N), "
    "with 0-based non-negative integers, or NAME:TASK[,TASK...] (tasks by name)"
)


def parse_selector(text: str, *, size: int | None = None) -> Selector:
    """Parse ``NAME[:I | :START:STOP | @I/N]``; with ``size`` (the dataset's length), check the range too."""
    if not isinstance(text, str) or not text.strip():
        raise SelectorError(f"empty selector: {_HELP}")
    m = _SELECTOR_RE.fullmatch(text.strip())
    if m is None:
        raise SelectorError(f"cannot read selector {text!r}: {_HELP}")
    name = m.group("name")
    if m.group("shard"):
        i, n = int(m.group("i")), int(m.group("n"))
        if n < 1:
            raise SelectorError(f"selector {text!r}: the number of shards must be at least 1")
        if i >= n:
            raise SelectorError(
                f"selector {text!r}: shard {i} is out of range: shards are 0..{n - 1} (0-based) for /{n}")
        selection = Selection("shard", shard=i, num_shards=n)
    elif m.group("names") is not None:
        names = tuple(m.group("names").split(","))
        if any(n.isdigit() for n in names):  # 01, 1,2: numbers that are no index
            raise SelectorError(f"cannot read selector {text!r}: {_HELP}")
        if len(set(names)) != len(names):
            raise SelectorError(f"selector {text!r} names a task twice")
        selection = Selection("names", names=names)
    elif m.group("index") is not None:
        selection = Selection("index", index=int(m.group("index")))
    elif m.group("start") is not None or m.group("stop") is not None or text.strip().endswith("::"):
        start = m.group("start")
        stop = m.group("stop")
        selection = Selection(
            "slice", start=int(start) if start is not None else None,
            stop=int(stop) if stop is not None else None
        )
        if selection.start is not None and selection.stop is not None and selection.start >= selection.stop:
            raise SelectorError(f"selector {text!r} selects no task: START must be below STOP")
    else:
        selection = Selection()
    if size is not None:
        try:
            selection.validate(size)
        except SelectorError as exc:
            raise SelectorError(f"selector {text!r}: {exc}") from None
    return Selector(name, selection)


# ============================================================================ resolving


@dataclass(frozen=True)
class Resolved:
    """A run target, checked: the preset, its dataset, and the selected tasks."""

    selector: Selector
    preset: Preset
    dataset: Dataset
    tasks: tuple[Task, ...]


def resolve(text: str, *, datasets: Mapping[str, Dataset] | None = None) -> Resolved:
    """Parse ``PRESET[:I|:START:STOP|@I/N]``, load the dataset, and select its tasks.

    ``datasets`` (name -> :class:`Dataset`) takes precedence over the registry (for tests and callers
    that already loaded them). Raises :class:`SelectorError` for bad presets / selectors and
    :class:`~ares_gateway.episodes.tasks.TaskError` for datasets that cannot be loaded.
    """
    selector = parse_selector(text)
    preset = parse_preset(selector.name)
    dataset = (datasets or {}).get(preset.dataset) or load_dataset(preset.dataset)
    try:
        tasks = selector.selection.apply(dataset.tasks)
    except SelectorError as exc:
        raise SelectorError(f"selector {text!r} on dataset {dataset.name!r}: {exc}") from None
    return Resolved(selector, preset, dataset, tuple(tasks))
