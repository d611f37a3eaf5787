"""Golden tests: expected samples written as token strings (see helpers.py for the scheme).

``prompt | response``; brackets mark trained tokens (loss 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trajectory import TrajectoryManager, TurnRecord

from .helpers import Episode, ast, render, show, sys, toks, tool, usr

P1 = [sys("S"), usr("u")]


def test_single_turn() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:ok"))
    assert ep.shown() == ["<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]"]


def test_clean_multi_turn_with_tools() -> None:
    ep = Episode()
    a1 = ep.turn(P1, ast("", calls=[("ls", {"path": "."})]))
    a2 = ep.turn([*P1, a1, tool("t:files")], ast("r:done"))
    ep.turn([*P1, a1, tool("t:files"), a2, usr("u:thanks")], ast("r:bye"))
    (s,) = ep.samples()
    assert show(s) == (
        '<sys> S </sys> <usr> u </usr> <gen> | [call:ls({"path":"."})] [</ast>] '
        "<tool> t:files </tool> <gen> [r:done] [</ast>] <usr> u:thanks </usr> <gen> [r:bye] [</ast>]"
    )
    assert s.metadata["used_tools"] == ["ls"]
    assert s.metadata["turn_ids"] == [1, 2, 3]
    assert s.metadata["num_branches"] == 1


def test_two_systems_fork_at_root() -> None:
    ep = Episode()
    ep.turn([sys("S1"), usr("u")], ast("r:a"))
    ep.turn([sys("S2"), usr("u")], ast("r:b"))
    assert ep.shown() == [
        "<sys> S1 </sys> <usr> u </usr> <gen> | [r:a] [</ast>]",
        "<sys> S2 </sys> <usr> u </usr> <gen> | [r:b] [</ast>]",
    ]


def test_two_users_fork_after_system() -> None:
    ep = Episode()
    ep.turn([sys("S"), usr("u1")], ast("r:a"))
    ep.turn([sys("S"), usr("u2")], ast("r:b"))
    samples = ep.samples()
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u1 </usr> <gen> | [r:a] [</ast>]",
        "<sys> S </sys> <usr> u2 </usr> <gen> | [r:b] [</ast>]",
    ]
    assert [s.metadata["branch"] for s in samples] == [0, 1]


def test_two_responses_at_same_point() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:a"))
    ep.turn(P1, ast("r:b"))  # a retry of the same request
    assert ep.shown() == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:a] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> | [r:b] [</ast>]",
    ]


def test_continuation_after_retry_follows_the_replayed_response() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:a"))
    b = ep.turn(P1, ast("r:b"))
    ep.turn([*P1, b, usr("u2")], ast("r:c"))
    assert ep.shown() == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:a] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> | [r:b] [</ast>] <usr> u2 </usr> <gen> [r:c] [</ast>]",
    ]


def test_shared_turn_with_different_tool_results_is_trained_once() -> None:
    ep = Episode()
    call = ep.turn(P1, ast("", calls=[("run", {})]))
    ep.turn([*P1, call, tool("t:1")], ast("r:one"))
    ep.turn([*P1, call, tool("t:2")], ast("r:two"))
    assert ep.shown() == [
        "<sys> S </sys> <usr> u </usr> <gen> | [call:run({})] [</ast>] <tool> t:1 </tool> <gen> "
        "[r:one] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> | call:run({}) </ast> <tool> t:2 </tool> <gen> [r:two] [</ast>]",
    ]


def test_token_drift_with_identical_messages_starts_second_sample() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    # Same messages, but the client's template renders the system prompt differently now.
    ep.turn(
        [*P1, a, usr("u2")],
        ast("r:two"),
        prompt_tokens="<sys> S:v2 </sys> <usr> u </usr> <gen> r:ok </ast> <usr> u2 </usr> <gen>",
    )
    samples = ep.samples()
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]",
        "<sys> S:v2 </sys> <usr> u </usr> <gen> r:ok </ast> <usr> u2 </usr> <gen> | [r:two] [</ast>]",
    ]
    assert [s.metadata["branch"] for s in samples] == [0, 0]  # no tree fork
    assert [s.metadata["start_reason"] for s in samples] == ["root", "drift"]


def test_drift_in_earlier_prompt_forks_the_tree() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    ep.turn([sys("S"), usr("u:edited"), a, usr("u2")], ast("r:two"))
    samples = ep.samples()
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]",
        "<sys> S </sys> <usr> u:edited </usr> <gen> r:ok </ast> <usr> u2 </usr> <gen> | [r:two] [</ast>]",
    ]
    assert [s.metadata["branch"] for s in samples] == [0, 1]


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        # below the threshold (2 output tokens < 3): replace the drifted tail, mask it
        (
            3,
            ["<sys> S </sys> <usr> u </usr> <gen> | r:o k </ast> <usr> u2 </usr> <gen> [r:two] [</ast>]"],
        ),
        # at the threshold (2 tokens, threshold 2): new sample
        (
            2,
            [
                "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]",
                "<sys> S </sys> <usr> u </usr> <gen> r:o k </ast> <usr> u2 </usr> <gen> | [r:two] [</ast>]",
            ],
        ),
        # above the threshold: new sample
        (
            1,
            [
                "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]",
                "<sys> S </sys> <usr> u </usr> <gen> r:o k </ast> <usr> u2 </usr> <gen> | [r:two] [</ast>]",
            ],
        ),
        # 0 disables replacing
        (
            0,
            [
                "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]",
                "<sys> S </sys> <usr> u </usr> <gen> r:o k </ast> <usr> u2 </usr> <gen> | [r:two] [</ast>]",
            ],
        ),
    ],
)
def test_drift_in_latest_response_vs_threshold(threshold: int, expected: list[str]) -> None:
    ep = Episode(TrajectoryManager(fork_threshold_tokens=threshold))
    a = ep.turn(P1, ast("r:ok"))
    # The client re-tokenizes the replayed response: "r:ok" becomes "r:o" "k".
    ep.turn(
        [*P1, a, usr("u2")],
        ast("r:two"),
        prompt_tokens="<sys> S </sys> <usr> u </usr> <gen> r:o k </ast> <usr> u2 </usr> <gen>",
    )
    samples = ep.samples()
    assert [show(s) for s in samples] == expected
    if len(samples) == 1:
        assert samples[0].metadata["masked_turn_ids"] == [1]
        assert samples[0].metadata["trained_turn_ids"] == [2]


def test_drift_in_earlier_response_detected_later() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    b = ep.turn([*P1, a, usr("u2")], ast("r:two"))
    # Turn 3's prompt re-renders the *first* response differently.
    ep.turn(
        [*P1, a, usr("u2"), b, usr("u3")],
        ast("r:three"),
        prompt_tokens="<sys> S </sys> <usr> u </usr> <gen> r:o k </ast> <usr> u2 </usr> <gen> r:two </ast> "
        "<usr> u3 </usr> <gen>",
    )
    assert ep.shown() == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2 </usr> <gen> [r:two] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> r:o k </ast> <usr> u2 </usr> <gen> r:two </ast> <usr> u3 "
        "</usr> <gen> | [r:three] [</ast>]",
    ]


def test_foreign_assistant_messages_are_context() -> None:
    ep = Episode()
    # The assistant message was never generated here (another model, or a fabricated history).
    ep.turn([*P1, ast("r:elsewhere"), usr("u2")], ast("r:mine"))
    (s,) = ep.samples()
    assert (
        show(s)
        == "<sys> S </sys> <usr> u </usr> <gen> r:elsewhere </ast> <usr> u2 </usr> <gen> | [r:mine] [</ast>]"
    )


def test_empty_response_yields_no_sample() -> None:
    ep = Episode()
    ep.turn(P1, None, finish_reason="length")
    assert ep.tm.turn_count("s") == 1
    assert ep.samples() == []


def test_empty_response_after_a_turn_keeps_the_turn() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    ep.turn([*P1, a, usr("u2")], None, finish_reason="length")
    assert ep.shown() == ["<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]"]


def test_rewrite_merge_and_later_turn_through_merged_node() -> None:
    tm = TrajectoryManager(fork_threshold_tokens=1024)
    ep = Episode(tm)
    ep.turn(P1, ast("r:ok"))
    replay = ast("r:ok ")  # the client re-serializes the message with trailing whitespace
    ep.turn([*P1, replay, usr("u2")], ast("r:two"), prompt_tokens=render([*P1, ast("r:ok"), usr("u2")]))
    # A later turn replays the rewritten message again and descends through the merged node.
    ep.turn(
        [*P1, replay, usr("u2"), ast("r:two"), usr("u3")],
        ast("r:three"),
        prompt_tokens=render([*P1, ast("r:ok"), usr("u2"), ast("r:two"), usr("u3")]),
    )
    tree = tm._sessions["s"].main
    assert tree is not None
    (merged,) = [t.node for t in tree.iter_turns() if t.node is not None and t.node.metadata]
    assert merged.metadata is not None
    assert merged.metadata["rewrites"] == [
        {"turn_id": 1, "replaced_message": {"role": "assistant", "content": "r:ok"}}
    ]
    assert merged.message["content"] == "r:ok "
    samples = ep.samples()
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2 </usr> <gen> [r:two] [</ast>] "
        "<usr> u3 </usr> <gen> [r:three] [</ast>]"
    ]
    assert samples[0].metadata["num_branches"] == 1
    assert samples[0].metadata["rewritten"] == 1


def test_rewrite_merge_with_token_drift_masks_the_rewritten_turn() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:ok"))
    replay = ast("r:ok ")
    ep.turn(
        [*P1, replay, usr("u2")],
        ast("r:two"),
        prompt_tokens="<sys> S </sys> <usr> u </usr> <gen> r:ok_ </ast> <usr> u2 </usr> <gen>",
    )
    assert ep.shown() == [
        "<sys> S </sys> <usr> u </usr> <gen> | r:ok_ </ast> <usr> u2 </usr> <gen> [r:two] [</ast>]"
    ]


def test_rewrite_merge_disabled_forks() -> None:
    ep = Episode(TrajectoryManager(fork_threshold_tokens=0))
    ep.turn(P1, ast("r:ok"))
    ep.turn([*P1, ast("r:ok "), usr("u2")], ast("r:two"), prompt_tokens=render([*P1, ast("r:ok"), usr("u2")]))
    samples = ep.samples()
    assert [s.metadata["branch"] for s in samples] == [0, 1]
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> r:ok </ast> <usr> u2 </usr> <gen> | [r:two] [</ast>]",
    ]


def test_no_merge_for_long_responses() -> None:
    ep = Episode(TrajectoryManager(fork_threshold_tokens=2))  # "r:ok </ast>" is 2 tokens: not shorter
    ep.turn(P1, ast("r:ok"))
    ep.turn([*P1, ast("r:ok "), usr("u2")], ast("r:two"), prompt_tokens=render([*P1, ast("r:ok"), usr("u2")]))
    assert [s.metadata["branch"] for s in ep.samples()] == [0, 1]


def test_ambiguous_merge_forks() -> None:
    tm = TrajectoryManager(fork_threshold_tokens=1024)
    ep = Episode(tm)
    ep.turn(P1, ast("r:a"))
    ep.turn(P1, ast("r:b"))
    # A rewritten replay of one of them: two assistant children, so nothing is merged.
    ep.turn([*P1, ast("r:a "), usr("u2")], ast("r:c"), prompt_tokens=render([*P1, ast("r:a"), usr("u2")]))
    samples = ep.samples()
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:a] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> | [r:b] [</ast>]",
        "<sys> S </sys> <usr> u </usr> <gen> r:a </ast> <usr> u2 </usr> <gen> | [r:c] [</ast>]",
    ]
    assert all(not s.metadata["rewritten"] for s in samples)


def test_merge_never_replaces_a_node_with_children() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:a"))
    ep.turn([*P1, a, usr("u2")], ast("r:b"))
    ep.turn([*P1, ast("r:a "), usr("u3")], ast("r:c"), prompt_tokens=render([*P1, a, usr("u3")]))
    samples = ep.samples()
    assert [s.metadata["branch"] for s in samples] == [0, 1]
    assert (
        show(samples[1])
        == "<sys> S </sys> <usr> u </usr> <gen> r:a </ast> <usr> u3 </usr> <gen> | [r:c] [</ast>]"
    )


def test_parallel_tool_calls_and_multiple_results() -> None:
    ep = Episode()
    a1 = ep.turn(P1, ast("r:checking", calls=[("read", {"f": "a"}), ("grep", {"q": "x", "f": "b"})]))
    ep.turn([*P1, a1, tool("t:A", "call_0"), tool("t:B", "call_1")], ast("r:done"))
    (s,) = ep.samples()
    assert show(s) == (
        '<sys> S </sys> <usr> u </usr> <gen> | [r:checking] [call:read({"f":"a"})] '
        '[call:grep({"f":"b","q":"x"})] '
        "[</ast>] <tool> t:A </tool> <tool> t:B </tool> <gen> [r:done] [</ast>]"
    )
    assert s.metadata["used_tools"] == ["grep", "read"]


def test_replayed_tool_calls_match_despite_new_ids_and_argument_order() -> None:
    ep = Episode()
    a1 = ep.turn(P1, ast("", calls=[("grep", {"q": "x", "f": "b"})]))
    replay = {
        "role": "assistant",
        "content": [{"type": "text", "text": ""}],
        "tool_calls": [
            {
                "id": "toolu_other",
                "type": "function",
                "function": {"name": "grep", "arguments": '{"f": "b", "q": "x"}'},
            }
        ],
        "id": "msg_123",
    }
    assert a1 is not None
    ep.turn(
        [*P1, replay, tool("t:hit", "toolu_other")],
        ast("r:found"),
        prompt_tokens=render([*P1, a1, tool("t:hit")]),
    )
    samples = ep.samples()
    assert len(samples) == 1
    assert samples[0].metadata["rewritten"] == 0  # matched by normalization, not merged


def test_logprob_pass_through_and_missing_logprobs() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"), logprobs=[-0.5, -0.25])
    ep.turn([*P1, a, usr("u2")], ast("r:two"), logprobs=[])
    (s,) = ep.samples()
    assert (
        show(s)
        == "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2 </usr> <gen> [r:two] [</ast>]"
    )
    assert s.logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert s.logprobs.dtype == np.float32


def test_logprobs_zero_where_loss_is_zero() -> None:
    ep = Episode()
    call = ep.turn(P1, ast("", calls=[("run", {})]), logprobs=[-1.0, -2.0])
    ep.turn([*P1, call, tool("t:1")], ast("r:one"), logprobs=[-0.5, -0.5])
    ep.turn([*P1, call, tool("t:2")], ast("r:two"), logprobs=[-0.125, -0.125])
    s1, s2 = ep.samples()
    assert s1.logprobs.tolist() == [-1.0, -2.0, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5]
    assert s2.logprobs.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.125, -0.125]


def test_draining() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:ok"))
    assert ep.tm.has_session("s") and ep.tm.turn_count("s") == 1
    assert len(ep.samples(reward=1.5)) == 1
    assert not ep.tm.has_session("s")
    assert ep.tm.turn_count("s") == 0
    assert ep.tm.get_trajectory("s") == []


def test_reward_and_metadata() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:ok"), finish_reason="stop", ill_formed=True)
    (s,) = ep.samples(reward=0.75)
    assert s.reward == 0.75
    assert s.metadata["session_id"] == "s"
    assert s.metadata["ill_formed"] is True
    assert s.metadata["side_call"] is False
    assert s.metadata["truncated"] is False
    assert s.metadata["finish_reason"] == "stop"


def test_side_calls_live_in_their_own_tree() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    ep.turn([sys("S:title"), usr("u:make a title")], ast("r:Title"), metadata={"side_call": True})
    ep.turn([*P1, a, usr("u2")], ast("r:two"))
    samples = ep.samples()
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2 </usr> <gen> [r:two] [</ast>]",
        "<sys> S:title </sys> <usr> u:make a title </usr> <gen> | [r:Title] [</ast>]",
    ]
    assert [s.metadata["side_call"] for s in samples] == [False, True]
    assert ep.tm.turn_count("s") == 0


def test_side_call_with_main_prompt_prefix_does_not_touch_main_line() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    # A summarization side call that replays the main history then asks for a summary.
    ep.turn([*P1, a, usr("u:summarize")], ast("r:summary"), metadata={"side_call": True})
    ep.turn([*P1, a, usr("u2")], ast("r:two"))
    main, side = ep.samples()
    assert (
        show(main)
        == "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2 </usr> <gen> [r:two] [</ast>]"
    )
    assert (
        show(side)
        == "<sys> S </sys> <usr> u </usr> <gen> r:ok </ast> <usr> u:summarize </usr> <gen> | "
           "[r:summary] [</ast>]"
    )
    assert side.metadata["side_call"] is True


def test_claude_code_billing_header_is_ignored() -> None:
    ep = Episode()
    s1 = {
        "role": "system",
        "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.1; cch=aaaa;"},
            {"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}},
        ],
    }
    s2 = {
        "role": "system",
        "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.1; cch=bbbb;"},
            {"type": "text", "text": "S"},
        ],
    }
    a = ep.turn([s1, usr("u")], ast("r:ok"), prompt_tokens=render(P1))
    ep.turn([s2, usr("u"), a, usr("u2")], ast("r:two"), prompt_tokens=render([*P1, ast("r:ok"), usr("u2")]))
    samples = ep.samples()
    assert len(samples) == 1 and samples[0].metadata["num_branches"] == 1


def test_max_sample_tokens_truncates_safely() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"))
    ep.turn([*P1, a, usr("u2")], ast("r:two"))
    (s,) = ep.samples(max_sample_tokens=11)
    assert show(s) == "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2"
    assert s.metadata["truncated"] is True
    assert s.metadata["trained_turn_ids"] == [1]


def test_max_sample_tokens_inside_leading_prompt_drops_sample() -> None:
    ep = Episode()
    ep.turn(P1, ast("r:ok"))
    assert ep.samples(max_sample_tokens=4) == []


def test_truncation_applies_per_sample() -> None:
    ep = Episode()
    call = ep.turn(P1, ast("", calls=[("run", {})]))
    # Branch 1 drifts in the system prompt, so its second sample restarts with a longer prompt.
    ep.turn(
        [*P1, call, tool("t:1")],
        ast("r:one"),
        prompt_tokens="<sys> S:x S:y S:z </sys> <usr> u </usr> <gen> call:run({}) </ast> <tool> t:1 "
                      "</tool> <gen>",
    )
    ep.turn([*P1, call, tool("t:2")], ast("r:two"))
    samples = ep.samples(max_sample_tokens=16)
    assert [show(s) for s in samples] == [
        "<sys> S </sys> <usr> u </usr> <gen> | [call:run({})] [</ast>]",
        "<sys> S:x S:y S:z </sys> <usr> u </usr> <gen> call:run({}) </ast> <tool> t:1 </tool> <gen> "
        "| [r:one]",
        "<sys> S </sys> <usr> u </usr> <gen> | call:run({}) </ast> <tool> t:2 </tool> <gen> [r:two] [</ast>]",
    ]
    assert [s.metadata["truncated"] for s in samples] == [False, True, False]


def test_masked_claim_passes_to_next_leaf() -> None:
    ep = Episode()
    call = ep.turn(P1, ast("", calls=[("run", {})]))
    # Leaf 1: the replay of the call drifts in tokens (short response): replaced and masked there.
    ep.turn(
        [*P1, call, tool("t:1")],
        ast("r:one"),
        prompt_tokens="<sys> S </sys> <usr> u </usr> <gen> call:run({ }) </ast> <tool> t:1 </tool> <gen>",
    )
    # Leaf 2 keeps it: it is trained there.
    ep.turn([*P1, call, tool("t:2")], ast("r:two"))
    assert ep.shown() == [
        "<sys> S </sys> <usr> u </usr> <gen> | call:run({ }) </ast> <tool> t:1 </tool> <gen> [r:one] "
        "[</ast>]", "<sys> S </sys> <usr> u </usr> <gen> | [call:run({})] [</ast>] <tool> t:2 </tool> <gen> "
        "[r:two] [</ast>]",
    ]


def test_array_inputs_and_mixed_forms() -> None:
    ep = Episode()
    a = ep.turn(P1, ast("r:ok"), as_array=True)
    ep.turn([*P1, a, usr("u2")], ast("r:two"))
    (s,) = ep.samples()
    assert (
        show(s)
        == "<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>] <usr> u2 </usr> <gen> [r:two] [</ast>]"
    )
    assert list(s.tokens) == toks(render([*P1, ast("r:ok"), usr("u2")]) + " r:two </ast>")


def test_changed_message_at_same_position_is_not_matched_by_fast_path() -> None:
    # Regression: the previous request's message objects are the fast-path reference; a
    # different message at the same position must still fork.
    ep = Episode()
    ep.turn([sys("S1")], None)
    ep.turn([sys("S2")], ast("r:b"))
    ep.turn([sys("S1")], ast("r:c"))
    assert ep.shown() == [
        "<sys> S1 </sys> <gen> | [r:c] [</ast>]",
        "<sys> S2 </sys> <gen> | [r:b] [</ast>]",
    ]


def test_turn_record_validation() -> None:
    with pytest.raises(ValueError, match="output_logprobs has 1 values but output_ids has 2"):
        TurnRecord([1, 2], [3, 4], [-0.5])
    with pytest.raises(ValueError, match="int32"):
        TurnRecord([1, 2**40], [3])
    with pytest.raises(ValueError):
        TurnRecord([1.5, 2], [3])
    with pytest.raises(ValueError, match="integer dtype"):
        TurnRecord(np.array([1.0, 2.0]), [3])
    with pytest.raises(ValueError, match="out of int32 range"):
        TurnRecord(np.array([1, 2**33], dtype=np.int64), [3])
    rec = TurnRecord(np.array([1, 2], dtype=np.int64), np.array([3], dtype=np.uint16), np.array([-1.0]))
    assert rec.prompt_ids.dtype == np.int32 and rec.output_ids.tolist() == [3]
    assert rec.output_logprobs is not None and rec.output_logprobs.tolist() == [-1.0]
    from array import array

    assert TurnRecord(array("i", [5, 6]), array("l", [7])).prompt_ids.tolist() == [5, 6]


def test_empty_prompt_is_a_noop(caplog: pytest.LogCaptureFixture) -> None:
    tm = TrajectoryManager()
    with caplog.at_level("WARNING"):
        tm.record_turn("s", prompt_messages=[], response_message=ast("r:x"), turn=TurnRecord([], [1]))
    assert not tm.has_session("s")
    assert "no prompt messages" in caplog.text


def test_recorded_arrays_are_copied() -> None:
    prompt = np.array([1, 2, 3], dtype=np.int32)
    out = np.array([4, 5], dtype=np.int32)
    tm = TrajectoryManager()
    tm.record_turn("s", prompt_messages=[usr("u")], response_message=ast("r:x"), turn=TurnRecord(prompt, out))
    prompt[:] = 0
    out[:] = 0
    (s,) = tm.get_trajectory("s")
    assert s.tokens.tolist() == [1, 2, 3, 4, 5]


def test_custom_client_normalizer() -> None:
    from trajectory import NormalizerRegistry

    def drop_timestamp(msg: Any) -> Any:
        if msg.get("role") == "user" and str(msg.get("content", "")).startswith("[ts="):
            return {**msg, "content": msg["content"].split("] ", 1)[1]}
        return msg

    reg = NormalizerRegistry()
    reg.register(drop_timestamp, client="my-cli")
    tm = TrajectoryManager(normalizers=reg)
    ep = Episode(tm)
    a = ep.turn(
        [usr("[ts=1] u")], ast("r:a"), prompt_tokens="<usr> u </usr> <gen>", metadata={"client": "my-cli"}
    )
    ep.turn(
        [usr("[ts=2] u"), a, usr("u2")],
        ast("r:b"),
        prompt_tokens="<usr> u </usr> <gen> r:a </ast> <usr> u2 </usr> <gen>",
        metadata={"client": "my-cli"},
    )
    samples = ep.samples()
    assert len(samples) == 1 and samples[0].metadata["num_branches"] == 1
    # Without the client tag the timestamps differ: a fork.
    ep2 = Episode(TrajectoryManager(normalizers=reg))
    a = ep2.turn([usr("[ts=1] u")], ast("r:a"), prompt_tokens="<usr> u </usr> <gen>")
    ep2.turn(
        [usr("[ts=2] u"), a, usr("u2")],
        ast("r:b"),
        prompt_tokens="<usr> u </usr> <gen> r:a </ast> <usr> u2 </usr> <gen>",
    )
    assert len(ep2.samples()) == 2


def _long_history(system: dict[str, Any]) -> list[dict[str, Any]]:
    return [system, usr("u"), ast("r:a"), usr("u2"), ast("r:b"), usr("u3"), ast("r:c"), usr("u4")]


def test_fast_path_long_history_with_volatile_first_message() -> None:
    ep = Episode()
    h1 = _long_history({"role": "system", "content": "x-anthropic-billing-header: cch=1;\nS"})
    ep.turn(h1, ast("r:d"), prompt_tokens=render(_long_history(sys("S"))))
    h2 = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=2;\nS"},
        *h1[1:],
        ast("r:d"),
        usr("u5"),
    ]
    ep.turn(h2, ast("r:e"), prompt_tokens=render([*_long_history(sys("S")), ast("r:d"), usr("u5")]))
    samples = ep.samples()
    assert len(samples) == 1 and samples[0].metadata["trained_turn_ids"] == [1, 2]


def test_fast_path_long_history_with_changed_first_message_forks() -> None:
    ep = Episode()
    h1 = _long_history(sys("S1"))
    ep.turn(h1, ast("r:d"))
    h2 = [sys("S2"), *h1[1:], ast("r:d"), usr("u5")]
    ep.turn(h2, ast("r:e"))
    samples = ep.samples()
    assert [s.metadata["branch"] for s in samples] == [0, 1]
    assert show(samples[1]).startswith("<sys> S2 </sys>")
