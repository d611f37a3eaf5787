"""The gateway's speed targets, judged on interleaved rounds of bench_gateway.py.

One run of a row moves by 10-30% with what else this shared machine does, and its speed drifts
over the day, so every round runs each implementation once per row, one right after the other,
and the comparisons are per-round ratios (then their median across rounds):

    python3 bench/interleaved.py --rounds 4            # every target row
    python3 bench/interleaved.py --rounds 8 --only p50  # the in-process one-agent row alone
    python3 bench/interleaved.py --rounds 3 --body large --before /tmp/old   # against an older checkout

``--before DIR`` adds ``before``: the gateway of another checkout of this repository (e.g.
``git worktree add /tmp/old <commit>``), run by that checkout's own bench_gateway.py with
``PYTHONPATH=DIR`` (and ``ARES_GATEWAY_PURE=1``, for checkouts that had a compiled build).

``bare-ll`` is the park loop on aiohttp's low-level server, which the gateway serves on: the
gateway's own cost is the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BENCH = str(Path(__file__).with_name("bench_gateway.py"))
ONE = ["--repeat", "1", "--memory", "0"]

#: (row, extra flags, implementations)
ROWS: dict[str, list[tuple[tuple[str, int], list[str], list[str]]]] = {
    "p50": [(("inproc", 1), ["--turn-target", "30000"], ["bare-ll", "bare", "gateway"])],
    "inproc64": [(("inproc", 64), [], ["bare-ll", "bare", "gateway"])],
    "http": [(("http", a), [], ["go", "gateway", "bare", "bare-ll"]) for a in (1, 64, 512)],
}
RATIOS = [("gateway", "go"), ("gateway", "bare"), ("gateway", "bare-ll"), ("gateway", "before"),
          ("before", "go"), ("gateway-mem", "go"), ("gateway", "gateway-mem")]


def _run(mode: str, agents: int, extra: list[str], impls: list[str],
         before: str | None = None) -> list[dict[str, Any]]:
    bench, env = BENCH, None
    if before is not None:  # another checkout's gateway, by its own bench script
        bench = str(Path(before) / "bench" / "bench_gateway.py")
        env = {**os.environ, "PYTHONPATH": before, "ARES_GATEWAY_PURE": "1"}
    args = [sys.executable, bench, "--mode", mode, "--agents", str(agents), *ONE, *extra]
    for impl in impls:
        args += ["--impl", impl]
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env)
    rows: list[dict[str, Any]] = json.loads(out.stderr.strip().splitlines()[-1])
    if before is not None:
        for row in rows:
            row["impl"] = "before"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--only", action="append", choices=sorted(ROWS), help="row groups to run (default: all)")
    ap.add_argument("--save", help="also write every round's rows to this JSON file")
    ap.add_argument("--body", default="small", choices=["small", "large", "history"],
                    help="request body: small chat, a ~96 KB Claude Code body, or a 500-message chat history")
    ap.add_argument("--before", metavar="DIR", help="also run the gateway of the checkout at DIR as 'before'")
    ap.add_argument("--grow", action="store_true",
                    help="each agent's body grows every turn (bench_gateway.py --grow), as a real "
                         "session's does")
    ap.add_argument("--impl", action="append", dest="impls", metavar="IMPL",
                    help="the implementations each row runs (bench_gateway.py --impl; e.g. gateway-mem, the "
                         "gateway recording in memory only), instead of the row's own list")
    ap.add_argument("--no-canonical", action="store_true",
                    help="the HTTP responder polls with canonical=0: the native body only, all the Go "
                         "proxy hands out")
    args = ap.parse_args()
    plan = [row for group in (args.only or list(ROWS)) for row in ROWS[group]]
    if args.impls:  # the same implementations in every row
        plan = [(row, extra, args.impls) for row, extra, _ in plan]
    rounds: list[dict[tuple[str, int], dict[str, dict[str, Any]]]] = []
    for i in range(args.rounds):
        got: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
        for (mode, agents), extra, impls in plan:
            extra = [*extra, "--body", args.body, *(["--no-canonical"] if args.no_canonical else []),
                     *(["--grow"] if args.grow else [])]
            if args.body != "small":  # a larger body costs more per turn: fewer turns for the same time
                extra += ["--turn-target", "5000"]
            # One run per implementation, so one that fails (the bare web.Application loop resets
            # connections at 512 agents with large bodies) leaves the others' rows.
            jobs = [(impl, None) for impl in impls]
            if args.before and "gateway" in impls:
                jobs.append(("gateway", args.before))
            for impl, before in jobs:
                try:
                    rows = _run(mode, agents, extra, [impl], before=before)
                except subprocess.CalledProcessError as exc:
                    tail = (exc.stderr or "").strip().splitlines()[-1:] or ["?"]
                    print(f"  {mode} {agents} {'before' if before else impl} failed: {tail[0]}",
                          file=sys.stderr)
                    continue
                for row in rows:
                    got[(mode, agents)][str(row["impl"])] = row
        rounds.append(got)
        print(f"round {i + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        if args.save:
            Path(args.save).write_text(
                json.dumps([{f"{m} {a}": v for (m, a), v in r.items()} for r in rounds], indent=1))
    for (mode, agents), *_ in plan:
        print(f"{mode} agents={agents}")
        impls = sorted({impl for r in rounds for impl in r[(mode, agents)]})
        for impl in impls:
            rows = [r[(mode, agents)][impl] for r in rounds if impl in r[(mode, agents)]]
            print(
                f"  {impl:>13}: {statistics.median(x['turns_per_s'] for x in rows):7.0f} turns/s"
                f"  p50 {statistics.median(x['p50_ms'] for x in rows):7.3f} ms"
                f"  p99 {statistics.median(x['p99_ms'] for x in rows):7.3f} ms"
                f"  server CPU {statistics.median(x['gateway_cpu_us'] for x in rows):4.0f} µs/turn"
                + (f"  responder {statistics.median(x['responder_cpu_us'] for x in rows):4.0f} µs"
                   f"  load generator {statistics.median(x['loadgen_cpu_us'] for x in rows):4.0f} µs"
                   f"  idle {statistics.median(x['idle'] for x in rows):4.0%}"
                   if all("idle" in x for x in rows) else "")
            )
        for a, b in RATIOS:
            both = [r[(mode, agents)] for r in rounds if a in r[(mode, agents)] and b in r[(mode, agents)]]
            if both:
                per = [r[a]["turns_per_s"] / r[b]["turns_per_s"] for r in both]
                p50 = [r[a]["p50_ms"] / r[b]["p50_ms"] for r in both]
                print(
                    f"  {a}/{b}: throughput {statistics.median(per):.2f} (rounds "
                    f"{', '.join(f'{x:.2f}' for x in per)}), p50 {statistics.median(p50):.2f}"
                )


if __name__ == "__main__":
    main()
