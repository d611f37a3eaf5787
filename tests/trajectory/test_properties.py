"""Property tests: random sessions with random token drift against a direct reference model.

The reference keeps its own message tree and linearizes with plain lists, applying the
rules of docs/trajectory.md literally (accumulate, compare prefixes, replace or close).  The
implementation must produce exactly the same samples, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajectory import TrajectoryManager, TurnRecord
from trajectory._tokens import common_prefix_len

from .helpers import check_sample

OPEN = {"system": 1, "user": 2, "tool": 3}
CLOSE = {"system": 11, "user": 12, "tool": 13}
GEN, END = 20, 21

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class RNode:
    message: dict[str, Any] | None
    tokens: list[int]  # how a clean replay renders this message
    parent: RNode | None
    children: list[RNode] = field(default_factory=list)
    turn: RTurn | None = None
    #: On the root: where the session's first request mounted.
    first_mount: RNode | None = None


@dataclass
class RTurn:
    seq: int
    prompt: list[int]
    output: list[int]
    logprobs: list[float] | None


def path_of(node: RNode) -> list[RNode]:
    out = []
    n: RNode | None = node
    while n is not None and n.parent is not None:
        out.append(n)
        n = n.parent
    return out[::-1]


def reference_samples(root: RNode, threshold: int, max_tokens: int) -> list[dict[str, Any]]:
    leaves = []
    stack = [root]
    while stack:
        n = stack.pop()
        if n.children:
            stack.extend(reversed(n.children))
        elif n is not root:
            leaves.append(n)
    claimed: set[int] = set()
    out: list[tuple[int, dict[str, Any]]] = []
    # The main line: the leaf through the first request's mount with the most turns (ties: the
    # earliest); it claims its turns first, the samples still come out in leaf order.
    turn_counts = [
        len([n for n in path_of(leaf) if n.turn is not None]) if root.first_mount in path_of(leaf) else 0
        for leaf in leaves
    ]
    main = max(range(len(leaves)), key=lambda i: (turn_counts[i], -i), default=-1)
    order = list(range(len(leaves)))
    if main > 0 and turn_counts[main]:
        order.insert(0, order.pop(main))
    for leaf_idx in order:
        leaf = leaves[leaf_idx]
        turns = [n.turn for n in path_of(leaf) if n.turn is not None]
        segments: list[tuple[list[int], int, list[RTurn]]] = []  # (tokens, prompt_len, turns)
        masked: set[int] = set()
        acc: list[int] | None = None
        prev: RTurn | None = None
        seg_turns: list[RTurn] = []
        start = 0
        for t in turns:
            if acc is None or prev is None:
                acc, start, seg_turns = list(t.prompt), len(t.prompt), [t]
            elif t.prompt[: len(acc)] == acc:  # clean continuation
                acc = list(t.prompt)
                seg_turns.append(t)
            elif (
                len(t.prompt) >= len(prev.prompt)
                and t.prompt[: len(prev.prompt)] == prev.prompt
                and len(prev.output) < threshold
            ):  # drift inside the latest (short) response: replace, mask it
                masked.add(prev.seq)
                acc = list(t.prompt)
                seg_turns.append(t)
            else:  # any other drift: close, start again
                segments.append((acc, start, seg_turns))
                acc, start, seg_turns = list(t.prompt), len(t.prompt), [t]
            acc = acc + t.output
            prev = t
        if acc is not None:
            segments.append((acc, start, seg_turns))
        for tokens, start, seg in segments:
            cut = len(tokens) if max_tokens <= 0 else min(len(tokens), max_tokens)
            mask = [0] * max(0, cut - start)
            lps = [0.0] * max(0, cut - start)
            trained = []
            for t in seg:
                a = len(t.prompt)
                if t.seq in claimed or t.seq in masked or not t.output or a >= cut:
                    continue
                claimed.add(t.seq)
                trained.append(t.seq)
                for k in range(a, min(a + len(t.output), cut)):
                    mask[k - start] = 1
                    lps[k - start] = t.logprobs[k - a] if t.logprobs else 0.0
            if trained:
                out.append(
                    (leaf_idx, {
                        "tokens": tokens[:cut],
                        "response_length": cut - start,
                        "loss_mask": mask,
                        "logprobs": lps,
                        "trained": trained,
                        "turns": [t.seq for t in seg],
                        "masked": [t.seq for t in seg if t.seq in masked],
                        "main_line": leaf_idx == main and turn_counts[main] > 0,
                        "foreign": root.first_mount not in path_of(leaf),
                    })
                )
    return [entry for _, entry in sorted(out, key=lambda e: e[0])]


@st.composite
def sessions(draw: st.DrawFn) -> tuple[list[dict[str, Any]], RNode, int, int]:
    """A random session: a list of record_turn calls plus the reference tree."""
    threshold = draw(st.sampled_from([0, 2, 3, 5, 1024]))
    max_tokens = draw(st.sampled_from([0, 0, 0, 6, 15, 40]))
    root = RNode(None, [], None)
    nodes = [root]
    calls: list[dict[str, Any]] = []
    fresh = iter(range(1000, 10**6))
    n_turns = draw(st.integers(1, 10))
    for seq in range(1, n_turns + 1):
        at = draw(st.sampled_from(nodes))
        n_new = draw(st.integers(1 if at is root else 0, 2))
        cur = at
        for _ in range(n_new):
            role = draw(st.sampled_from(["system", "user", "tool"]))
            body = next(fresh)
            msg = {"role": role, "content": f"m{body}"}
            child = RNode(msg, [OPEN[role], body, CLOSE[role]], cur)
            cur.children.append(child)
            nodes.append(child)
            cur = child
        prompt_nodes = path_of(cur)
        if root.first_mount is None:
            root.first_mount = cur
        prompt = [tok for n in prompt_nodes for tok in n.tokens] + [GEN]
        # Random drift: substitute, insert or delete a token somewhere in the prompt.
        drift = draw(st.sampled_from(["none", "none", "sub", "ins", "del"]))
        if drift != "none" and len(prompt) > 1:
            pos = draw(st.integers(0, len(prompt) - 2))
            if drift == "sub":
                prompt[pos] = next(fresh)
            elif drift == "ins":
                prompt.insert(pos, next(fresh))
            else:
                del prompt[pos]
        empty = draw(st.integers(0, 9)) == 0
        if empty:
            output: list[int] = []
            logprobs = None
            reply = None
        else:
            body = next(fresh)
            n_out = draw(st.integers(0, 3))
            output = [*[body, *(next(fresh) for _ in range(max(0, n_out - 1)))][:n_out], END]
            logprobs = None if draw(st.booleans()) else [-(k + 1) / 16 for k in range(len(output))]
            reply = {"role": "assistant", "content": f"r{body}"}
            rnode = RNode(reply, [GEN, *output], cur)
            rnode.turn = RTurn(seq, list(prompt), output, logprobs)
            cur.children.append(rnode)
            nodes.append(rnode)
        calls.append(
            {
                "prompt_messages": [dict(n.message) for n in prompt_nodes if n.message is not None],
                "response_message": None if reply is None else dict(reply),
                "turn": (list(prompt), output, logprobs or []),
            }
        )
    return calls, root, threshold, max_tokens


@PROPS
@given(sessions(), st.booleans())
def test_random_sessions_match_reference(session: Any, as_arrays: bool) -> None:
    calls, root, threshold, max_tokens = session
    tm = TrajectoryManager(fork_threshold_tokens=threshold)
    for c in calls:
        p, o, lp = c["turn"]
        if as_arrays:
            p, o = np.asarray(p, dtype=np.int32), np.asarray(o, dtype=np.int64)
        tm.record_turn(
            "sid",
            prompt_messages=c["prompt_messages"],
            response_message=c["response_message"],
            turn=TurnRecord(p, o, lp),
        )
    assert tm.turn_count("sid") == len(calls)
    got = tm.get_trajectory("sid", max_sample_tokens=max_tokens)
    want = reference_samples(root, threshold, max_tokens)
    for s in got:
        check_sample(s)
    assert [
        (s.tokens.tolist(), s.response_length, s.loss_mask.tolist(), s.logprobs.tolist()) for s in got
    ] == [(w["tokens"], w["response_length"], w["loss_mask"], w["logprobs"]) for w in want]
    assert [s.metadata["trained_turn_ids"] for s in got] == [w["trained"] for w in want]
    assert [s.metadata["turn_ids"] for s in got] == [w["turns"] for w in want]
    assert [s.metadata["masked_turn_ids"] for s in got] == [w["masked"] for w in want]
    assert [s.metadata["main_line"] for s in got] == [w["main_line"] for w in want]
    assert [s.metadata["foreign"] for s in got] == [w["foreign"] for w in want]

    # Every generated turn is trained at most once ...
    trained = [t for s in got for t in s.metadata["trained_turn_ids"]]
    assert len(trained) == len(set(trained))
    # ... and at least once unless every path to it masked it (or truncation cut it off).
    all_turns: dict[int, RTurn] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.turn is not None:
            all_turns[n.turn.seq] = n.turn
    masked_everywhere = _masked_on_every_path(root, threshold)
    for seq, t in all_turns.items():
        if not t.output or seq in masked_everywhere:
            continue
        if max_tokens and len(t.prompt) >= max_tokens:
            continue
        assert seq in trained, f"turn {seq} trained nowhere"
    # Trained spans hold exactly the turn's own output tokens.
    for s in got:
        for seq in s.metadata["trained_turn_ids"]:
            t = all_turns[seq]
            a = len(t.prompt)
            b = min(a + len(t.output), len(s.tokens))
            assert s.tokens[a:b].tolist() == t.output[: b - a]
    assert not tm.has_session("sid")


def _masked_on_every_path(root: RNode, threshold: int) -> set[int]:
    """Turns that every continuation replaces-and-masks (and that are not a path's end)."""
    out = set()
    stack = [root]
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        t = n.turn
        if t is None:
            continue
        # The next generated turns on the paths through n, and whether a path ends before one.
        nexts: list[RTurn] = []
        ends = False
        sub = list(n.children)
        if not sub:
            ends = True
        while sub:
            m = sub.pop()
            if m.turn is not None:
                nexts.append(m.turn)
            elif m.children:
                sub.extend(m.children)
            else:
                ends = True
        full = t.prompt + t.output
        if not ends and all(
            u.prompt[: len(full)] != full
            and u.prompt[: len(t.prompt)] == t.prompt
            and len(t.output) < threshold
            for u in nexts
        ):
            out.add(t.seq)
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(0, 300),
    st.integers(0, 400),
    st.sampled_from([0, 1, 3]),
)
def test_common_prefix_len_matches_naive(n: int, m: int, mismatch_at: int, offset: int) -> None:
    rng = np.random.default_rng(n * 1000 + m)
    a = rng.integers(0, 50, size=n + offset).astype(np.int32)[offset:]
    b = np.concatenate([a[: min(n, m)], rng.integers(0, 50, size=max(0, m - n)).astype(np.int32)])
    if mismatch_at < len(b):
        b[mismatch_at] = b[mismatch_at] + 1
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(a, b) == naive
    assert common_prefix_len(b, a) == naive


def test_common_prefix_len_long_and_strided() -> None:
    a = np.arange(1_000_003, dtype=np.int32)
    b = a.copy()
    assert common_prefix_len(a, b) == len(a)
    for pos in (0, 1, 4095, 8192, 8193, 500_000, 1_000_002):
        c = b.copy()
        c[pos] = -1
        assert common_prefix_len(a, c) == pos
    assert common_prefix_len(a[::2], b[::2]) == len(a[::2])
    c = b.copy()
    c[10] = -1
    assert common_prefix_len(a[::2], c[::2]) == 5
