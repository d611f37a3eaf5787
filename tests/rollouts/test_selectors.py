"""Presets and selectors: grammar, ranges named in errors, and shards that partition the dataset."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ares_gateway.episodes.selectors import (
    Preset,
    Selection,
    SelectorError,
    canonical_harness,
    parse_preset,
    parse_selector,
    resolve,
    shard_bounds,
)


@pytest.mark.parametrize(
    ("text", "dataset", "harness"),
    [
        ("examples-mswea", "examples", "mini-swe-agent"),
        ("examples-mini-swe-agent", "examples", "mini-swe-agent"),
        ("examples-claude-code", "examples", "claude-code"),
        ("examples-cc", "examples", "claude-code"),
        ("examples-codex", "examples", "codex"),
        ("examples-terminus", "examples", "terminus-2"),
        ("examples-terminus-2", "examples", "terminus-2"),
        ("terminal-bench-2-claude-code", "terminal-bench-2", "claude-code"),
        ("./my-tasks-codex", "./my-tasks", "codex"),
    ],
)
def test_presets(text: str, dataset: str, harness: str) -> None:
    assert parse_preset(text) == Preset(dataset, harness)
    assert parse_preset(text).name == f"{dataset}-{harness}"


@pytest.mark.parametrize("text", ["examples", "examples-", "-mswea", "examples-gpt", "mswea"])
def test_bad_presets_name_the_harnesses(text: str) -> None:
    with pytest.raises(SelectorError, match=r"\{dataset\}-\{harness\}.*mswea"):
        parse_preset(text)


def test_canonical_harness() -> None:
    assert canonical_harness("cc") == "claude-code"
    with pytest.raises(SelectorError, match="unknown harness 'nope'"):
        canonical_harness("nope")


@pytest.mark.parametrize(
    ("text", "selection"),
    [
        ("examples-mswea", Selection()),
        ("examples-mswea:3", Selection("index", index=3)),
        ("examples-mswea:0:10", Selection("slice", start=0, stop=10)),
        ("examples-mswea:2:", Selection("slice", start=2)),
        ("examples-mswea::2", Selection("slice", stop=2)),
        ("examples-mswea@0/8", Selection("shard", shard=0, num_shards=8)),
        ("examples-mswea@7/8", Selection("shard", shard=7, num_shards=8)),
        ("examples-mswea:fix-median-bug", Selection("names", names=("fix-median-bug",))),
        ("examples-mswea:b.2,a_1", Selection("names", names=("b.2", "a_1"))),
    ],
)
def test_selector_grammar(text: str, selection: Selection) -> None:
    sel = parse_selector(text)
    assert sel.name == "examples-mswea" and sel.selection == selection
    assert str(sel) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty selector"),
        ("examples:", "cannot read selector"),
        ("examples:1,2", "cannot read selector"),
        ("examples:a,a", "names a task twice"),
        ("examples:a b", "cannot read selector"),
        ("examples:-1", "cannot read selector"),
        ("examples:01", "cannot read selector"),
        ("examples:1:2:3", "cannot read selector"),
        ("examples@1", "cannot read selector"),
        ("examples@1/", "cannot read selector"),
        ("examples@-1/4", "cannot read selector"),
        ("examples:3@1/2", "cannot read selector"),
        ("examples@8/8", r"shard 8 is out of range: shards are 0\.\.7 \(0-based\)"),
        ("examples@0/0", "at least 1"),
        ("examples:5:5", "selects no task"),
        ("examples:6:2", "selects no task"),
    ],
)
def test_malformed_selectors(text: str, message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        parse_selector(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x:4", r"task index 4 is out of range: valid task indices are 0\.\.3"),
        ("x:4:", r"slice start 4 is out of range: valid task indices are 0\.\.3"),
        ("x:0:5", r"slice stop 5 is out of range: it must be in 1\.\.4"),
    ],
)
def test_out_of_range_fails_at_parse_time_with_the_valid_range(text: str, message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        parse_selector(text, size=4)
    parse_selector(text, size=10)  # the same text is fine for a bigger dataset


def test_resolve_examples() -> None:
    r = resolve("examples-mswea")
    assert r.preset == Preset("examples", "mini-swe-agent")
    assert [t.name for t in r.tasks] == r.dataset.names and len(r.tasks) == 4
    assert [t.name for t in resolve("examples-cc:1").tasks] == [r.dataset.names[1]]
    assert [t.name for t in resolve("examples-codex:1:3").tasks] == r.dataset.names[1:3]
    shards = [resolve(f"examples-terminus@{i}/3").tasks for i in range(3)]
    assert [len(s) for s in shards] == [2, 1, 1]
    assert [t for s in shards for t in s] == list(r.tasks)
    with pytest.raises(SelectorError, match=r"on dataset 'examples'.*valid task indices are 0\.\.3"):
        resolve("examples-mswea:9")


def test_resolve_tasks_by_name() -> None:
    assert [t.name for t in resolve("examples-mswea:fix-median-bug").tasks] == ["fix-median-bug"]
    picked = resolve("examples-cc:write-greeting-file,fix-median-bug").tasks
    assert [t.name for t in picked] == ["write-greeting-file", "fix-median-bug"]  # in the order given
    with pytest.raises(SelectorError, match=r"no task named 'nope': the tasks are fix-median-bug, .*0\.\.3"):
        resolve("examples-mswea:nope")


@given(size=st.integers(0, 300), num_shards=st.integers(1, 64))
def test_shards_partition_the_dataset(size: int, num_shards: int) -> None:
    items = list(range(size))
    shards = [parse_selector(f"d@{i}/{num_shards}").selection.apply(items) for i in range(num_shards)]
    # Contiguous, in order, every item exactly once.
    assert [x for s in shards for x in s] == items
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    # Deterministic, and the bigger shards come first.
    assert sizes == sorted(sizes, reverse=True)
    assert shards == [Selection("shard", shard=i, num_shards=num_shards).apply(items)
                      for i in range(num_shards)]


@given(size=st.integers(1, 200), data=st.data())
def test_slices_and_indices_match_python(size: int, data: st.DataObject) -> None:
    items = list(range(size))
    i = data.draw(st.integers(0, size - 1))
    assert parse_selector(f"d:{i}", size=size).selection.apply(items) == [items[i]]
    start = data.draw(st.integers(0, size - 1))
    stop = data.draw(st.integers(start + 1, size))
    assert parse_selector(f"d:{start}:{stop}", size=size).selection.apply(items) == items[start:stop]


def test_shard_bounds_rejects_out_of_range() -> None:
    assert shard_bounds(10, 0, 3) == (0, 4)
    assert shard_bounds(2, 4, 5) == (2, 2)  # more shards than tasks: the last ones are empty
    with pytest.raises(SelectorError, match=r"shards are 0\.\.2"):
        shard_bounds(10, 3, 3)
