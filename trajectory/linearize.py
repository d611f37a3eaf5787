"""Linearization: turn a message tree into token-faithful training samples.

Every leaf's root path is a sequence of generated turns.  Each turn's link to the
previous turn on the path was fixed at record time (see :mod:`trajectory.tree`):

* ``CLEAN``: the accumulated tokens are a prefix of the turn's prompt; append.
* ``REPLACE``: the prompt drifts only inside the previous (short) response; the prompt's
  tokens replace that tail and the previous response is masked (loss 0) in this path.
* ``BREAK``: any other drift; the sample closes and a new one starts whose leading
  prompt is this turn's whole prompt.

After every turn the accumulated tokens equal that turn's prompt + output, so a sample's
tokens are simply full(last turn of the sample) and each kept turn's output sits at
``[prompt_len, prompt_len + output_len)``; no incremental splicing is needed.

Main line: of a main tree's leaves whose path extends the tree's first request (see
:attr:`trajectory.tree.Tree.first_mount`), the one whose path holds the most generated
turns (ties: the earliest leaf) is the *main line*; its samples carry
``metadata["main_line"]``. A leaf whose path does not extend the first request is
*foreign* (``metadata["foreign"]``): a conversation that does not continue the one the
session began with (a request sent by something other than the client that began it).

Dedup: a generated turn is trained (loss 1) by the main line when it keeps the turn,
else by the first sample, in leaf order, that keeps it; a path that masks it does not
claim it, so the claim passes to the next leaf that keeps it.  Samples without a
trained token are dropped.  Samples come out in leaf order whatever claimed first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .tree import BREAK, FIRST, REPLACE, Node, StoredTurn, Tree
from .types import Sample


def _path_turns(last: StoredTurn) -> list[StoredTurn]:
    out: list[StoredTurn] = []
    t: StoredTurn | None = last
    while t is not None:
        out.append(t)
        t = t.base
    out.reverse()
    return out


def _main_leaf(leaves: list[Node]) -> int:
    """Index of the leaf whose path extends the first request and holds the most turns (ties: the
    earliest); -1 when none does. Each turn's path length is counted once (iteratively, memoized)."""
    count: dict[int, int] = {}
    best, longest = -1, 0
    for i, leaf in enumerate(leaves):
        last = leaf.turn_anc
        if last is None or last.foreign:
            continue
        chain: list[StoredTurn] = []
        t: StoredTurn | None = last
        while t is not None and id(t) not in count:
            chain.append(t)
            t = t.base
        n = 0 if t is None else count[id(t)]
        for c in reversed(chain):
            n += 1
            count[id(c)] = n
        if count[id(last)] > longest:
            best, longest = i, count[id(last)]
    return best


def linearize(
    tree: Tree,
    *,
    session_id: str,
    side_call: bool,
    reward: float,
    max_sample_tokens: int = 0,
    consume: bool = False,
) -> list[Sample]:
    """All samples of ``tree``, leaves in depth-first order.

    ``max_sample_tokens > 0`` cuts each sample's tail at that many tokens; a turn whose
    output is cut away entirely is not claimed, so a later leaf can still train it.
    ``consume=True`` lets the last sample take the tree's working buffer instead of
    copying it (the tree must not be used afterwards).
    """
    leaves = tree.leaves()
    main_idx = -1 if side_call else _main_leaf(leaves)
    # The main line claims its turns first, then the other leaves in order.
    order = list(range(len(leaves)))
    if main_idx > 0:
        order.insert(0, order.pop(main_idx))
    claimed: set[int] = set()
    samples: list[Sample] = []
    # (leaf index, segment index, turns, masked seqs, trained turns) for samples to build.
    plan: list[tuple[int, int, list[StoredTurn], set[int], list[StoredTurn]]] = []
    for leaf_idx in order:
        last = leaves[leaf_idx].turn_anc
        if last is None:
            continue
        path = _path_turns(last)
        seg_start = 0
        seg_idx = 0
        n = len(path)
        for i in range(1, n + 1):
            if i < n and path[i].link != BREAK:
                continue
            seg = path[seg_start:i]
            # A turn is masked in this path when the next turn replaced its drifted tail.
            masked = {seg[j - 1].seq for j in range(1, len(seg)) if seg[j].link == REPLACE}
            start = seg[0].prompt_len
            total = seg[-1].full_len
            cut = total if max_sample_tokens <= 0 else min(total, max_sample_tokens)
            trained: list[StoredTurn] = []
            for t in seg:
                if t.seq in claimed or t.seq in masked:
                    continue
                if t.output_len == 0 or t.prompt_len >= cut:
                    continue  # nothing of it would be trained here
                trained.append(t)
                claimed.add(t.seq)
            if trained and cut > start:
                plan.append((leaf_idx, seg_idx, seg, masked, trained))
            seg_start = i
            seg_idx += 1

    plan.sort(key=lambda entry: (entry[0], entry[1]))
    for k, (leaf_idx, seg_idx, seg, masked, trained) in enumerate(plan):
        first, last = seg[0], seg[-1]
        start = first.prompt_len
        total = last.full_len
        cut = total if max_sample_tokens <= 0 else min(total, max_sample_tokens)
        full = tree.load(last)
        if consume and k == len(plan) - 1:
            # The tree is discarded after this: the last sample keeps a view of its storage
            # instead of a copy of a possibly huge sequence.
            tokens = full[:cut]
        else:
            tokens = full[:cut].copy()
        rlen = cut - start
        # int32, not int8: Python's sum() over an int8 mask wraps at 128 trained tokens.
        loss_mask = np.zeros(rlen, dtype=np.int32)
        logprobs = np.zeros(rlen, dtype=np.float32)
        # Which weights sampled each trained response: a span of token positions per turn.
        spans: list[list[int | None]] = []
        for t in trained:
            a = t.prompt_len
            b = min(t.full_len, cut)
            loss_mask[a - start : b - start] = 1
            spans.append([a, b, t.policy_version])
            if t.logprobs is not None:
                logprobs[a - start : b - start] = t.logprobs[: b - a]
        tools = sorted({name for t in seg for name in t.tools})
        meta: dict[str, Any] = {
            "session_id": session_id,
            "side_call": side_call,
            "foreign": not side_call and seg[-1].foreign,  # a side call is told apart by the harness instead
            "main_line": leaf_idx == main_idx,
            "truncated": cut < total,
            "ill_formed": any(t.ill_formed for t in seg),
            "used_tools": tools,
            "branch": leaf_idx,
            "num_branches": len(leaves),
            "segment": seg_idx,
            "start_reason": "root" if first.link == FIRST else "drift",
            "turn_ids": [t.seq for t in seg],
            "trained_turn_ids": [t.seq for t in trained],
            "masked_turn_ids": [t.seq for t in seg if t.seq in masked],
            "finish_reason": last.finish_reason,
            "rewritten": sum(
                1 for t in seg if t.node is not None and t.node.metadata and t.node.metadata.get("rewrites")
            ),
            "policy_versions": spans,
            # None (no version known) counts as a version of its own: it cannot be shown to match.
            "mixed_versions": len({v for _, _, v in spans}) > 1,
        }
        samples.append(
            Sample(
                tokens=tokens,
                response_length=rlen,
                loss_mask=loss_mask,
                logprobs=logprobs,
                reward=float(reward),
                metadata=meta,
            )
        )
    return samples
