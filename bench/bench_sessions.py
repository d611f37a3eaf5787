"""Thousands of sessions on one gateway: what a remote-sandbox run brings to the trainer's node.

The gateway is the real CLI (``python3 -m ares_gateway.cli serve``: uvloop, durable recording in a fresh
data dir, no flag raised for the size), started under a soft open-file limit of 1024 (``--soft-nofile``,
common on Linux machines), which it must raise itself. This process creates the sessions
over the control API and plays their agents; ``--pollers`` other processes answer through ``/poll``
batches and ``/respond``, as a trainer would. Each case:

1. **idle**: ``--sessions`` sessions created (``POST /sessions``); the gateway's RSS growth per session.
2. **burst**: every session sends one turn at once (that many requests parked together, one client
   connection each).
3. **paced**: ``--measured`` more turns, round-robin over the sessions, started at ``--rate`` turns/s
   whatever the answers do: the gateway's CPU per turn (its process and its children, from /proc), the
   agent-side latency p50/p99 (request sent to answer read: the gateway's added latency plus the
   poller's round trip, an upper bound on the gateway's own share), the rate reached.
4. **check**: every request answered with a 200 and every session's turn count in ``GET /sessions``
   equal to the turns it took (``lost`` counts the difference).

    python3 bench/bench_sessions.py                                   # 1,024 / 4,096 / 16,384, both bodies
    python3 bench/bench_sessions.py --sessions 16384 --body small --repeat 3
    python3 bench/bench_sessions.py --sessions 2048 --measured 2048 --rate 1000 --body small --json
                                                        # what tests/gateway/test_sessions_at_scale.py runs

With the defaults (``--measured 32768``) a 16,384-session case takes 3 turns a session (49,152), a
1,024-session case 33: the CPU per turn is compared on the same paced load at every size. Needs an
open-file limit of about ``2 x sessions + 2,000`` across this process and the gateway (each raises its
soft limit to its hard one); a case that does not fit says so.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import orjson

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.support.polling import answer_polls, free_port, rss_kib

ADMIN = "bench-sessions-admin-token-0123456789"
#: Bodies an agent sends: a small chat call, and one of about 20 KB (a short system prompt, a task
#: and tool results: early in a real session).
BODIES = ("small", "20k")


def _proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live children (the body parser's workers, if any)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _proc_stat(int(entry))
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def body_bytes(kind: str) -> bytes:
    """The chat-completions body of every turn of a ``kind`` case."""
    if kind == "small":
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hello"}]}
    elif kind == "20k":
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 120},
                                          {"role": "user", "content": "Fix the failing test in src/. " * 40}]
        for i in range(6):
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps({"command": f"cat src/mod{i}.py"})}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                             "content": f"def f{i}(x):\n    return x + {i}\n" * 80})
        body = {"model": "m", "messages": messages, "tools": [{"type": "function", "function": {
            "name": "bash", "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]}
    else:
        raise ValueError(f"unknown body {kind!r}: one of {', '.join(BODIES)}")
    return orjson.dumps(body)


# ---------------------------------------------------------------- child processes


class Gateway:
    """``ares-gateway serve`` in a child process with a fresh data dir, until :meth:`stop`."""

    def __init__(self, data_dir: str, *extra: str, soft_nofile: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(data_dir, "gateway.log"), "wb")  # closed in stop()
        env = {**os.environ, "ARES_GATEWAY_ADMIN_TOKEN": ADMIN}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", str(self.port),
             "--data-dir", os.path.join(data_dir, "data"), "--request-timeout", "600", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=(lambda: _set_soft_nofile(soft_nofile)) if soft_nofile else None)

    async def ready(self, timeout: float = 60.0) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited ({self.proc.returncode}): see {self.log.name}")
                try:
                    async with s.get(f"{self.url}/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not answer /healthz in {timeout:g} s")
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _set_soft_nofile(soft: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))


def _spawn_poller(url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_poller", url],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("a poller failed to start")
    return proc


# ---------------------------------------------------------------- the case


def raise_own_open_files(needed: int) -> None:
    """Lift this process's soft open-file limit to its hard one; raise when ``needed`` does not fit."""
    from ares_gateway.http.open_files import raise_open_file_limit

    have = raise_open_file_limit()
    if have < needed:
        raise RuntimeError(f"this case needs about {needed} open files in the load generator, its hard "
                           f"limit is {have}: `ulimit -n {needed}` (as root) or fewer --sessions")


