"""Run directories for the viewer's tests, made by the real parts in process.

An agent (the official ``openai`` SDK) talks to a real :class:`Gateway` over HTTP on 127.0.0.1; the
policy answers in process with token records from a toy byte-level "tokenizer" (each message is
its role's id, its bytes, an end id), so the message tree, the samples and their loss masks are the
real recorder's and linearizer's. The run directory is written by the run's own writer
(:class:`RunOutputs`), with the gateway's data dir beside it as ``gateway-data``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai

from ares_gateway import Gateway
from ares_gateway.episodes.output import EpisodeResult, RunOutputs, RunSummary

ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END = 5

#: What an agent's tool might print: each must show as text, and none may run.
INJECTIONS = [
    "<script>window.__pwned = 'script'</script>",
    '<img src="x" onerror="window.__pwned = \'img\'; alert(1)">',
    "[click me](javascript:window.__pwned='link') <a href=\"javascript:window.__pwned='a'\">a link</a>",
    "\x1b[31mRED ALERT\x1b[0m \x1b]0;title\x07done",
]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content or ""


def render(messages: list[dict[str, Any]]) -> list[int]:
    """The toy template: per message its role id, its text's bytes (+ 16), an end id; then the opener."""
    ids: list[int] = []
    for m in messages:
        ids += [ROLES.get(m["role"], 6), *(b + 16 for b in _text(m.get("content")).encode()[:400]), END]
    return [*ids, ROLES["assistant"]]


def answer_ids(text: str) -> list[int]:
    return [*(b + 16 for b in text.encode()[:400]), END]


def logprobs(n: int) -> list[float]:
    """Mostly likely tokens, every 7th an unlikely one (p < 0.1), so the page has some to mark."""
    return [-2.9 if i % 7 == 3 else -0.05 - (i % 5) * 0.02 for i in range(n)]


class Agent:
    """One session of a real gateway, driven turn by turn: the SDK sends, the policy answers with
    ``reply``."""

    def __init__(self, gw: Gateway, info: Any) -> None:
        self.gw = gw
        self.info = info
        self.client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)

    async def turn(self, messages: list[dict[str, Any]], reply: str, *, side_call: bool = False) -> str:
        headers = {"x-ares-side-call": "1"} if side_call else None
        call = asyncio.create_task(self.client.chat.completions.create(
            model="m", messages=messages, extra_headers=headers))  # type: ignore[arg-type]
        req = await self.gw.next_request(self.info.session_id, timeout=10)
        assert req is not None
        prompt = render([m.to_chat_dict() for m in req.request.messages])
        out = answer_ids(reply)
        await self.gw.respond(req.id, reply, tokens={"prompt_ids": prompt, "output_ids": out,
                                                     "output_logprobs": logprobs(len(out))})
        got = await asyncio.wait_for(call, 10)
        return got.choices[0].message.content or ""


async def forked_session(agent: Agent) -> None:
    """Two turns on one line, then a retry that forks at the user message after the first answer, and a
    side call (a title): two main leaves, so two main samples and one side-call sample."""
    system = {"role": "system", "content": "You are a careful coding agent."}
    user = {"role": "user", "content": "Fix the median bug in stats.py."}
    a1 = await agent.turn([system, user], "I will read stats.py first.")
    await agent.turn([system, user, {"role": "assistant", "content": a1},
                      {"role": "user", "content": "stats.py: def median(xs): return xs[len(xs)//2]"}],
                     "The list is not sorted; sorting it fixes the bug.")
    await agent.turn([system, user, {"role": "assistant", "content": a1},
                      {"role": "user", "content": "Try again, differently: run the tests first."}],
                     "Running the tests: 2 failed.")
    await agent.turn([{"role": "user", "content": "Write a 5-word title for this chat."}],
                     "Fixing the median bug", side_call=True)


async def injection_session(agent: Agent) -> None:
    """Tool output and model text full of markup, links and ANSI escapes."""
    system = {"role": "system", "content": "agent"}
    user = {"role": "user", "content": "Run the tool."}
    hostile = "\n".join(INJECTIONS)
    a1 = await agent.turn([system, user], "ok " + INJECTIONS[0])
    await agent.turn(
        [system, user, {"role": "assistant", "content": a1}, {"role": "user", "content": hostile}],
        INJECTIONS[1] + " " + INJECTIONS[3])


