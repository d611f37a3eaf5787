"""The weight-update fence: drain time with many sessions in flight, and the turn latency it adds when idle.

Two processes over real loopback HTTP: the gateway with an in-process policy (``PolicyServer``, a fixed
``--delay`` per answer, ``concurrency`` = sessions, so every session's turn is in flight at once) on
uvloop, and the load generator (this process: one agent per session, each doing chat-completion turns
back to back with aiohttp).

``drain``: after a warm-up the gateway pauses sampling ``--fences`` times (``mode``: drain or abort),
each held ``--hold`` seconds, and reports the seconds each pause took to return (the drain) and how
many generations were in flight when it began.

``latency``: the agents' p50/p99 turn latency with no fence ever paused, the policy called through the
fence (``fence``) and directly (``direct``: the PolicyServer sees a gateway without one), alternated
``--repeat`` times; the difference is what the fence's code path costs a turn when idle.

    python3 bench/bench_fence.py                                   # drain at 64 and 512, then latency
    python3 bench/bench_fence.py drain --sessions 512 --mode abort
    python3 bench/bench_fence.py latency --sessions 8 --turns 3000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

ADMIN = "bench-admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
                print(json.dumps({"ready": True, "sessions": ids}), flush=True)
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


async def _agents(url: str, ids: list[list[str]], stop: asyncio.Event, lat: list[float], max_turns: int | None) -> int:
    import aiohttp

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    turns = 0

    async def agent(s: aiohttp.ClientSession, sid: str, token: str) -> None:
        nonlocal turns
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.post(f"{url}/s/{sid}/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"}) as r:
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


def _start(args: argparse.Namespace, sessions: int, path: str,
           fences: int = 0) -> tuple[subprocess.Popen[str], int, list[list[str]]]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "_serve", str(port), str(sessions), str(args.delay), path, str(fences),
         str(args.hold), args.mode, str(args.warmup)],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
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
    import uvloop

    proc, port, ids = _start(args, args.sessions_latency, path)
    try:
        lat: list[float] = []

        async def run() -> int:
            stop = asyncio.Event()
            warm: list[float] = []
            await _agents(f"http://127.0.0.1:{port}", ids, stop, warm, 200)
            stop = asyncio.Event()
            return await _agents(f"http://127.0.0.1:{port}", ids, stop, lat, args.turns)

        uvloop.run(run())
    finally:
        proc.terminate()
        proc.wait()
    lat.sort()
    return {"path": path, "turns": len(lat), "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        a = sys.argv[2:]
        serve(int(a[0]), int(a[1]), float(a[2]), a[3], int(a[4]), float(a[5]), a[6], float(a[7]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=["all", "drain", "latency"], default="all")
    ap.add_argument("--sessions", type=int, action="append", help="sessions in flight for drain (64 and 512)")
    ap.add_argument("--mode", choices=["drain", "abort"], default="drain")
    ap.add_argument("--delay", type=float, default=0.05, help="seconds the policy takes per answer (drain)")
    ap.add_argument("--fences", type=int, default=5)
    ap.add_argument("--hold", type=float, default=0.5, help="seconds each pause is held")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--sessions-latency", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.what in ("all", "drain"):
        for n in args.sessions or [64, 512]:
            print(json.dumps(drain(args, n)), flush=True)
    if args.what in ("all", "latency"):
        delay, args.delay = args.delay, 0.0
        rows: dict[str, list[dict[str, Any]]] = {"fence": [], "direct": []}
        for i in range(args.repeat):
            for path in ("direct", "fence") if i % 2 == 0 else ("fence", "direct"):  # neither always first
                row = latency(args, path)
                rows[path].append(row)
                print(json.dumps(row), flush=True)
        for path, got in rows.items():
            print(json.dumps({"path": path, "p50_us_median": statistics.median(r["p50_us"] for r in got),
                              "p99_us_median": statistics.median(r["p99_us"] for r in got)}), flush=True)
        args.delay = delay


if __name__ == "__main__":
    main()
