"""Which sample of an episode a trainer adapter trains: the harness CLI's own conversation.

Hand-built message trees (the golden tests' toy token scheme) with what an episode can hold besides
the CLI's conversation: a longer conversation sent with the session's credentials by one of the
agent's tool commands, a branch that replays the CLI's conversation and adds made-up turns, harness
side calls, and the CLI's own history rewrites (a dropped answer, token drift, a compaction).
"""

from __future__ import annotations

from typing import Any

from ares_gateway.trainers import foreign_count, main_sample
from tests.trajectory.helpers import Episode as _Episode
from tests.trajectory.helpers import ast, show, sys, tool, usr

TASK = [sys("S"), usr("u:task")]
LONG = " ".join(f"r:j{i}" for i in range(40)) + " </ast>"


class Episode(_Episode):
    """The golden tests' episode; every turn here has an answer, which ``turn`` returns."""

    def turn(self, prompt: list[dict[str, Any]], reply: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
        out = super().turn(prompt, reply, **kw)
        assert out is not None
        return out


def _cli(ep: Episode, turns: int = 3) -> list[dict[str, Any]]:
    """The CLI's conversation: ``turns`` answers, each after its tool's output; returns the last prompt."""
    prompt = list(TASK)
    for i in range(turns):
        a = ep.turn(prompt, ast("", calls=[("bash", {"cmd": f"c{i}"})]))
        prompt = [*prompt, a, tool(f"t:out{i}")]
    return prompt


def _trained(s: Any) -> int:
    return int(s.loss_mask.sum())


def test_a_longer_conversation_from_a_tool_command_is_foreign_and_never_trained() -> None:
    ep = Episode()
    a1 = ep.turn(TASK, ast("", calls=[("bash", {"cmd": "curl"})]))
    # While the CLI's first command runs, it sends a made-up conversation of its own, longer than
    # anything the CLI will make, with the session's base URL and token.
    fake = [sys("S:fake"), usr("u:fake")]
    j = ep.turn(fake, ast("r:fake1"))
    ep.turn([*fake, j, usr("u:more")], ast("r:fake2"), output_tokens=LONG)
    ep.turn([*TASK, a1, tool("t:out0")], ast("r:done"))
    samples = ep.samples()
    best, others = main_sample(samples)
    assert best is not None and not best.metadata["foreign"] and best.metadata["main_line"]
    assert show(best).startswith("<sys> S </sys> <usr> u:task </usr> <gen> | [call:bash")
    assert best.metadata["turn_ids"] == [1, 4]
    injected = [s for s in samples if s.metadata["foreign"]]
    assert len(injected) == 1 and _trained(injected[0]) > _trained(best)
    assert not injected[0].metadata["main_line"]
    assert others == 1 and foreign_count(samples) == 1


def test_a_replayed_branch_with_fewer_turns_loses_and_takes_none_of_the_cli_turns() -> None:
    ep = Episode()
    a1 = ep.turn(TASK, ast("", calls=[("bash", {"cmd": "c0"})]))
    # A tool command copies the CLI's conversation exactly and adds a made-up tool output: a branch
    # of the main line, made before the CLI's own next request (so it is the earlier leaf).
    ep.turn([*TASK, a1, tool("t:forged")], ast("r:forged"), output_tokens=LONG)
    a2 = ep.turn([*TASK, a1, tool("t:out0")], ast("", calls=[("bash", {"cmd": "c1"})]))
    ep.turn([*TASK, a1, tool("t:out0"), a2, tool("t:out1")], ast("r:done"))
    samples = ep.samples()
    assert [s.metadata["branch"] for s in samples] == [0, 1]  # leaf order: the forged branch first
    best, _ = main_sample(samples)
    assert best is not None and best.metadata["branch"] == 1
    # The main line claims its turns first: the CLI's first answer is trained in its sample, not in
    # the forged branch's (which keeps only its own answer).
    assert best.metadata["trained_turn_ids"] == [1, 3, 4]
    assert samples[0].metadata["trained_turn_ids"] == [2]
    assert not samples[0].metadata["foreign"] and not samples[0].metadata["main_line"]
    assert foreign_count(samples) == 0


def test_side_calls_are_never_the_main_line_however_large() -> None:
    ep = Episode()
    _cli(ep, 2)
    ep.turn([sys("S:title"), usr("u:name this")], ast("r:title"), output_tokens=LONG,
            metadata={"side_call": True})
    # A second side call of another kind: a conversation of its own in the side-call tree, still a
    # side call and not foreign.
    ep.turn([sys("S:summary"), usr("u:summarize")], ast("r:summary"), metadata={"side_call": True})
    samples = ep.samples()
    best, others = main_sample(samples)
    assert best is not None and not best.metadata["side_call"] and best.metadata["turn_ids"] == [1, 2]
    side = [s for s in samples if s.metadata["side_call"]]
    assert len(side) == 2 and not any(s.metadata["main_line"] or s.metadata["foreign"] for s in side)
    assert others == 2 and foreign_count(samples) == 0


def test_the_cli_dropping_an_answer_keeps_its_line_the_main_one() -> None:
    ep = Episode()
    # mini-swe-agent drops an answer it cannot parse and sends only its format error: the next
    # request replays the first prompt, not the first answer.
    ep.turn(TASK, ast("r:unparsable"))
    retry = [*TASK, usr("u:format error")]
    a2 = ep.turn(retry, ast("", calls=[("bash", {"cmd": "c0"})]))
    ep.turn([*retry, a2, tool("t:out0")], ast("r:done"))
    samples = ep.samples()
    best, others = main_sample(samples)
    assert best is not None and best.metadata["turn_ids"] == [2, 3] and best.metadata["main_line"]
    assert others == 1 and foreign_count(samples) == 0


def test_token_drift_segments_stay_on_the_main_line_and_the_larger_is_trained() -> None:
    ep = Episode()
    a1 = ep.turn(TASK, ast("r:one"))
    # The same messages rendered differently: the sample closes and a new one starts (a segment).
    ep.turn([*TASK, a1, usr("u:next")], ast("r:two"),
            prompt_tokens="<sys> S:v2 </sys> <usr> u:task </usr> <gen> r:one </ast> "
                          "<usr> u:next </usr> <gen>",
            output_tokens=LONG)
    samples = ep.samples()
    assert [s.metadata["segment"] for s in samples] == [0, 1]
    assert all(s.metadata["main_line"] and not s.metadata["foreign"] for s in samples)
    best, others = main_sample(samples)
    assert best is samples[1] and others == 1


def test_a_compaction_that_keeps_the_first_request_stays_on_the_main_line() -> None:
    ep = Episode()
    prompt = _cli(ep, 2)
    # The CLI replaces its history after the first request with a summary (its own rewrite).
    compacted = [*TASK, usr("u:summary of the work so far")]
    ep.turn(compacted, ast("r:after1"))
    ep.turn([*compacted, ast("r:after1"), usr("u:go on")], ast("r:after2"))
    ep.turn([*compacted, ast("r:after1"), usr("u:go on"), ast("r:after2"), usr("u:again")], ast("r:after3"))
    assert prompt  # the pre-compaction line is a branch of its own
    samples = ep.samples()
    assert foreign_count(samples) == 0
    best, _ = main_sample(samples)
    assert best is not None and best.metadata["turn_ids"] == [3, 4, 5]


def test_a_rewrite_that_drops_the_first_request_is_foreign() -> None:
    """A history that no longer starts with the first request cannot be told from a made-up one:
    it is foreign, and the main line is the CLI's conversation before it."""
    ep = Episode()
    _cli(ep, 2)
    ep.turn([sys("S"), usr("u:summary only")], ast("r:after"), output_tokens=LONG)
    samples = ep.samples()
    best, _ = main_sample(samples)
    assert best is not None and best.metadata["turn_ids"] == [1, 2]
    assert foreign_count(samples) == 1


def test_samples_recorded_before_the_main_line_was_marked_fall_back_to_the_largest() -> None:
    ep = Episode()
    a1 = ep.turn(TASK, ast("r:one"))
    ep.turn([*TASK, a1, usr("u:next")], ast("r:two"), output_tokens=LONG)
    ep.turn([sys("S"), usr("u:other")], ast("r:x"), metadata={"side_call": True}, output_tokens=LONG + " r:y")
    samples = ep.samples()
    for s in samples:
        del s.metadata["main_line"], s.metadata["foreign"]
    best, others = main_sample(samples)
    assert best is samples[0] and not best.metadata["side_call"] and others == 1


def test_the_trl_reward_function_logs_the_counts_of_samples_not_trained() -> None:
    from ares_gateway.trainers.trl import reward_from_episode

    logged: dict[str, list[Any]] = {}
    out = reward_from_episode(["c"], reward=[0.5], task=["t"], other_samples=[2], foreign_samples=[1],
                              log_extra=lambda key, values: logged.__setitem__(key, values))
    assert out == [0.5]
    assert logged == {"task": ["t"], "other_samples": [2], "foreign_samples": [1]}


def test_a_replayed_branch_with_more_turns_is_the_main_line_and_trains_the_cli_turns_it_copied() -> None:
    """What a tool command can still do (docs/training.md): outnumber the CLI's later turns. The turns
    it copied stay trained, by it; the CLI's later turns are recorded, not trained by the adapters."""
    ep = Episode()
    a1 = ep.turn(TASK, ast("", calls=[("bash", {"cmd": "c0"})]))
    forged = [*TASK, a1, tool("t:forged")]
    f1 = ep.turn(forged, ast("r:f1"))
    f2 = ep.turn([*forged, f1, usr("u:f")], ast("r:f2"))
    ep.turn([*forged, f1, usr("u:f"), f2, usr("u:g")], ast("r:f3"))
    ep.turn([*TASK, a1, tool("t:out0")], ast("r:done"))
    samples = ep.samples()
    best, _ = main_sample(samples)
    assert best is not None and best.metadata["trained_turn_ids"] == [1, 2, 3, 4]
    cli = next(s for s in samples if s.metadata["turn_ids"] == [1, 5])
    assert cli.metadata["trained_turn_ids"] == [5] and not cli.metadata["main_line"]
