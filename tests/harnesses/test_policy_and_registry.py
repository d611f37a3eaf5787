"""The scripted policy's action formats, the side-call detectors on recorded body shapes, the registry."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ares_gateway import Completion
from harnesses import (
    BaseHarness,
    CallTool,
    Finish,
    RunCommand,
    ScriptedPolicy,
    claude_code_is_side_call,
    codex_is_side_call,
    registry,
    terminus2_is_side_call,
)
from harnesses.scripted import MINI_SUBMIT


def _args(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(d["tool_calls"][0]["arguments"])


CLAUDE_MAIN = {"system": [{"type": "text", "text": "You are a Claude agent"}], "tools": [{"name": "Bash"}],
               "messages": [{"role": "user", "content": "do it"}]}
CODEX_MAIN = {"tools": [{"type": "function", "name": "exec_command"}],
              "input": [
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "do it"}]}]}
MINI_MAIN = {"tools": [{"type": "function", "function": {"name": "bash"}}],
             "messages": [{"role": "user", "content": "x"}]}
TERMINUS_MAIN = {"messages": [{"role": "user", "content": "You are an AI assistant tasked with ..."}]}


@pytest.mark.parametrize(("agent", "body", "name", "key"), [
    ("claude-code", CLAUDE_MAIN, "Bash", "command"),
    ("codex", CODEX_MAIN, "exec_command", "cmd"),
    ("mini-swe-agent", MINI_MAIN, "bash", "command"),
])
def test_run_command_and_finish_in_each_tool_format(agent: str, body: dict[str, Any], name: str,
                                                    key: str) -> None:
    policy = ScriptedPolicy(agent, [RunCommand("echo hi"), Finish("all done")])
    first = policy(body)
    assert first["finish_reason"] == "tool_calls"
    assert first["tool_calls"][0]["name"] == name and _args(first)[key] == "echo hi"
    Completion.model_validate(first)  # the gateway accepts it as is
    second = policy(body)
    if agent == "mini-swe-agent":
        assert _args(second)["command"] == f"echo {MINI_SUBMIT}"
    else:
        assert second == {"text": "all done", "tool_calls": [], "finish_reason": "stop"}
    assert policy.main_turns == 2 and policy.side_turns == 0


def _terminus_screen(text: str) -> dict[str, Any]:
    return {"messages": [*TERMINUS_MAIN["messages"], {"role": "assistant", "content": "{}"},
                         {"role": "user", "content": f"New Terminal Output:\n\n{text}"}]}


def test_terminus_keystrokes_and_repeated_task_complete() -> None:
    policy = ScriptedPolicy("terminus-2", [RunCommand("ls", duration=0.5), Finish()])
    cmd = json.loads(policy(TERMINUS_MAIN)["text"])
    # The command, then a marker line whose output (not its typed text) says the command ended.
    assert cmd["commands"] == [{"keystrokes": "ls\nprintf 'ares-step-%s-done\\n' 0001\n", "duration": 0.5}]
    assert cmd["task_complete"] is False
    done = _terminus_screen("$ ls\na.txt\n$ printf 'ares-step-%s-done\\n' 0001\nares-step-0001-done\n$ ")
    for _ in range(2):  # asked twice: the finish step repeats
        assert json.loads(policy(done)["text"])["task_complete"] is True
    assert policy.wait_turns == 0


def test_terminus_waits_until_the_command_has_ended() -> None:
    policy = ScriptedPolicy("terminus-2", [RunCommand("sleep 70"), RunCommand("echo hi"), Finish()])
    policy(TERMINUS_MAIN)
    # The typed marker line alone (a command still running) is no end: wait, with growing durations.
    running = _terminus_screen("$ sleep 70\nprintf 'ares-step-%s-done\\n' 0001\n")
    waits = [json.loads(policy(running)["text"]) for _ in range(6)]
    assert all(w["commands"][0]["keystrokes"] == "" and w["task_complete"] is False for w in waits)
    assert [w["commands"][0]["duration"] for w in waits] == [5.0, 10.0, 15.0, 30.0, 30.0, 30.0]
    assert policy.wait_turns == 6
    nxt = json.loads(policy(_terminus_screen("ares-step-0001-done\n$ "))["text"])
    assert nxt["commands"][0]["keystrokes"].startswith("echo hi\n")


def _terminus_handoff(screen: str) -> dict[str, Any]:
    """A main-line request after Terminus-2 summarized its history (the shape it sends, as recorded)."""
    return {"messages": [
        *TERMINUS_MAIN["messages"],
        {"role": "user", "content": "You are picking up work from a previous AI agent on this task:\n\n"
                                    "**Original Task:** do it\n\n**Summary from Previous "
                                    "Agent:**\nsummary\n\n"
                                    f"**Current Terminal Screen:**\n{screen}\n\nPlease begin by asking ..."},
        {"role": "assistant", "content": "questions"},
        {"role": "user", "content": "Here are the answers the other agent provided.\n\nanswers\n\n"
                                    "Continue working on this task from where the previous agent left off."},
    ]}


def test_terminus_reads_the_screen_of_a_summarized_history() -> None:
    """After a summarization the last message is the handoff prompt; the screen is in the questions prompt."""
    policy = ScriptedPolicy("terminus-2", [RunCommand("sleep 70"), RunCommand("echo hi"), Finish()])
    policy(TERMINUS_MAIN)
    running = _terminus_handoff("$ sleep 70\nprintf 'ares-step-%s-done\\n' 0001\n")
    assert json.loads(policy(running)["text"])["commands"][0]["keystrokes"] == ""  # still running: wait
    ended = _terminus_handoff("$ sleep 70\nprintf 'ares-step-%s-done\\n' 0001\nares-step-0001-done\n$ ")
    nxt = json.loads(policy(ended)["text"])
    assert nxt["commands"][0]["keystrokes"].startswith("echo hi\n")
    # A later handoff still shows the first command's marker: that is no end of the second command.
    assert json.loads(policy(ended)["text"])["commands"][0]["keystrokes"] == ""
    assert policy.wait_turns == 2


def _codex_after(output: str) -> dict[str, Any]:
    return {"tools": CODEX_MAIN["tools"] + [{"type": "function", "name": "write_stdin"}],
            "input": [*CODEX_MAIN["input"],
                      {"type": "function_call", "call_id": "call_ares_0001", "name": "exec_command",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_ares_0001", "output": output}]}


def test_codex_polls_a_running_command_until_it_exits() -> None:
    policy = ScriptedPolicy("codex", [RunCommand("sleep 70"), RunCommand("echo hi"), Finish()])
    first = _args(policy(CODEX_MAIN))
    assert first == {"cmd": "sleep 70", "yield_time_ms": 30000}  # Codex's longest first wait
    running = "Chunk ID: 1\nWall time: 30.0 seconds\nProcess running with session ID 4242\nOutput:\n"
    for _ in range(2):
        poll = policy(_codex_after(running))
        assert poll["tool_calls"][0]["name"] == "write_stdin"
        # An empty write is a poll; Codex caps its wait at background_terminal_max_timeout.
        assert _args(poll) == {"session_id": 4242, "chars": "", "yield_time_ms": 3_600_000}
    assert policy.wait_turns == 2
    nxt = policy(
        _codex_after("Chunk ID: 2\nWall time: 9.8 seconds\nProcess exited with code 0\nOutput:\nslept\n"))
    assert _args(nxt)["cmd"] == "echo hi"
    assert policy(_codex_after("Process exited with code 0\n"))["text"] == "Done."


def test_codex_falls_back_to_the_shell_tool_it_is_offered() -> None:
    body = {"tools": [{"type": "function", "name": "shell"}], "input": []}
    out = ScriptedPolicy("codex", [RunCommand("pwd")])(body)
    assert out["tool_calls"][0]["name"] == "shell" and _args(out)["command"] == ["bash", "-lc", "pwd"]


def test_mini_text_mode_uses_a_fenced_block() -> None:
    out = ScriptedPolicy("mini-swe-agent", [RunCommand("pwd")])({"messages": []})
    assert "```mswea_bash_command\npwd\n```" in out["text"]


def test_call_tool_step() -> None:
    out = ScriptedPolicy("claude-code", [CallTool("Agent", {"prompt": "p"})])(CLAUDE_MAIN)
    assert out["tool_calls"][0]["name"] == "Agent" and _args(out) == {"prompt": "p"}


def test_title_side_call_gets_a_schema_shaped_answer_and_does_not_advance() -> None:
    title_body = {"tools": [], "messages": [{"role": "user", "content": "name it"}],
                  "output_config": {"format": {"type": "json_schema", "schema": {
                      "type": "object", "properties": {"title": {"type": "string"}}}}}}
    assert claude_code_is_side_call(title_body, {})
    policy = ScriptedPolicy("claude-code", [RunCommand("ls"), Finish()], title="My title")
    assert json.loads(policy(title_body)["text"]) == {"title": "My title"}
    assert policy.side_turns == 1 and policy.main_turns == 0
    assert policy(CLAUDE_MAIN)["tool_calls"][0]["name"] == "Bash"
    # The header marks a side call for any agent.
    assert policy(CLAUDE_MAIN, {"X-Ares-Side-Call": "1"})["tool_calls"] == []


def test_detectors_on_main_and_side_shapes() -> None:
    assert not claude_code_is_side_call(CLAUDE_MAIN, {})
    assert claude_code_is_side_call(CLAUDE_MAIN, {"x-claude-code-agent-id": "a1"})
    sub = {**CLAUDE_MAIN, "system": [{"text": "You are an agent for Claude Code, Anthropic's official CLI"}]}
    assert claude_code_is_side_call(sub, {})
    compact = {**CLAUDE_MAIN, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Your task is to create a detailed summary of the conversation so far"}]}]}
    assert claude_code_is_side_call(compact, {})
    assert not codex_is_side_call(CODEX_MAIN, {})
    assert codex_is_side_call(CODEX_MAIN, {"x-openai-subagent": "compact"})
    assert not terminus2_is_side_call(TERMINUS_MAIN, {})
    assert terminus2_is_side_call(
        {"messages": [{"role": "user",
                       "content": "You are about to hand off your work to another AI agent."}]}, {})


def test_claude_code_sub_agent_is_told_by_where_a_system_block_opens() -> None:
    intro = "You are an agent for Claude Code, Anthropic's official CLI for Claude."
    identity = {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}
    # The introduction in its own block after the identity line, or after it in the same block: a sub-agent.
    assert claude_code_is_side_call({**CLAUDE_MAIN, "system": [identity, {"type": "text", "text": intro}]},
                                    {})
    assert claude_code_is_side_call({**CLAUDE_MAIN, "system": identity["text"] + "\n\n" + intro}, {})
    # The main prompt quoting it far into a block (a repository's notes, a commit message in the
    # environment section): the agent's own turns, not a side call it could hide them as.
    quoted = "You are Claude Code. " + "Follow the project's conventions. " * 200 + f"Notes: '{intro}'"
    assert len(quoted) > 4096
    assert not claude_code_is_side_call(
        {**CLAUDE_MAIN, "system": [identity, {"type": "text", "text": quoted}]}, {})
    assert not claude_code_is_side_call({**CLAUDE_MAIN, "system": quoted}, {})


def test_registry_builtins_custom_and_unknown() -> None:
    assert set(registry.names()) >= {"claude-code", "codex", "mini-swe-agent", "terminus-2"}
    h = registry.create("codex", version="1.2.3")
    assert h.name == "codex" and h.version == "1.2.3"

    class Mine(BaseHarness):
        name = "mine"
        default_version = "0.1.0"
        probe = "bin/mine"

        def install_steps(self, prefix: str) -> list[tuple[str, str]]:
            return []

        def agent_env(self, ctx: Any, prep: Any) -> dict[str, str]:
            return {}

        def agent_command(self, ctx: Any, prep: Any, prompt: str) -> str:
            return "true"

    registry.register("mine", Mine)
    try:
        assert isinstance(registry.create("mine"), Mine)
        with pytest.raises(ValueError, match="already registered"):
            registry.register("mine", lambda **kw: Mine(**kw))
    finally:
        registry.unregister("mine")
    with pytest.raises(KeyError, match="no harness named 'nope'"):
        registry.create("nope")
    with pytest.raises(ValueError, match="no scripted action format"):
        ScriptedPolicy("nope", [Finish()])


def test_an_episodes_side_call_detector_runs_each_check_once_a_request(
    monkeypatch: pytest.MonkeyPatch) -> None:
    """The default detector already asks Claude Code's check for /v1/messages: the episode's detector
    (default + the harness's own) must not ask it again (once a request, not twice)."""
    from ares_gateway import side_calls
    from ares_gateway.core.canonical import WireProtocol
    from ares_gateway.episodes.episode import harness_side_call_detector
    from ares_gateway.protocols import get_adapter
    from harnesses import ClaudeCodeHarness, CodexHarness, Terminus2Harness

    for protocol, harness in ((WireProtocol.ANTHROPIC_MESSAGES, ClaudeCodeHarness),
                              (WireProtocol.OPENAI_RESPONSES, CodexHarness),
                              (WireProtocol.OPENAI_CHAT, Terminus2Harness)):
        # one function: the harness's knowledge
        assert harness.is_side_call is side_calls._BY_PROTOCOL[protocol]
    calls: list[dict[str, Any]] = []
    real = side_calls._BY_PROTOCOL[WireProtocol.ANTHROPIC_MESSAGES]

    def spy(body: Any, headers: Any) -> bool:
        calls.append(body)
        return bool(real(body, headers))

    monkeypatch.setitem(side_calls._BY_PROTOCOL, WireProtocol.ANTHROPIC_MESSAGES, spy)
    monkeypatch.setattr(ClaudeCodeHarness, "is_side_call", staticmethod(spy))
    detect = harness_side_call_detector("claude-code", "mini-swe-agent")
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "fix the bug"}]}
    assert detect(get_adapter(WireProtocol.ANTHROPIC_MESSAGES).parse_request(body), {}) is False
    assert len(calls) == 1
