"""Samples say which weights sampled each trained response: ``metadata["policy_versions"]`` spans and
``metadata["mixed_versions"]``, from each turn's ``TurnRecord.policy_version``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trajectory.helpers import alternating
from trajectory import TrajectoryManager, TurnRecord


def _record(tm: TrajectoryManager, history: list[str], reply: str, prompt: list[int], output: list[int],
            version: int | None) -> None:
    tm.record_turn("s", prompt_messages=alternating(*history),
                   response_message={"role": "assistant", "content": reply},
                   turn=TurnRecord(prompt, output, [-0.5] * len(output), policy_version=version))


def test_each_trained_response_is_a_span_with_its_version() -> None:
    tm = TrajectoryManager()
    _record(tm, ["a"], "r1", [1, 2, 3], [10, 11], 1)
    _record(tm, ["a", "r1", "b"], "r2", [1, 2, 3, 10, 11, 4], [12], 2)
    _record(tm, ["a", "r1", "b", "r2", "c"], "r3", [1, 2, 3, 10, 11, 4, 12, 5], [13, 14], 2)
    (s,) = tm.get_trajectory("s")
    assert s.metadata["policy_versions"] == [[3, 5, 1], [6, 7, 2], [8, 10, 2]]
    assert s.metadata["mixed_versions"] is True
    # Every span covers exactly the tokens the loss mask trains.
    trained = [i + s.prompt_length for i, m in enumerate(s.loss_mask.tolist()) if m]
    assert trained == [p for a, b, _ in s.metadata["policy_versions"] for p in range(a, b)]


def test_one_version_or_none_is_not_mixed_and_none_is_not_zero() -> None:
    for version in (0, None):
        tm = TrajectoryManager()
        _record(tm, ["a"], "r1", [1, 2], [10], version)
        _record(tm, ["a", "r1", "b"], "r2", [1, 2, 10, 3], [11], version)
        (s,) = tm.get_trajectory("s")
        assert s.metadata["policy_versions"] == [[2, 3, version], [4, 5, version]]
        assert s.metadata["mixed_versions"] is False


def test_a_masked_response_does_not_count_towards_mixed() -> None:
    tm = TrajectoryManager()
    _record(tm, ["a"], "r1", [1, 2, 3], [10, 11], 1)
    # The next prompt drifts inside the short first response: that response is masked on this path.
    _record(tm, ["a", "r1", "b"], "r2", [1, 2, 3, 10, 99, 4], [12], 2)
    (s,) = tm.get_trajectory("s")
    assert s.metadata["masked_turn_ids"] == [1]
    assert s.metadata["policy_versions"] == [[6, 7, 2]] and s.metadata["mixed_versions"] is False


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3"])
def test_a_version_must_be_a_non_negative_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match="policy_version"):
        TurnRecord([1], [2], policy_version=bad)
