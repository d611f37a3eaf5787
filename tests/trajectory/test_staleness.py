"""Staleness masking (``trajectory.mask_stale``): responses sampled by weights more than ``max_staleness``
versions behind the trainer's are kept in the sequence with loss mask 0, and the metadata says so."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.trajectory.helpers import alternating
from trajectory import Sample, TrajectoryManager, TurnRecord, is_stale, mask_stale


def _three_versions(versions: tuple[int | None, int | None, int | None]) -> Sample:
    """One sample of three trained responses, sampled by ``versions``: outputs at [3,5), [6,7), [8,10)."""
    tm = TrajectoryManager()
    history = ["a"]
    prompt = [1, 2, 3]
    outputs = ([10, 11], [12], [13, 14])
    for i, (out, v) in enumerate(zip(outputs, versions, strict=True)):
        tm.record_turn("s", prompt_messages=alternating(*history),
                       response_message={"role": "assistant", "content": f"r{i}"},
                       turn=TurnRecord(prompt, out, [-0.5] * len(out), policy_version=v))
        history += [f"r{i}", f"u{i}"]
        prompt = prompt + out + [4 + i]
    (s,) = tm.get_trajectory("s", reward=1.0)
    return s


def test_responses_older_than_the_bound_are_masked_and_counted() -> None:
    s = _three_versions((1, 2, 3))
    assert s.metadata["policy_versions"] == [[3, 5, 1], [6, 7, 2], [8, 10, 3]]
    m = mask_stale(s, current=3, max_staleness=1)  # versions 2 and 3 are within one of 3; 1 is not
    m.check()
    assert m.loss_mask.tolist() == [0, 0, 0, 1, 0, 1, 1]
    assert m.logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, 0.0, -0.5, -0.5]
    assert m.metadata["stale_tokens"] == 2 and m.metadata["stale_spans"] == [[3, 5, 1]]
    assert m.metadata["policy_versions"] == [[6, 7, 2], [8, 10, 3]] and m.metadata["mixed_versions"] is True
    assert m.metadata["trained_turn_ids"] == [2, 3] and m.metadata["stale_turn_ids"] == [1]
    assert m.metadata["staleness"] == {"current": 3, "max_staleness": 1}
    # The spans still trained cover exactly what the mask trains.
    trained = [i + m.prompt_length for i, x in enumerate(m.loss_mask.tolist()) if x]
    assert trained == [p for a, b, _ in m.metadata["policy_versions"] for p in range(a, b)]
    # The input is untouched, the tokens shared.
    assert s.loss_mask.tolist() == [1, 1, 0, 1, 0, 1, 1] and "stale_tokens" not in s.metadata
    assert m.tokens is s.tokens and m.reward == s.reward


def test_zero_staleness_trains_only_the_current_version_and_all_stale_is_empty() -> None:
    s = _three_versions((1, 2, 3))
    m = mask_stale(s, current=3, max_staleness=0)
    assert m.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1] and m.metadata["mixed_versions"] is False
    gone = mask_stale(s, current=9, max_staleness=2)
    assert int(gone.loss_mask.sum()) == 0 and gone.metadata["stale_tokens"] == 5
    assert gone.metadata["policy_versions"] == []


def test_no_bound_or_no_current_version_masks_nothing() -> None:
    s = _three_versions((1, None, 3))
    for current, bound in ((5, None), (None, 0)):
        m = mask_stale(s, current=current, max_staleness=bound)
        assert np.array_equal(m.loss_mask, s.loss_mask) and m.metadata["stale_tokens"] == 0


def test_a_response_without_a_version_is_stale_under_a_bound() -> None:
    s = _three_versions((3, None, 3))
    m = mask_stale(s, current=3, max_staleness=5)
    assert m.metadata["stale_spans"] == [[6, 7, None]] and m.metadata["stale_tokens"] == 1
    assert is_stale(None, 3, 5) and not is_stale(None, None, 5) and not is_stale(None, 3, None)
    assert is_stale(1, 3, 1) and not is_stale(2, 3, 1)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_a_bad_bound_or_current_version_is_a_clear_error(bad: Any) -> None:
    s = _three_versions((1, 2, 3))
    with pytest.raises(ValueError, match="max_staleness must be a non-negative integer"):
        mask_stale(s, current=3, max_staleness=bad)
    with pytest.raises(ValueError, match="current must be a non-negative integer"):
        mask_stale(s, current=bad, max_staleness=1)


def test_a_span_outside_the_response_is_refused() -> None:
    s = _three_versions((1, 2, 3))
    s.metadata["policy_versions"] = [[0, 2, 1]]
    s.metadata["trained_turn_ids"] = [1]
    with pytest.raises(ValueError, match="outside the sample's response"):
        mask_stale(s, current=3, max_staleness=0)
