"""Scale: long chains and wide trees must work (no recursion) and stay fast and compact."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trajectory import TrajectoryManager, TurnRecord

from .helpers import check_sample

GEN, END = 7, 8


def test_20000_turn_chain() -> None:
    n_turns = 20_000
    # Each turn: the history, a new user message (3 tokens) + <gen>; output: body + END.
    total = 3 + n_turns * 6
    seq = np.empty(total, dtype=np.int32)
    seq[:3] = [1, 100, 2]  # system message
    msgs: list[dict] = [{"role": "system", "content": "S"}]
    tm = TrajectoryManager(fork_threshold_tokens=1024)
    pos = 3
    t0 = time.perf_counter()
    for k in range(n_turns):
        msgs.append({"role": "user", "content": f"u{k}"})
        seq[pos : pos + 4] = [3, 10_000 + k, 4, GEN]
        pos += 4
        prompt = seq[:pos]
        seq[pos : pos + 2] = [200_000 + k, END]
        tm.record_turn(
            "chain",
            prompt_messages=msgs,
            response_message={"role": "assistant", "content": f"r{k}"},
            turn=TurnRecord(prompt, seq[pos : pos + 2], [-0.5, -0.25]),
        )
        msgs.append({"role": "assistant", "content": f"r{k}"})
        pos += 2
    record_s = time.perf_counter() - t0
    assert tm.turn_count("chain") == n_turns
    tree = tm._sessions["chain"].main
    assert tree is not None
    # Stored once: the whole chain costs about one copy of the final sequence (+ growth
    # slack and logprobs), not 20,000 prompts.
    assert tree.token_bytes() <= total * 4 * 1.15 + n_turns * 2 * 4 + 4096
    t0 = time.perf_counter()
    (s,) = tm.get_trajectory("chain", reward=1.0)
    lin_s = time.perf_counter() - t0
    check_sample(s)
    assert np.array_equal(s.tokens, seq[:pos])
    assert s.response_length == pos - 7
    assert int(s.loss_mask.sum()) == 2 * n_turns
    assert s.metadata["trained_turn_ids"] == list(range(1, n_turns + 1))
    assert record_s < 20 and lin_s < 5, (record_s, lin_s)


def test_chain_with_periodic_drift_splits_into_samples() -> None:
    tm = TrajectoryManager(fork_threshold_tokens=1)
    msgs: list[dict] = [{"role": "system", "content": "S"}]
    n_turns = 2000
    seq = np.empty(3 + 6 * n_turns, dtype=np.int32)
    seq[:3] = [1, 100, 2]
    pos = 3
    for k in range(n_turns):
        msgs.append({"role": "user", "content": f"u{k}"})
        seq[pos : pos + 4] = [3, 10_000 + k, 4, GEN]
        pos += 4
        if k and k % 100 == 0:
            seq[1] = 100 + k  # the client re-renders the system prompt: drift far back
        seq[pos : pos + 2] = [200_000 + k, END]
        tm.record_turn(
            "d",
            prompt_messages=msgs,
            response_message={"role": "assistant", "content": f"r{k}"},
            turn=TurnRecord(seq[:pos], seq[pos : pos + 2]),
        )
        msgs.append({"role": "assistant", "content": f"r{k}"})
        pos += 2
    samples = tm.get_trajectory("d")
    assert len(samples) == n_turns // 100
    for i, s in enumerate(samples):
        check_sample(s)
        assert int(s.loss_mask.sum()) == 200
        assert s.metadata["num_branches"] == 1
        assert s.tokens[1] == (100 + 100 * i if i else 100)
    assert [s.metadata["start_reason"] for s in samples[:2]] == ["root", "drift"]


def test_1000_leaf_tree() -> None:
    rng = np.random.default_rng(7)
    tm = TrajectoryManager()
    sys_msg = {"role": "system", "content": "S"}
    # A main line of 50 turns ...
    msgs: list[dict] = [sys_msg]
    toks: list[int] = [1, 100, 2]
    history: list[tuple[list[dict], list[int]]] = []
    for k in range(50):
        msgs = [*msgs, {"role": "user", "content": f"u{k}"}]
        prompt = [*toks, 3, 1000 + k, 4, GEN]
        out = [5000 + k, END]
        history.append((msgs, prompt))
        tm.record_turn(
            "t",
            prompt_messages=msgs,
            response_message={"role": "assistant", "content": f"r{k}"},
            turn=TurnRecord(prompt, out),
        )
        msgs = [*msgs, {"role": "assistant", "content": f"r{k}"}]
        toks = prompt + out
    # ... and 999 branches: a different tool result / retry at a random point of it.
    for j in range(999):
        at = int(rng.integers(0, 50))
        base_msgs, base_prompt = history[at]
        bm = [*base_msgs[:-1], {"role": "user", "content": f"alt{j}"}]
        bp = [*base_prompt[:-3], 60_000 + j, 4, GEN]
        tm.record_turn(
            "t",
            prompt_messages=bm,
            response_message={"role": "assistant", "content": f"b{j}"},
            turn=TurnRecord(np.asarray(bp, dtype=np.int32), [70_000 + j, END]),
        )
    t0 = time.perf_counter()
    samples = tm.get_trajectory("t")
    elapsed = time.perf_counter() - t0
    assert {s.metadata["num_branches"] for s in samples} == {1000}
    assert len(samples) == 1000
    trained = [t for s in samples for t in s.metadata["trained_turn_ids"]]
    assert sorted(trained) == list(range(1, 50 + 999 + 1))  # every turn exactly once
    for s in samples:
        check_sample(s)
    assert elapsed < 5, elapsed


def test_shared_prefix_is_stored_once() -> None:
    tm = TrajectoryManager()
    prefix = np.arange(10, 100_010, dtype=np.int32)  # a 100k-token system prompt
    msgs: list[dict] = [{"role": "system", "content": "S"}]
    tail: list[int] = []
    for k in range(200):
        msgs.append({"role": "user", "content": f"u{k}"})
        tail += [3, 1_000_000 + k, 4, GEN]
        prompt = np.concatenate([prefix, np.asarray(tail, dtype=np.int32)])
        out = [2_000_000 + k, END]
        tm.record_turn(
            "m",
            prompt_messages=[dict(m) for m in msgs],  # fresh objects every turn
            response_message={"role": "assistant", "content": f"r{k}"},
            turn=TurnRecord(prompt, out),
        )
        msgs.append({"role": "assistant", "content": f"r{k}"})
        tail += out
    tree = tm._sessions["m"].main
    assert tree is not None
    unique = prefix.size + len(tail)
    assert tree.token_bytes() <= unique * 4 * 1.15 + 4096  # not 200 copies of the prefix
    (s,) = tm.get_trajectory("m")
    assert s.tokens.size == unique


def test_drained_session_memory_is_freed_without_the_cyclic_collector() -> None:
    import gc
    import tracemalloc

    tm = TrajectoryManager()
    prompt = np.arange(1_000_000, dtype=np.int32)
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        for sid in ("a", "b"):
            tm.record_turn(
                sid,
                prompt_messages=[{"role": "user", "content": "u"}],
                response_message={"role": "assistant", "content": "r"},
                turn=TurnRecord(prompt, [1, 2]),
            )
        assert tm.drop_session("a")
        samples = tm.get_trajectory("b")
        del samples
        current = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    finally:
        gc.enable()
    assert current < 1_000_000, current  # both 4 MB arenas are gone


def test_loss_mask_of_6000_trained_tokens_sums_to_6000_however_it_is_summed() -> None:
    """A trainer counting trained tokens with Python's sum() must get the count: an int8 mask wraps
    (6,000 ones sum to 112), so the mask is int32 and ``check()`` rejects a narrower one."""
    n_out = 6000
    prompt = np.array([1, 100, 2, GEN], dtype=np.int32)
    out = np.arange(1000, 1000 + n_out, dtype=np.int32)
    tm = TrajectoryManager()
    tm.record_turn(
        "big",
        prompt_messages=[{"role": "system", "content": "S"}],
        response_message={"role": "assistant", "content": "long answer"},
        turn=TurnRecord(prompt, out),
    )
    (s,) = tm.get_trajectory("big", reward=1.0)
    check_sample(s)
    assert s.loss_mask.dtype == np.int32
    assert sum(s.loss_mask) == n_out  # Python's sum over numpy scalars
    assert int(s.loss_mask.sum()) == n_out and int(np.cumsum(s.loss_mask)[-1]) == n_out
    assert sum(s.to_dict()["loss_mask"]) == n_out
    # The trap this guards against, and the check that refuses it.
    narrow = s.loss_mask.astype(np.int8)
    with np.errstate(over="ignore"):
        assert sum(narrow) != n_out
    s.loss_mask = narrow
    with pytest.raises(AssertionError, match="int32"):
        s.check()