async def _play(url: str, sessions: int, kind: str, measured: int, rate: float,
                gw_pid: int) -> dict[str, Any]:
    import aiohttp

    body = body_bytes(kind)
    admin = {"authorization": f"Bearer {ADMIN}"}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=600)
    timeout = aiohttp.ClientTimeout(total=900)
    out: dict[str, Any] = {"sessions": sessions, "body": kind, "body_bytes": len(body)}
    errors: list[str] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        rss0 = rss_kib(gw_pid)
        sem = asyncio.Semaphore(64)

        async def create(i: int) -> tuple[str, str]:
            async with sem, s.post(f"{url}/sessions", json={"session_id": f"s{i:05d}"}, headers=admin) as r:
                info = await r.json()
                if r.status != 201:
                    raise RuntimeError(f"creating a session: {r.status} {info}")
                return info["session_id"], info["token"]

        t0 = time.perf_counter()
        made = await asyncio.gather(*(create(i) for i in range(sessions)))
        out["create_s"] = time.perf_counter() - t0
        out["idle_session_kib"] = (rss_kib(gw_pid) - rss0) / sessions
        taken = dict.fromkeys((sid for sid, _ in made), 0)

        async def turn(sid: str, token: str) -> float:
            headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
            t = time.perf_counter()
            try:
                async with s.post(f"{url}/s/{sid}/v1/chat/completions", data=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        errors.append(f"{r.status}: {(await r.text())[:200]}")
                        return -1.0
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return -1.0
            taken[sid] += 1
            return time.perf_counter() - t

        # The load generator's own collector is off while it measures: with 16,384 connections, their
        # tasks and responses alive, its collections took up to 150-470 ms each (counted with
        # gc.callbacks), which the agent-side latency would count as the gateway's.
        gc.collect()
        gc.freeze()
        gc.disable()
        # Burst: one turn each, all at once.
        t0 = time.perf_counter()
        await asyncio.gather(*(turn(sid, tok) for sid, tok in made))
        out["burst_s"] = time.perf_counter() - t0

        # Paced: turns started on a clock, round-robin over the sessions.
        cpu0, t0 = _tree_cpu_seconds(gw_pid), time.perf_counter()
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for k in range(measured):
            due = start + k / rate
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            sid, tok = made[k % sessions]
            tasks.append(asyncio.create_task(turn(sid, tok)))
        latencies = [x for x in await asyncio.gather(*tasks) if x >= 0]
        elapsed = time.perf_counter() - t0
        cpu = _tree_cpu_seconds(gw_pid) - cpu0
        gc.enable()
        gc.unfreeze()
        latencies.sort()
        n = len(latencies)
        out.update({
            "paced_turns": measured, "rate_asked": rate, "rate_reached": measured / elapsed,
            "gateway_cpu_us_per_turn": cpu / max(1, measured) * 1e6,
            "gateway_cpu_share": cpu / elapsed,
            "p50_ms": latencies[n // 2] * 1000 if n else float("nan"),
            "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000 if n else float("nan"),
        })
        out["rss_session_kib"] = (rss_kib(gw_pid) - rss0) / sessions

        # Check: every turn answered and recorded.
        async with s.get(f"{url}/sessions", headers=admin) as r:
            listed = {x["session_id"]: x["turns"] for x in await r.json()}
        expected = sessions + measured
        out["turns"] = sum(taken.values())
        out["recorded"] = sum(listed.get(sid, 0) for sid in taken)
        out["lost"] = expected - out["turns"] + sum(abs(listed.get(sid, 0) - n) for sid, n in taken.items())
        out["errors"] = len(errors)
        out["first_errors"] = errors[:5]
    return out


def run_case(sessions: int, kind: str = "small", *, measured: int = 32768, rate: float = 2000.0,
             pollers: int = 2, gateway_args: tuple[str, ...] = (),
             gateway_soft_nofile: int | None = None) -> dict[str, Any]:
    """One case (module docstring) on a fresh gateway; returns its numbers. ``gateway_soft_nofile``:
    start the gateway under this soft open-file limit (1024 is common on Linux), as a user's shell
    would; it must raise its own."""
    import uvloop

    from ares_gateway.cli._support import tune_gc

    raise_own_open_files(sessions + 512)
    # The load generator holds a connection, a task and a client response per session: with the
    # default collector its own pauses would be counted as the gateway's latency.
    tune_gc()
    with tempfile.TemporaryDirectory(prefix="ares-bench-sessions-") as tmp:
        gw = Gateway(tmp, *gateway_args, soft_nofile=gateway_soft_nofile)
        procs: list[subprocess.Popen[str]] = []
        try:
            uvloop.run(gw.ready())
            procs = [_spawn_poller(gw.url) for _ in range(pollers)]
            result = uvloop.run(_play(gw.url, sessions, kind, measured, rate, gw.proc.pid))
            result["gateway_exit"] = gw.proc.poll()
            return result
        finally:
            for p in procs:
                p.kill()
                p.wait()
            gw.stop()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_poller":
        answer_polls(sys.argv[2], ADMIN, canonical="0")
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, action="append", help="sessions (default 1024, 4096, 16384)")
    ap.add_argument("--body", action="append", choices=BODIES, help="body of every turn (default both)")
    ap.add_argument("--measured", type=int, default=32768, help="paced turns measured per case")
    ap.add_argument("--rate", type=float, default=2000.0, help="paced turns started per second")
    ap.add_argument("--pollers", type=int, default=2, help="processes answering through /poll")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; medians are reported")
    ap.add_argument("--soft-nofile", type=int, default=1024,
                    help="the gateway's soft open-file limit at start (0: this shell's)")
    ap.add_argument("--json", action="store_true", help="print each case's numbers as JSON")
    args = ap.parse_args()
    rows = []
    for kind in args.body or list(BODIES):
        for n in args.sessions or [1024, 4096, 16384]:
            runs = [run_case(n, kind, measured=args.measured, rate=args.rate, pollers=args.pollers,
                             gateway_soft_nofile=args.soft_nofile or None)
                    for _ in range(args.repeat)]
            med = runs[0]
            if len(runs) > 1:  # medians of the numbers; lost and errors summed
                med = {k: (statistics.median([r[k] for r in runs]) if isinstance(v, float) else v)
                       for k, v in runs[0].items()}
                med["lost"] = sum(r["lost"] for r in runs)
                med["errors"] = sum(r["errors"] for r in runs)
            rows.append(med)
            if args.json:
                print(json.dumps(med), flush=True)
            else:
                print(f"{kind:>5} sessions={n:6d}  lost {med['lost']}  errors {med['errors']}  "
                      f"idle {med['idle_session_kib']:.1f} KiB/session  "
                      f"with turns {med['rss_session_kib']:.1f} KiB/session  burst {med['burst_s']:.1f} s  "
                      f"paced {med['rate_reached']:.0f}/{med['rate_asked']:.0f} turns/s  "
                      f"cpu {med['gateway_cpu_us_per_turn']:.0f} µs/turn "
                      f"({med['gateway_cpu_share']:.2f} core)  "
                      f"p50 {med['p50_ms']:.1f} ms  p99 {med['p99_ms']:.1f} ms", flush=True)
    smallest = min(r["sessions"] for r in rows)
    base = {r["body"]: r for r in rows if r["sessions"] == smallest}
    for r in rows:
        b = base[r["body"]]
        if r is not b:
            ratio = r["gateway_cpu_us_per_turn"] / b["gateway_cpu_us_per_turn"]
            print(f"{r['body']:>5} sessions={r['sessions']:6d}: CPU per turn {ratio:.2f}x its value at "
                  f"{smallest}", flush=True)

if __name__ == "__main__":
    main()
