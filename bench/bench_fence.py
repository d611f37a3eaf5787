"""The weight-update fence: drain time with many sessions in flight, and the turn latency it adds when idle.

Two processes over real loopback HTTP: the gateway with an in-process policy (``PolicyServer``, a fixed
``--delay`` per answer, ``concurrency`` = sessions, so every session's turn is in flight at once) on
uvloop, and the load generator (this process: one agent per session, each doing chat-completion turns
back to back with aiohttp).

``drain``: after a warm-up the gateway pauses sampling ``--fences`` times (``mode``: drain or abort),
each held ``--hold`` seconds, and reports the seconds each pause took to return (the drain) and how
many generations were in flight when it began.

``latency``: the agents' p50/p99 turn latency with no fence ever paused, the policy called through the
fence (``fence``) and directly (``direct``: the PolicyServer sees a gateway without one), and, with
``--baseline DIR``, the gateway of another checkout (``base``: e.g. the commit before the fence, whose
agent API and broker have no fence code either), run in turn ``--repeat`` times (the order rotated so
that none is always first); each path's median of its runs' p50s, their spread and the ratio to
``direct`` (and ``base``) say what the fence's code path costs a turn outside a pause. ``--stream``:
the agents ask for SSE streams (as Claude Code and Codex do), the path whose wait also watches for a
pause to begin.

``wait``: that streaming wait alone, in process (a real ``SamplingFence``, never paused): awaiting a
request's answer while watching for a pause to begin, as the agent API does for a streaming request,
against awaiting the answer alone, as the gateway before the fence did; best of ``--repeat`` rounds.

    python3 bench/bench_fence.py                                   # drain at 64 and 512, then latency
    python3 bench/bench_fence.py drain --sessions 512 --mode abort
    python3 bench/bench_fence.py latency --sessions 8 --turns 3000 --repeat 3
    git archive <commit before the fence> | tar -x -C /tmp/prefence
    python3 bench/bench_fence.py latency --baseline /tmp/prefence --stream
    python3 bench/bench_fence.py wait --repeat 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.support.polling import free_port

ADMIN = "bench-admin-token-0123456789"


# ------------------------------------------------------------------------- the gateway process


def serve(port: int, sessions: int, delay: float, path: str, fences: int, hold: float, mode: str,
          warmup: float) -> None:
    """The gateway process: sessions, a PolicyServer, and (path "fence-drain") the fences it times."""
    import uvloop

    from ares_gateway import Completion, Gateway
    from ares_gateway.policies import PolicyServer

    async def policy(request: Any) -> Completion:
        if delay:
            await asyncio.sleep(delay)
        return Completion(text="ok")

    class Direct:
        """The gateway as a PolicyServer sees it, without the fence: the policy is called directly."""

        def __init__(self, gw: Gateway) -> None:
            self.next_request = gw.next_request
            self.respond = gw.respond

    async def main() -> None:
        async with Gateway(host="127.0.0.1", port=port, admin_token=ADMIN, data_dir=False,
                           max_parked_per_session=4) as gw:
            infos = [await gw.create_session(f"s{i}") for i in range(sessions)]
            ids = [[i.session_id, i.token] for i in infos]
            served: Any = Direct(gw) if path == "direct" else gw
            async with PolicyServer(served, policy, concurrency=max(sessions, 1), poll_interval=0.5):
                import ares_gateway

                print(json.dumps({"ready": True, "sessions": ids, "package": ares_gateway.__file__}),
                      flush=True)
                if path != "fence-drain":
                    await asyncio.Event().wait()
                await asyncio.sleep(warmup)
                results = []
                for _ in range(fences):
                    t0 = time.perf_counter()
                    report = await gw.pause_sampling(mode, timeout=120)
                    took = time.perf_counter() - t0
                    results.append({"drain_s": took, "in_flight": report.in_flight, "aborted": report.aborted,
                                    "parked": report.parked})
                    await asyncio.sleep(hold)
                    gw.resume_sampling()
                    await asyncio.sleep(warmup)
                print(json.dumps({"fences": results}), flush=True)
                await asyncio.Event().wait()

    uvloop.run(main())


# ------------------------------------------------------------------------- the agents


async def _agents(url: str, ids: list[list[str]], stop: asyncio.Event, lat: list[float],
                  max_turns: int | None, stream: bool = False) -> int:
    import aiohttp

    request: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        request["stream"] = True
    body = json.dumps(request).encode()
    turns = 0

    async def agent(s: aiohttp.ClientSession, sid: str, token: str) -> None:
        nonlocal turns
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.post(f"{url}/s/{sid}/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json",
                                       "Authorization": f"Bearer {token}"}) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append(time.perf_counter() - t0)
            turns += 1
            if max_turns is not None and turns >= max_turns:
                stop.set()

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        tasks = [asyncio.create_task(agent(s, sid, token)) for sid, token in ids]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return turns


def _start(args: argparse.Namespace, sessions: int, path: str, fences: int = 0,
           package: str | None = None) -> tuple[subprocess.Popen[str], int, list[list[str]]]:
    """The gateway process; ``package``: a checkout whose ``ares_gateway`` it imports instead of this
    one's."""
    port = free_port()
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([package, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [sys.executable, __file__, "_serve", str(port), str(sessions), str(args.delay), path, str(fences),
         str(args.hold), args.mode, str(args.warmup)],
        stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    if package is not None and not ready["package"].startswith(os.path.abspath(package)):
        proc.terminate()
        raise SystemExit(f"--baseline {package}: the gateway imported {ready['package']} instead")
    return proc, port, ready["sessions"]


def drain(args: argparse.Namespace, sessions: int) -> dict[str, Any]:
    import uvloop

    proc, port, ids = _start(args, sessions, "fence-drain", args.fences)
    try:
        lat: list[float] = []

        async def run() -> dict[str, Any]:
            stop = asyncio.Event()
            load = asyncio.create_task(_agents(f"http://127.0.0.1:{port}", ids, stop, lat, None))
            assert proc.stdout is not None
            line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
            stop.set()
            turns = await load
            return {"turns": turns, **json.loads(line)}

        out = uvloop.run(run())
    finally:
        proc.terminate()
        proc.wait()
    fences = out["fences"]
    drains = [f["drain_s"] * 1000 for f in fences]
    return {"sessions": sessions, "mode": args.mode, "delay_ms": args.delay * 1000, "fences": len(fences),
            "drain_ms_p50": statistics.median(drains), "drain_ms_max": max(drains),
            "in_flight_p50": statistics.median(f["in_flight"] for f in fences),
            "aborted_p50": statistics.median(f["aborted"] for f in fences), "turns": out["turns"]}


def latency(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """One run of the turn-latency load on ``path``: fence, direct, or base (``--baseline``'s gateway)."""
    import uvloop

    if path == "base":
        proc, port, ids = _start(args, args.sessions_latency, "fence", package=args.baseline)
    else:
        proc, port, ids = _start(args, args.sessions_latency, path)
    try:
        lat: list[float] = []
        cpu: list[float] = []

        async def run() -> int:
            stop = asyncio.Event()
            warm: list[float] = []
            await _agents(f"http://127.0.0.1:{port}", ids, stop, warm, 200, args.stream)
            stop = asyncio.Event()
            cpu.append(_cpu_seconds(proc.pid))
            turns = await _agents(f"http://127.0.0.1:{port}", ids, stop, lat, args.turns, args.stream)
            cpu.append(_cpu_seconds(proc.pid))
            return turns

        uvloop.run(run())
    finally:
        proc.terminate()
        proc.wait()
    lat.sort()
    return {"path": path, "stream": args.stream, "turns": len(lat), "p50_us": lat[len(lat) // 2] * 1e6,
            "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
            "gw_cpu_us_per_turn": (cpu[1] - cpu[0]) / len(lat) * 1e6}


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used: unlike a turn's latency, what the
    gateway spends on a turn does not grow with what else the machine runs."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per path: the median of its runs' p50s and p99s, the p50s' spread, the gateway's CPU per turn,
    and the ratios of p50 and CPU to the paths without the fence's code (``direct``; ``base``, when run)."""
    p50 = {path: statistics.median(r["p50_us"] for r in got) for path, got in rows.items()}
    cpu = {path: statistics.median(r["gw_cpu_us_per_turn"] for r in got) for path, got in rows.items()}
    out = []
    for path, got in rows.items():
        p50s = sorted(r["p50_us"] for r in got)
        row: dict[str, Any] = {"path": path, "runs": len(got), "p50_us_median": round(p50[path], 1),
                               "p50_us_min": round(p50s[0], 1), "p50_us_max": round(p50s[-1], 1),
                               "p99_us_median": round(statistics.median(r["p99_us"] for r in got), 1),
                               "gw_cpu_us_per_turn_median": round(cpu[path], 1)}
        for ref in ("direct", "base"):
            if ref in p50 and ref != path:
                row[f"p50_vs_{ref}"] = round(p50[path] / p50[ref], 3)
                row[f"cpu_vs_{ref}"] = round(cpu[path] / cpu[ref], 3)
        out.append(row)
    return out


def wait_cost(rounds: int, n: int = 50_000) -> dict[str, Any]:
    """Microseconds a streaming request's wait for its answer costs with the fence's watch for a pause
    (``agent_api``'s ``_stream_when_answered`` loop, sampling open) and without it (``await``)."""
    import uvloop

    from ares_gateway.core.broker import Broker
    from ares_gateway.core.fence import SamplingFence

    async def plain(fut: asyncio.Future[None]) -> None:
        await fut

    async def fenced(fut: asyncio.Future[None], fence: SamplingFence) -> None:
        resp = None
        while not fut.done():
            if resp is None and not fence.paused:
                await asyncio.wait((fut, fence.pause_signal()), return_when=asyncio.FIRST_COMPLETED)
                continue

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fence = SamplingFence(Broker())
        best: dict[str, float] = {}
        for _ in range(rounds):
            for name in ("plain", "fenced"):
                t0 = time.process_time()  # CPU time: what else the machine runs does not count
                for _ in range(n):
                    fut = loop.create_future()
                    loop.call_soon(fut.set_result, None)  # the answer, from another callback
                    await (plain(fut) if name == "plain" else fenced(fut, fence))
                took = (time.process_time() - t0) / n * 1e6
                best[name] = min(best.get(name, took), took)
        return {"what": "stream wait", "rounds": rounds, "per_turn_us_plain": round(best["plain"], 2),
                "per_turn_us_fenced": round(best["fenced"], 2),
                "fence_adds_us": round(best["fenced"] - best["plain"], 2)}

    return uvloop.run(run())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        a = sys.argv[2:]
        serve(int(a[0]), int(a[1]), float(a[2]), a[3], int(a[4]), float(a[5]), a[6], float(a[7]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=["all", "drain", "latency", "wait"], default="all")
    ap.add_argument("--sessions", type=int, action="append", help="sessions in flight for drain (64 and 512)")
    ap.add_argument("--mode", choices=["drain", "abort"], default="drain")
    ap.add_argument("--delay", type=float, default=0.05, help="seconds the policy takes per answer (drain)")
    ap.add_argument("--fences", type=int, default=5)
    ap.add_argument("--hold", type=float, default=0.5, help="seconds each pause is held")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--sessions-latency", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="latency: the agents ask for SSE streams")
    ap.add_argument("--baseline", metavar="DIR",
                    help="latency: also time the gateway of this checkout (e.g. the commit before the fence)")
    args = ap.parse_args()
    if args.what in ("all", "drain"):
        for n in args.sessions or [64, 512]:
            print(json.dumps(drain(args, n)), flush=True)
    if args.what in ("all", "latency"):
        delay, args.delay = args.delay, 0.0
        paths = ["direct", "fence", *(["base"] if args.baseline else [])]
        rows: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
        for i in range(args.repeat):
            for path in paths[i % len(paths):] + paths[:i % len(paths)]:  # rotated: none always first
                row = latency(args, path)
                rows[path].append(row)
                print(json.dumps(row), flush=True)
        for row in summarize(rows):
            print(json.dumps({"summary": True, "stream": args.stream, **row}), flush=True)
        args.delay = delay
    if args.what in ("all", "wait"):
        print(json.dumps(wait_cost(args.repeat)), flush=True)


if __name__ == "__main__":
    main()
