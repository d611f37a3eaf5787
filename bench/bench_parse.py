"""What parsing an agent's body costs on the gateway's loop, per request, with the session's parse memo.

The bodies are bench_gateway.py's: the ~96 KB Claude Code body (in Claude Code's field order) and the
500-message chat history, each sent again unchanged (``same``) or growing by a tool call and its
result every turn for 20 turns, then starting over (``growing``), as bench_gateway.py --grow sends
them. Every request is a fresh ``bytes`` object, as off a socket. ``whole`` parses without the memo
(decode and convert the whole body), as a body under 8 KiB or with ``parse_reuse=False``.

    python3 bench/bench_parse.py            # medians of 5 runs of 2,000 requests each
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_gateway import _bodies, _grown

from ares_gateway.core.canonical import WireProtocol
from ares_gateway.http.body_parser import ParseMemo, parse_inline


def _run(kind: str, mode: str, requests: int) -> float:
    path, raw, _ = _bodies(kind)
    protocol = WireProtocol.ANTHROPIC_MESSAGES if path == "/v1/messages" else WireProtocol.OPENAI_CHAT
    bodies = _grown(kind) if mode == "growing" else [raw]
    fresh = [bytes(bytearray(bodies[i % len(bodies)])) for i in range(requests + 200)]
    memo = ParseMemo()
    for b in fresh[:200]:  # warm: the memo holds its lines
        memo.parse(protocol, b)
    todo = fresh[200:]
    t0 = time.perf_counter()
    if mode == "whole":
        for b in todo:
            parse_inline(b, protocol)
    else:
        for b in todo:
            memo.parse(protocol, b)
    return (time.perf_counter() - t0) / len(todo) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    for kind in ("large", "history"):
        for mode in ("same", "growing", "whole"):
            got = [_run(kind, mode, args.requests) for _ in range(args.runs)]
            print(f"{kind:8} {mode:8} {statistics.median(got):7.1f} µs a request  (runs "
                  f"{', '.join(f'{x:.1f}' for x in got)})")


if __name__ == "__main__":
    main()