async def build_run(out: Path, sessions: list[tuple[str, float, Callable[[Agent], Awaitable[None]]]],
                    *, error: dict[str, str] | None = None, keep_sessions: bool = False) -> Path:
    """A run directory ``out`` with one episode per ``(task, reward, play)``, written by the run's writer.
    As the run's driver does, each session is then deleted from the gateway (and its data dir), unless
    ``keep_sessions`` (a data dir to view alone)."""
    outputs = RunOutputs(out)
    results: list[EpisodeResult] = []
    t0 = time.time()
    async with Gateway(data_dir=str(out / "gateway-data")) as gw:
        for task, reward, play in sessions:
            info = await gw.create_session(metadata={"task": task, "attempt": 0})
            started = time.time()
            agent = Agent(gw, info)
            try:
                await play(agent)
            finally:
                await agent.client.close()
            await gw.end_session(info.session_id, reward=reward)
            await gw.durable()
            samples = gw.trajectory(info.session_id, reward=reward)
            turns = gw.turn_log(info.session_id)
            err = (error or {}).get(task)
            result = EpisodeResult(task=task, attempt=0, reward=reward, turns=len(turns),
                                   duration=time.time() - started,
                                   exit_reason="error" if err else "completed",
                                   error=err, samples=len(samples), session_id=info.session_id)
            logs = {
                "verifier.log": f"\x1b[32mPASSED\x1b[0m tests for {task}\n{INJECTIONS[0]}\nreward {reward}\n"}
            outputs.episode(result, samples, turns, logs)
            results.append(result)
            if not keep_sessions:
                await gw.delete_session(info.session_id)
    summary = RunSummary(results, planned=len(results), attempts=1, duration=time.time() - t0)
    outputs.results(
        {"preset": "viewer-tests", "policy": "in-process", "harness": "openai-sdk", "attempts": 1},
        summary)
    return out


def big_run(out: Path, episodes: int = 1000) -> Path:
    """A run directory of ``episodes`` finished episodes (rows only), as the run's writer leaves them."""
    outputs = RunOutputs(out)
    results = []
    for i in range(episodes):
        r = EpisodeResult(task=f"task-{i // 4:04d}", attempt=i % 4, reward=float(i % 3 == 0),
                          turns=10 + i % 50, duration=30.0 + i % 17,
                          exit_reason="completed" if i % 9 else "agent_error",
                          error=None if i % 9 else f"the agent exited with code 1 (episode {i})")
        results.append(r)
        with open(out / "episodes.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(r.to_dict()) + "\n")
    outputs.results({"preset": "big", "attempts": 4},
                    RunSummary(results, planned=episodes, attempts=4, duration=600.0))
    return out


def big_session(out: Path, key: str = "big-task.0", turns: int = 200, turn_kb: int = 600, *,
                tokens: bool = False) -> Path:
    """A Claude-Code-sized turn log: ``turns`` OpenAI-chat requests whose history grows to ~``turn_kb`` KB,
    each answered with a tool call, in the shape ``turns/*.jsonl`` has (``Gateway.turn_log`` entries);
    with ``tokens``, each answer carries a (small, toy) token record, so the log has a message tree."""
    (out / "turns").mkdir(parents=True, exist_ok=True)
    step = turn_kb * 1024 // turns  # each turn adds one tool result of this many bytes
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are Claude Code. " + "rules " * 4000},
        {"role": "user", "content": "Fix the failing tests."}]
    with open(out / "turns" / f"{key}.jsonl", "w", encoding="utf-8") as fh:
        for t in range(turns):
            call = {"id": f"call_{t}", "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": f"cat file{t}.py"})}}
            entry = {"request_id": f"r{t}", "protocol": "openai.chat", "side_call": False,
                     "timestamp": 1.7e9 + t, "latency": 0.5, "request": {"model": "m", "messages": messages},
                     "completion": {"text": f"step {t}", "tool_calls": [{"id": call["id"], "name": "bash",
                                                                         "arguments": call["function"][
                                                                             "arguments"]}],
                                    "finish_reason": "tool_calls"}}
            if tokens:
                entry["completion"]["tokens"] = {"prompt_ids": list(range(t * 10 + 5)),
                                                 "output_ids": [7, 8, 9],
                                                 "output_logprobs": [-0.1, -0.2, -3.0]}
            fh.write(json.dumps(entry) + "\n")
            messages = [*messages, {"role": "assistant", "content": f"step {t}", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"],
                         "content": f"# file{t}.py\n" + "x = 1\n" * (step // 6)}]
    with open(out / "episodes.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(
            EpisodeResult(task=key.rsplit(".", 1)[0], attempt=0, reward=1.0, turns=turns, duration=3600.0,
                          exit_reason="completed").to_dict()) + "\n")
    return out


__all__ = ["INJECTIONS", "Agent", "big_run", "big_sample", "big_session", "build_run", "forked_session",
           "injection_session", "logprobs"]


def big_sample(out: Path, key: str = "big-task.0", tokens: int = 157_000,
               response: int = 60_000) -> dict[str, Any]:
    """One sample of a long session (``tokens`` ids, the last ``response`` of them its response, every
    other stretch trained), in ``trajectories/KEY.jsonl`` as the run's writer leaves it."""
    (out / "trajectories").mkdir(parents=True, exist_ok=True)
    mask = [1 if (i // 500) % 2 == 0 else 0 for i in range(response)]
    sample = {"tokens": [(i * 7919) % 49000 for i in range(tokens)], "response_length": response,
              "loss_mask": mask,
              "logprobs": [lp if m else 0.0 for m, lp in zip(mask, logprobs(response), strict=True)],
              "reward": 1.0, "metadata": {"session_id": "big", "side_call": False, "branch": 0, "segment": 0,
                           "turn_ids": [1, 2], "trained_turn_ids": [1, 2]}}
    (out / "trajectories" / f"{key}.jsonl").write_text(json.dumps(sample) + "\n")
    return sample
