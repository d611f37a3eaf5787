"""What accepting an answer costs: ``coerce_answer`` (what ``respond`` / ``/respond`` run before the
agent is resolved), split into the render proof it makes and the rest.

    PYTHONPATH=. python3 bench/bench_answers.py [--repeat 7] [--number 2000]

Prints, per answer kind, the median over ``--repeat`` runs of the microseconds per answer of
``coerce_answer`` and of the proof alone (a Completion's render, or a native body's encoding,
which the agent's handler then sends as it is).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from ares_gateway.core import answers
from ares_gateway.core.canonical import Completion, WireProtocol
from ares_gateway.protocols import get_adapter

_CHAT_REQ = {"model": "m", "messages": [{"role": "user", "content": "fix the bug " * 200}],
             "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}
_MSG_REQ = {"model": "m", "max_tokens": 1024, "messages": [{"role": "user", "content": "fix the bug " * 200}]}
_COMPLETION = Completion(
    text="I will look at the file first. " * 20,
    tool_calls=[{"id": "call_1", "name": "bash", "arguments": '{"command": "sed -n 1,80p stats.py"}'}],
    finish_reason="tool_calls",
)
_CHAT_BODY = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "done. " * 100}}],
              "usage": {"prompt_tokens": 900, "completion_tokens": 100, "total_tokens": 1000}}


def _median_us(fn: object, number: int, repeat: int) -> float:
    runs = timeit.repeat(fn, number=number, repeat=repeat)  # type: ignore[arg-type]
    return statistics.median(runs) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    a = ap.parse_args()
    chat = get_adapter(WireProtocol.OPENAI_CHAT)
    msgs = get_adapter(WireProtocol.ANTHROPIC_MESSAGES)
    cases = []
    for name, adapter, body in (("chat", chat, _CHAT_REQ), ("messages", msgs, _MSG_REQ)):
        for stream in (False, True):
            req = adapter.parse_request({**body, "stream": stream})
            label = f"Completion -> {name}{' stream' if stream else ''}"
            cases.append((label,
                          lambda p=adapter.protocol, r=req: answers.coerce_answer(p, r, _COMPLETION),
                          lambda p=adapter.protocol, r=req: answers._prove_renders(p, r, _COMPLETION)))
    req = chat.parse_request(_CHAT_REQ)
    cases.append(("native chat body -> chat",
                  lambda: answers.coerce_answer(WireProtocol.OPENAI_CHAT, req, _CHAT_BODY),
                  lambda: answers._too_deep(_CHAT_BODY, answers.MAX_ANSWER_DEPTH)))
    print(f"{'answer':32} {'coerce_answer us':>17} {'proof us':>9}   (median of {a.repeat} x {a.number})")
    for label, whole, proof in cases:
        print(f"{label:32} {_median_us(whole, a.number, a.repeat):17.1f} "
              f"{_median_us(proof, a.number, a.repeat):9.1f}")


if __name__ == "__main__":
    main()
