"""Real agent CLIs' own traffic never reads as foreign: their conversations all extend their first request.

Each CLI runs a scripted episode in a hardened local sandbox (the harness tests' driver); its recorded
requests go into a message tree as the recorder puts them there (the native bodies parsed again, side
calls in their own tree), with token ids that only number the turns. Claude Code and Codex keep one
line; Terminus-2 with a small context window rewrites its history after its summarization side calls.
Whatever a CLI does itself, none of its samples may be foreign, and the main line is one of its own.
"""

from __future__ import annotations

from typing import Any

import pytest

from ares_gateway.core.canonical import Completion, WireProtocol
from ares_gateway.core.wire import adapter_for
from ares_gateway.trainers import foreign_count, main_sample
from harnesses.scripted import Finish, RunCommand
from tests.harnesses.conftest import require_backend
from tests.harnesses.test_harnesses import drive
from trajectory import TrajectoryManager, TurnRecord

pytestmark = pytest.mark.slow

SCRIPT = [RunCommand("echo one"), RunCommand("echo two"), RunCommand("echo three"), Finish("done")]


def _samples(turns: list[dict[str, Any]]) -> list[Any]:
    tm = TrajectoryManager()
    for i, t in enumerate(turns):
        request = adapter_for(WireProtocol(t["protocol"])).parse_request(t["request"])
        answer = Completion.model_validate({k: v for k, v in t["completion"].items() if k != "tokens"})
        tm.record_turn("s", prompt_messages=[m.to_chat_dict() for m in request.messages],
                       response_message=answer.to_message().to_chat_dict(),
                       turn=TurnRecord(list(range(10 * i + 1)), [7, 8]),
                       metadata={"side_call": True} if t["side_call"] else None)
    return tm.get_trajectory("s")


@pytest.mark.parametrize(("name", "options"), [
    ("claude-code", None),
    ("codex", None),
    ("terminus-2", {"context_tokens": 8500}),  # summarizes: side calls, then a rewritten history
])
async def test_a_cli_s_own_requests_are_never_foreign(name: str, options: dict[str, Any] | None) -> None:
    require_backend("local", name)
    result, _, turns, _ = await drive(name, "local", script=list(SCRIPT), harness_options=options)
    assert result.exit_code == 0, result.stderr_tail
    samples = _samples(turns)
    assert foreign_count(samples) == 0, [s.metadata for s in samples]
    best, _ = main_sample(samples)
    assert best is not None and best.metadata["main_line"] and not best.metadata["side_call"]
    first_main = 1 + next(i for i, t in enumerate(turns) if not t["side_call"])
    if options is None:  # one line: every main-line request is in the trained sample
        assert best.metadata["turn_ids"] == [i + 1 for i, t in enumerate(turns) if not t["side_call"]]
    else:
        assert any(t["side_call"] for t in turns), "Terminus-2 did not summarize"
        assert best.metadata["turn_ids"][0] == first_main
