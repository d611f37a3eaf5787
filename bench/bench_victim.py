"""One hostile agent against the others, over real loopback HTTP.

Three scenarios, each against a gateway in its own process on uvloop (as ``ares-gateway serve``
runs it, ``tune_gc`` included, recording to a temporary data dir):

* ``victim`` (default): one agent sends 30 MB / 60,000-message chat bodies back to back (its own
  process) while another agent takes small turns back to back; the victim's turn latency (p50,
  p99, max) alone and under the big sender. The policy answers in the gateway's process
  (``--mode inproc``) or from a responder process over ``/poll`` (with the canonical form) +
  ``/respond`` (``--mode http``), so the /poll side of a 30 MB request is measured too.
* ``heads``: ``--conns`` connections each send an unfinished request head of about 1 MiB (128
  header lines of 8,000 bytes) and hold it; the gateway's RSS before, while they are open, and
  after they are closed.
* ``park``: one session parks ``--count`` 30 MB bodies nobody answers; how many were parked,
  how many refused (and with which status), and the gateway's RSS.

    python3 bench/bench_victim.py --repeat 3                      # victim, inproc
    python3 bench/bench_victim.py --mode http --repeat 3
    python3 bench/bench_victim.py --scenario heads --conns 500
    python3 bench/bench_victim.py --scenario park --count 12
    python3 bench/bench_victim.py --scenario heads --set max_head_bytes=2000000   # a looser head budget
    python3 bench/bench_victim.py --src /tmp/old-checkout ...     # another checkout's gateway

``--src`` runs another checkout's gateway (``git worktree add /tmp/old <commit>``); the settings
this script passes exist in both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import orjson
from bench_gateway import ADMIN, _gateway_main  # the same gateway child

from bench.support.polling import answer_polls, free_port  # the same poller

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1024 * 1024
SMALL = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def big_body(messages: int = 60_000, size: int = 30 * 1000 * 1000) -> bytes:
    """A chat body of ``messages`` alternating user/assistant messages, about ``size`` bytes."""
    per = max(1, size // messages - 42)
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": ("x" if i % 2 == 0 else "y") * per}
        for i in range(messages)
    ]
    return orjson.dumps({"model": "m", "messages": msgs})


# ---------------------------------------------------------------- child processes


def _big_sender_main(url: str, token: str, messages: int, size: int, vary: bool) -> None:
    import aiohttp
    import uvloop

    bodies = [big_body(messages, size)]
    if vary:  # a body unlike the last each turn: its first message differs
        bodies.append(bodies[0].replace(b'"content":"x', b'"content":"z', 1))

    async def main() -> None:
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            print("ready", flush=True)
            turn = 0
            while True:
                started = time.perf_counter()
                body = bodies[turn % len(bodies)]
                turn += 1
                async with s.post(f"{url}/v1/chat/completions", data=body, headers=headers) as r:
                    await r.read()
                print(f"{r.status} {time.perf_counter() - started:.3f}", flush=True)

    uvloop.run(main())


#: ``--set NAME=VALUE`` settings for the gateway (a JSON value, or a string).
_SETTINGS: dict[str, Any] = {}


def _spawn(src: str, args: list[str]) -> subprocess.Popen[str]:
    if args[0] == "--_gateway":
        args = [*args, orjson.dumps(_SETTINGS).decode()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"child {args[:2]} did not start: {line!r}")
    return proc


def _stop(*procs: subprocess.Popen[str] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


# ---------------------------------------------------------------- scenarios


async def _session(url: str) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(headers={"authorization": f"Bearer {ADMIN}"}) as s, \
            s.post(f"{url}/sessions", json={}) as r:
        assert r.status in (200, 201), await r.text()
        return dict(await r.json())


async def _victim_turns(url: str, token: str, seconds: float) -> list[float]:
    import aiohttp

    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    out: list[float] = []
    async with aiohttp.ClientSession() as s:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            started = time.perf_counter()
            async with s.post(f"{url}/v1/chat/completions", data=SMALL, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            out.append(time.perf_counter() - started)
            await asyncio.sleep(0.002)  # an agent between turns; keeps the victim from hogging a core
    return out


def victim(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = _spawn(args.src, ["--_gateway", str(port), args.mode])
    responder = sender = None
    try:
        if args.mode == "http":
            responder = _spawn(args.src, ["--_responder", url])
        victim_s = asyncio.run(_session(url))
        big_s = asyncio.run(_session(url))
        alone = asyncio.run(_victim_turns(victim_s["base_url"], victim_s["token"], 3.0))
        sender = _spawn(args.src, ["--_sender", big_s["base_url"], big_s["token"], str(args.messages),
                                   str(args.size_mb * 1000 * 1000), "1" if args.vary else "0"])
        time.sleep(0.5)
        rss_peak = 0.0
        loop_result: list[float] = []

        async def run() -> None:
            nonlocal rss_peak

            async def sample() -> None:
                nonlocal rss_peak
                while True:
                    rss_peak = max(rss_peak, _rss_mib(gw.pid))
                    await asyncio.sleep(0.2)

            sampler = asyncio.create_task(sample())
            loop_result.extend(await _victim_turns(victim_s["base_url"], victim_s["token"], args.seconds))
            sampler.cancel()

        asyncio.run(run())
        _stop(sender)
        assert sender.stdout is not None
        big = [line.split() for line in sender.stdout.read().splitlines() if line.strip()]
        big_ok = [float(t) for status, t in big if status == "200"]
        return {
            "alone_p50_ms": statistics.median(alone) * 1000,
            "alone_p99_ms": _pct(alone, 0.99) * 1000,
            "p50_ms": statistics.median(loop_result) * 1000,
            "p99_ms": _pct(loop_result, 0.99) * 1000,
            "max_ms": max(loop_result) * 1000,
            "over_50ms": sum(1 for x in loop_result if x > 0.05),
            "victim_turns": len(loop_result),
            "big_turns": len(big_ok),
            "big_other": len(big) - len(big_ok),
            "big_turn_s": statistics.median(big_ok) if big_ok else float("nan"),
            "rss_peak_mib": rss_peak,
        }
    finally:
        _stop(sender, responder, gw)


async def _heads(port: int, conns: int, pid: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    before = _rss_mib(pid)
    socks = []
    value = b"v" * 8000
    head = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"x-h%03d: %b\r\n" % (i, value) for i in range(126)))
    refused = 0
    for _ in range(conns):
        try:
            s = socket.create_connection(("127.0.0.1", port))
        except OSError:
            refused += 1
            continue
        s.setblocking(False)
        socks.append(s)
    for s in socks:
        try:
            await loop.sock_sendall(s, head)
        except OSError:
            pass
    await asyncio.sleep(1.0)
    held = _rss_mib(pid)
    answered = 0
    for s in socks:
        try:
            if (await asyncio.wait_for(loop.sock_recv(s, 16), 0.2)).startswith(
                (b"HTTP/1.1 4", b"HTTP/1.0 4")):
                answered += 1
        except (OSError, TimeoutError):
            pass
        s.close()
    await asyncio.sleep(1.5)
    after = _rss_mib(pid)
    return {"rss_before_mib": before, "rss_held_mib": held, "rss_after_close_mib": after,
            "answered_4xx": answered, "connect_refused": refused, "conns": len(socks)}


def heads(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    gw = _spawn(args.src, ["--_gateway", str(port), "http"])
    try:
        return asyncio.run(_heads(port, args.conns, gw.pid))
    finally:
        _stop(gw)


async def _park(url: str, count: int, pid: int, body: bytes) -> dict[str, float]:
    import aiohttp

    info = await _session(url)
    other = await _session(url)
    before = _rss_mib(pid)
    statuses: dict[int, int] = {}
    headers = {"authorization": f"Bearer {info['token']}", "content-type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        tasks = []
        for _ in range(count):
            tasks.append(asyncio.create_task(s.post(f"{info['base_url']}/v1/chat/completions", data=body,
                                                    headers=headers)))
            await asyncio.sleep(0.3)
        await asyncio.sleep(3.0)
        done = [t for t in tasks if t.done()]
        for t in done:
            r = t.result()
            statuses[r.status] = statuses.get(r.status, 0) + 1
            r.release()
        parked_rss = _rss_mib(pid)
        # Another session still gets its turn refused? No: it parks (nobody answers here).
        oh = {"authorization": f"Bearer {other['token']}", "content-type": "application/json"}
        other_task = asyncio.create_task(
            s.post(f"{other['base_url']}/v1/chat/completions", data=SMALL, headers=oh))
        await asyncio.sleep(1.0)
        other_parked = not other_task.done()
        other_task.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(other_task, *tasks, return_exceptions=True)
    return {"rss_before_mib": before, "rss_parked_mib": parked_rss, "refused": sum(statuses.values()),
            "still_parked": count - len(done), "statuses": statuses, "other_session_parked": other_parked}  # type: ignore[dict-item]


def park(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = _spawn(args.src, ["--_gateway", str(port), "http"])
    try:
        return asyncio.run(
            _park(url, args.count, gw.pid, big_body(args.messages, args.size_mb * 1000 * 1000)))
    finally:
        _stop(gw)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("--_"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "--_gateway":
            _gateway_main(int(rest[0]), rest[1], max_items=64, **orjson.loads(rest[2]))
        elif role == "--_responder":
            answer_polls(rest[0], ADMIN, max_items=64)
        elif role == "--_sender":
            _big_sender_main(rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("victim", "heads", "park"), default="victim")
    p.add_argument("--mode", choices=("inproc", "http"), default="inproc")
    p.add_argument("--seconds", type=float, default=15.0, help="victim turns under the big sender, per run")
    p.add_argument("--size-mb", type=int, default=30)
    p.add_argument("--messages", type=int, default=60_000)
    p.add_argument("--vary", action="store_true",
                   help="the big sender alternates two bodies unlike each other")
    p.add_argument("--conns", type=int, default=500)
    p.add_argument("--count", type=int, default=12)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--src", default=ROOT, help="the checkout whose ares_gateway is run (default: this one)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a Gateway setting for the gateway process (e.g. max_head_bytes=2000000)")
    args = p.parse_args()
    for item in args.set:
        name, _, value = item.partition("=")
        try:
            _SETTINGS[name] = orjson.loads(value)
        except orjson.JSONDecodeError:
            _SETTINGS[name] = value
    fn = {"victim": victim, "heads": heads, "park": park}[args.scenario]
    runs = []
    for i in range(args.repeat):
        got = fn(args)
        runs.append(got)
        print(f"run {i + 1}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in got.items()), flush=True)
    if args.repeat > 1:
        keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        med = {k: statistics.median(float(r[k]) for r in runs) for k in keys}
        print("median: " + ", ".join(f"{k}={v:.1f}" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
