"""Staleness: the trained tokens of a sample sampled by weights too old to train on, masked out.

In an asynchronous run a sample reaches the trainer some weight updates after it was sampled, and an
episode that went on across an update holds turns of several versions (``metadata["policy_versions"]``,
one ``[start, end, version]`` span of ``tokens`` positions per trained response). With a bound
``max_staleness = K``, a trained response whose version is older than ``current - K`` (``current``: the
version the trainer has now) is **stale**: :func:`mask_stale` gives back a copy of the sample with
those tokens' loss mask set to 0 (and their logprobs to 0.0, as everywhere the mask is 0). The tokens
stay in the sequence: the later, fresh responses were sampled after them and are trained in their
context, with the reward of the whole episode.

A response with no version (``None``) is stale whenever a bound is set and ``current`` is known: it
cannot be shown to be within the bound. With ``current`` unknown (``None``: the trainer never set a
version) nothing can be judged and nothing is masked.

The masked sample's metadata says what was done: ``stale_tokens`` (tokens masked as stale),
``stale_spans`` (their ``[start, end, version]`` spans, taken out of ``policy_versions``, which keeps
only the spans still trained: it covers exactly the tokens the loss mask trains), ``stale_turn_ids``
(taken out of ``trained_turn_ids`` likewise), ``mixed_versions`` recomputed over the spans still trained,
and ``staleness`` (``{"current": ..., "max_staleness": ...}``, the bound it was judged against).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .types import Sample

__all__ = ["check_max_staleness", "is_stale", "mask_stale"]


def check_max_staleness(max_staleness: Any) -> int | None:
    """``max_staleness`` checked: ``None`` (no bound) or a non-negative integer, else ``ValueError``."""
    if max_staleness is None:
        return None
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"max_staleness must be a non-negative integer (how many versions behind the current one a "
            f"trained token may be) or None (no bound), not {max_staleness!r}"
        )
    return int(max_staleness)


def _check_current(current: Any) -> int | None:
    if current is None:
        return None
    if isinstance(current, bool) or not isinstance(current, int) or current < 0:
        raise ValueError(
            f"current must be a non-negative integer (the trainer's policy version) or None, not {current!r}")
    return int(current)


def is_stale(version: int | None, current: int | None, max_staleness: int | None) -> bool:
    """Whether a response of ``version`` is too old to train at ``current`` (see the module docstring)."""
    bound = check_max_staleness(max_staleness)
    now = _check_current(current)
    if bound is None or now is None:
        return False
    return version is None or version < now - bound


def mask_stale(sample: Sample, current: int | None, max_staleness: int | None) -> Sample:
    """A copy of ``sample`` with its stale responses masked (see the module docstring); ``sample`` itself
    is not changed. Its tokens are shared with the copy (they are the same); mask, logprobs and metadata
    are the copy's own. Raises ``ValueError`` for a bad ``current`` or ``max_staleness``, or a sample
    whose ``policy_versions`` spans do not lie in its response."""
    bound = check_max_staleness(max_staleness)
    now = _check_current(current)
    meta = dict(sample.metadata)
    spans = [list(s) for s in meta.get("policy_versions") or []]
    trained_ids = list(meta.get("trained_turn_ids") or [])
    # trained_turn_ids and policy_versions come from the same trained turns, in the same order.
    ids = trained_ids if len(trained_ids) == len(spans) else [None] * len(spans)
    mask = sample.loss_mask.copy()
    logprobs = sample.logprobs.copy()
    start = sample.prompt_length
    kept: list[list[Any]] = []
    kept_ids: list[Any] = []
    stale: list[list[Any]] = []
    stale_ids: list[Any] = []
    stale_tokens = 0
    for span, turn_id in zip(spans, ids, strict=True):
        a, b, version = span
        if not (start <= a <= b <= start + sample.response_length):
            raise ValueError(f"policy_versions span {span} lies outside the sample's response "
                             f"[{start}, {start + sample.response_length})")
        if is_stale(version, now, bound):
            stale_tokens += int(mask[a - start : b - start].sum())
            mask[a - start : b - start] = 0
            logprobs[a - start : b - start] = 0.0
            stale.append(span)
            stale_ids.append(turn_id)
        else:
            kept.append(span)
            kept_ids.append(turn_id)
    meta["policy_versions"] = kept
    meta["mixed_versions"] = len({v for _, _, v in kept}) > 1
    if len(trained_ids) == len(spans):
        meta["trained_turn_ids"] = kept_ids
        meta["stale_turn_ids"] = stale_ids
    meta["stale_spans"] = stale
    meta["stale_tokens"] = stale_tokens
    meta["staleness"] = {"current": now, "max_staleness": bound}
    return Sample(tokens=sample.tokens, response_length=sample.response_length,
                  loss_mask=mask.astype(np.int32), logprobs=logprobs, reward=sample.reward, metadata=meta)
