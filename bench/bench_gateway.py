"""Gateway throughput and latency under N concurrent simulated agents, over real loopback HTTP.

Processes: the gateway (``ares-gateway``'s Gateway on uvloop), the load generator
(this process: N agents doing turns), and for the HTTP path a separate responder
process (one long-poll loop: ``GET /poll?max=`` then one batched ``POST /respond``),
as a trainer in another process would be. The in-process path answers inside the
gateway process through ``Gateway.next_request`` / ``respond``.

    python3 bench/bench_gateway.py                      # the full table (takes a few minutes)
    python3 bench/bench_gateway.py --agents 64 --mode http --body small --repeat 3
    python3 bench/bench_gateway.py --instructions       # instructions per turn, under callgrind
    # against the floors and the Go proxy:
    python3 bench/bench_gateway.py --impl bare --impl go --impl gateway
    # latency per µs of server CPU:
    python3 bench/bench_gateway.py --impl bare-ll --burn-us 50 --agents 1 --mode inproc

Reports turns/s, per-turn latency p50/p99 (agent side), CPU per turn of the server, the responder
and the load generator with the machine's idle share (which process limits a row), and memory per
parked request;
with ``--instructions``, the server process's instruction count per turn at one agent
(callgrind), which does not move with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import orjson

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.support.polling import answer_polls, free_port, rss_kib

ADMIN = "bench-admin-token-0123456789"
#: Microseconds of CPU the bare loops spend on each agent request (``--burn-us``), in their children.
_BURN_ENV = "ARES_BENCH_BURN_US"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (robust to a busy machine, unlike wall time)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_jiffies() -> tuple[int, int]:
    """The machine's idle (and iowait) and total CPU time so far, in jiffies, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


# ---------------------------------------------------------------- child processes


def _gateway_main(port: int, mode: str, max_items: int = 1024, **settings: Any) -> None:
    """A gateway child (``settings`` go to ``Gateway``); with mode ``inproc`` its own loop answers
    every request, up to ``max_items`` a poll; otherwise an HTTP responder does."""
    import uvloop

    from ares_gateway import Completion, Gateway
    from ares_gateway.cli._support import tune_gc

    tune_gc()  # as `ares-gateway serve` does

    async def main() -> None:
        async with Gateway(port=port, admin_token=ADMIN, request_timeout=600, **settings) as gw:
            print("ready", flush=True)
            if mode == "inproc":
                answer = Completion(text="ok")
                broker = gw.broker
                while True:
                    for req in await broker.poll(max_items=max_items, wait=3600, lease=None):
                        broker.respond(req.id, answer)
            else:
                await asyncio.Event().wait()

    uvloop.run(main())


class _ParkLoop:
    """The bare loops' whole job, whatever HTTP layer serves them: park each agent body on a
    future, hand the bodies to /poll, set the answers /respond names. No parsing, auth,
    canonical form or recording."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self._ids = itertools.count()
        self._answer = orjson.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})
        self._burn = float(os.environ.get(_BURN_ENV, "0")) / 1e6

    async def agent(self, body: bytes) -> bytes:
        if self._burn:  # stand-in server work: what a microsecond of it costs the agent
            until = time.perf_counter() + self._burn
            while time.perf_counter() < until:
                pass
        rid = next(self._ids)
        fut = self._pending[rid] = self._loop.create_future()
        self._queue.put_nowait((rid, body))
        return await fut

    async def poll(self) -> bytes:
        items = [await self._queue.get()]
        while not self._queue.empty() and len(items) < 1024:
            items.append(self._queue.get_nowait())
        return orjson.dumps([{"id": rid, "request": orjson.Fragment(body)} for rid, body in items])

    def respond(self, body: bytes) -> bytes:
        for item in orjson.loads(body):
            self._pending.pop(item["id"]).set_result(self._answer)
        return b'{"status":"ok"}'

    async def serve(self, mode: str) -> None:
        """Answer in process (``inproc``), or leave it to /poll + /respond, until killed."""
        if mode == "inproc":
            while True:
                rid, _ = await self._queue.get()
                self._pending.pop(rid).set_result(self._answer)
        await asyncio.Event().wait()


def _bare_main(port: int, mode: str, lowlevel: bool = False) -> None:
    """The floor to compare against: aiohttp + uvloop parking each request on a future, answered
    in process or through /poll + /respond, with no parsing, auth, canonical form or recording.
    ``lowlevel``: on aiohttp's low-level ``web.Server`` (as the gateway serves) instead of
    ``web.Application``."""
    import uvloop
    from aiohttp import web

    async def main() -> None:
        park = _ParkLoop()

        async def agent(request: web.BaseRequest) -> web.Response:
            return web.Response(body=await park.agent(await request.read()), content_type="application/json")

        async def poll(request: web.BaseRequest) -> web.Response:
            return web.Response(body=await park.poll(), content_type="application/json")

        async def respond(request: web.BaseRequest) -> web.Response:
            return web.Response(body=park.respond(await request.read()), content_type="application/json")

        runner: web.BaseRunner
        if lowlevel:

            async def dispatch(request: web.BaseRequest) -> web.Response:
                if request.path == "/poll":
                    return await poll(request)
                if request.path == "/respond":
                    return await respond(request)
                return await agent(request)

            runner = web.ServerRunner(web.Server(dispatch, access_log=None))
        else:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_post("/s/{sid}/v1/{tail:.*}", agent)
            app.router.add_get("/poll", poll)
            app.router.add_post("/respond", respond)
            runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await park.serve(mode)

    uvloop.run(main())


# ---------------------------------------------------------------- load generator


#: ``--grow``: how many bodies each agent goes through, each two messages longer than the one before.
GROW_STEPS = 20


def _grown(kind: str, steps: int = GROW_STEPS) -> list[bytes]:
    """The ``kind`` body and ``steps - 1`` longer ones, each adding a tool call and its result to the
    one before (what a real agent's next turn sends): with ``--grow`` an agent sends them in turn,
    so the gateway sees a session's history grow, then start over, as after a compaction."""
    _, raw, _ = _bodies(kind)
    body = json.loads(raw)
    out = []
    for t in range(steps):
        out.append(json.dumps(body).encode())
        if kind == "large":
            body["messages"] += [
                {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_g{t}", "name": "Tool1",
                                                   "input": {"arg0": f"cat file{t}.py"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_g{t}",
                                              "content": f"line {t}\n" * 60}]},
            ]
        else:
            body["messages"] += [
                {"role": "assistant", "content": f"Step g{t}.",
                 "tool_calls": [{"id": f"call_g{t}", "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps({"command": f"cat file{t}.py"})}}]},
                {"role": "tool", "tool_call_id": f"call_g{t}", "content": f"line {t}\n" * 60},
            ]
    return out


def _bodies(kind: str) -> tuple[str, bytes, dict[str, str]]:
    if kind == "small":
        body = {"model": "m",
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}
        return "/v1/chat/completions", json.dumps(body).encode(), {}
    if kind == "history":
        # Late in a long mini-swe-agent-style session: 500 chat messages (bash tool calls and their results).
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant. " * 40},
                                      {"role": "user", "content": "Fix the failing test. " * 20}]
        for i in range(249):
            msgs.append({"role": "assistant", "content": f"Step {i}: look around.", "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps({"command": f"ls -la src/{i}"})}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}",
                         "content": json.dumps({"returncode": 0, "output": "file.py\n" * 20})})
        body = {"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {
            "name": "bash", "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]}
        return "/v1/chat/completions", json.dumps(body).encode(), {}
    # A Claude-Code-sized Anthropic body: system blocks, 25 tools, a conversation with tool results (~96 KB,
    # as captured).
    tools = [
        {
            "name": f"Tool{i}",
            "description": "Runs a thing. " * 150,
            "input_schema": {"type": "object", "properties": {
                f"arg{j}": {"type": "string", "description": "x" * 40} for j in range(8)}},
        }
        for i in range(25)
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": "fix the bug"}]}]
    for i in range(12):
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"step {i}"}, {
            "type": "tool_use", "id": f"toolu_{i}", "name": "Tool1", "input": {"arg0": "ls -la " * 5}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "file.txt\n" * 120}]})
    # In the order Claude Code 2.1.332 writes its fields: the messages first, then the system prompt and
    # tools.
    body = {
        "model": "claude-x",
        "messages": messages,
        "system": [
            {"type": "text", "text": "You are Claude Code. " * 300, "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "metadata": {"user_id": json.dumps({"device": "x"})},
        "max_tokens": 32000,
        "stream": False,
    }
    return "/v1/messages", json.dumps(body).encode(), {"anthropic-version": "2023-06-01"}


async def _load(url: str, agents: int, turns: int, body_kind: str, pids: tuple[int, ...] = (),
                grow: bool = False) -> dict[str, float]:
    import aiohttp

    path, body, extra = _bodies(body_kind)
    bodies = _grown(body_kind) if grow else [body]
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)

    async def agent(i: int, session: aiohttp.ClientSession, turns: int) -> None:
        token = f"bench-agent-token-{i:06d}"
        headers = {"authorization": f"Bearer {token}", "x-api-key": token, "content-type": "application/json",
                   **extra}
        target = f"{url}/s/agent{i}{path}"
        for t in range(turns):
            t0 = time.perf_counter()
            async with session.post(target, data=bodies[(i + t) % len(bodies)], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}: {await r.text()}")
            latencies.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(connector=connector) as s:
        # Warm-up: one turn each (sessions auto-created, connections opened).
        await asyncio.gather(*(agent(i, s, 1) for i in range(agents)))
        latencies.clear()
        cpu0 = [_cpu_seconds(p) for p in pids]
        own0, idle0 = time.process_time(), _idle_jiffies()
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(i, s, turns) for i in range(agents)))
        elapsed = time.perf_counter() - t0
        cpu = [_cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
        own, idle1 = time.process_time() - own0, _idle_jiffies()
    latencies.sort()
    n = len(latencies)
    return {
        "gateway_cpu_us": cpu[0] / n * 1e6 if cpu else float("nan"),
        "responder_cpu_us": cpu[1] / n * 1e6 if len(cpu) > 1 else 0.0,
        # The load generator (this process) and the share of the machine's CPU time left idle: which
        # process limits a row (with the Go proxy it is usually this one, not the server).
        "loadgen_cpu_us": own / n * 1e6,
        "idle": (idle1[0] - idle0[0]) / max(1, idle1[1] - idle0[1]),
        "turns_per_s": n / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


async def _parked_memory(url: str, pid: int, count: int, body_kind: str) -> float:
    """RSS growth of the gateway per parked (never answered) request, in KiB."""
    import aiohttp

    path, body, extra = _bodies(body_kind)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:

        async def agent(i: int) -> None:
            token = f"mem-agent-token-{i:06d}"
            headers = {"authorization": f"Bearer {token}", "content-type": "application/json", **extra}
            try:
                async with s.post(f"{url}/s/mem{i}{path}", data=body, headers=headers) as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.CancelledError):
                pass

        # Warm the allocator with one round first, then measure a second, larger one.
        before = rss_kib(pid)
        tasks = [asyncio.create_task(agent(i)) for i in range(count)]
        async with aiohttp.ClientSession(headers={"authorization": f"Bearer {ADMIN}"}) as admin:
            for _ in range(600):
                async with admin.get(f"{url}/healthz") as r:
                    if (await r.json())["parked"] >= count:
                        break
                await asyncio.sleep(0.05)
        after = rss_kib(pid)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return (after - before) / count


def _go_proxy() -> str:
    """Build bench/go_proxy (the Go reference of the ares-proxy design) once; needs a Go toolchain."""
    exe = os.path.join(tempfile.gettempdir(), "ares-bench-go-proxy")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go_proxy")
    subprocess.run(["go", "build", "-o", exe, "."], cwd=src, check=True)
    return exe


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    if args[0] == "_go":
        cmd = [_go_proxy(), args[1]]
    else:
        cmd = [sys.executable, __file__, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"child {args} failed to start")
    return proc


def run_case(
    mode: str, agents: int, turns: int, body: str, repeat: int, impl: str = "gateway", canonical: bool = True,
    grow: bool = False,
) -> dict[str, Any]:
    import uvloop

    results = []
    for _ in range(repeat):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gw = _spawn([f"_{impl}", str(port), mode])
        responder = _spawn(["_responder", url, "1" if canonical else "0"]) if mode == "http" else None
        try:
            pids = (gw.pid,) if responder is None else (gw.pid, responder.pid)
            results.append(uvloop.run(_load(url, agents, turns, body, pids, grow)))
        finally:
            for p in (responder, gw):
                if p is not None:
                    p.kill()
                    p.wait()
    return {
        "impl": impl,
        "mode": mode,
        "agents": agents,
        "body": body,
        "turns_per_s": statistics.median(r["turns_per_s"] for r in results),
        "p50_ms": statistics.median(r["p50_ms"] for r in results),
        "p99_ms": statistics.median(r["p99_ms"] for r in results),
        "gateway_cpu_us": statistics.median(r["gateway_cpu_us"] for r in results),
        "responder_cpu_us": statistics.median(r["responder_cpu_us"] for r in results),
        "loadgen_cpu_us": statistics.median(r["loadgen_cpu_us"] for r in results),
        "idle": statistics.median(r["idle"] for r in results),
        "runs": len(results),
    }


def memory_case(count: int, body: str) -> float:
    import uvloop

    port = free_port()
    gw = _spawn(["_gateway", str(port), "http"])  # nobody answers: everything stays parked
    try:
        return uvloop.run(_parked_memory(f"http://127.0.0.1:{port}", gw.pid, count, body))
    finally:
        gw.kill()
        gw.wait()


def instructions_case(mode: str, impl: str, body: str, turns: tuple[int, int] = (100, 600)) -> float:
    """Instructions the server process executes per turn (one agent), counted by callgrind.

    Unlike wall-clock figures this does not move with what else the machine is doing. The
    server runs under ``valgrind --tool=callgrind`` twice, for ``turns[0]`` and ``turns[1]``
    turns; the difference over the extra turns leaves start-up out.
    """
    import uvloop

    totals = []
    for n in turns:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        child = f"_{impl}"
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
             child, str(port), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise RuntimeError(f"{child} under valgrind failed to start: {proc.communicate()[1][-2000:]}")
        responder = _spawn(["_responder", url, "1"]) if mode == "http" else None
        try:
            uvloop.run(_load(url, 1, n, body))
        finally:
            if responder is not None:
                responder.kill()
                responder.wait()
            proc.terminate()
            err = proc.communicate()[1]
        found = re.search(r"Collected : (\d+)", err)
        if found is None:
            raise RuntimeError(f"callgrind reported no total: {err[-2000:]}")
        totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / (turns[1] - turns[0])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        # A child: SIGTERM ends it through exit(), so a profiler wrapping it (callgrind) reports.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if len(sys.argv) > 1 and sys.argv[1] in ("_gateway", "_gateway-mem"):
        memory_only = {"data_dir": False} if sys.argv[1] == "_gateway-mem" else {}
        _gateway_main(int(sys.argv[2]), sys.argv[3], auto_sessions=True, **memory_only)
        return
    if len(sys.argv) > 1 and sys.argv[1] in ("_bare", "_bare-ll"):
        _bare_main(int(sys.argv[2]), sys.argv[3], lowlevel=sys.argv[1] == "_bare-ll")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_responder":
        answer_polls(sys.argv[2], ADMIN, canonical=sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, action="append", help="concurrent agents (default 1, 64, 512)")
    ap.add_argument("--mode", action="append", choices=["inproc", "http"])
    ap.add_argument("--body", action="append", choices=["small", "large", "history"])
    ap.add_argument("--turn-target", type=int, default=6000, help="about this many measured turns per case")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; medians are reported")
    ap.add_argument("--memory", type=int, default=2000, help="parked requests for the memory probe (0 skips)")
    ap.add_argument(
        "--impl",
        action="append",
        choices=["gateway", "gateway-mem", "bare", "bare-ll", "go"],
        help="gateway (default), gateway-mem (the gateway with data_dir=False: turns recorded in memory "
        "only), bare (aiohttp web.Application parking on futures with no parsing: the floor "
        "to compare with), bare-ll (the same on aiohttp's low-level web.Server, which the gateway "
        "serves on), go (bench/go_proxy, the "
        "ares-proxy design in Go: destructive non-blocking /poll; HTTP mode only; needs `go`)",
    )
    ap.add_argument(
        "--no-canonical",
        action="store_true",
        help="the HTTP responder polls with canonical=0: only id, request (the native body) and timestamp, "
        "what an ares-proxy poller reads (and all the Go proxy returns)",
    )
    ap.add_argument(
        "--grow",
        action="store_true",
        help=f"each agent's body grows by a tool call and its result every turn, for {GROW_STEPS} "
        "turns, then "
        "starts over (as a real session's history grows), instead of the same body every turn",
    )
    ap.add_argument(
        "--burn-us",
        type=float,
        default=0.0,
        help="the bare loops spin this many microseconds of CPU on each agent request: how latency and "
        "throughput follow server CPU per turn",
    )
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="instead of timing: instructions per turn of the server process at one agent, under callgrind",
    )
    args = ap.parse_args()
    if args.burn_us:
        os.environ[_BURN_ENV] = str(args.burn_us)  # the bare children read it
        print(f"(the bare loops spend {args.burn_us:g} µs of CPU on each agent request)", flush=True)
    if args.instructions:
        for body in args.body or ["small", "large"]:
            for mode in args.mode or ["inproc", "http"]:
                for impl in args.impl or ["bare", "gateway"]:
                    k = instructions_case(mode, impl, body) / 1000
                    print(f"{impl:>7} {body:>5} {mode:>6} agents=   1  {k:8.0f} k instructions/turn",
                          flush=True)
        return
    rows = []
    for body in args.body or ["small", "large"]:
        for mode in args.mode or ["inproc", "http"]:
            for agents in args.agents or [1, 64, 512]:
                for impl in args.impl or ["gateway"]:
                    if impl == "go" and mode != "http":
                        continue  # the Go proxy is answered over HTTP only
                    target = args.turn_target if body == "small" else args.turn_target // 4
                    turns = max(5, target // agents) if agents > 1 else max(200, target // 10)
                    row = run_case(mode, agents, turns, body, args.repeat, impl,
                                   canonical=not args.no_canonical,
                                   grow=args.grow)
                    rows.append(row)
                    print(
                        f"{row['impl']:>7} {row['body']:>5} {row['mode']:>6} agents={row['agents']:>4}  "
                        f"{row['turns_per_s']:8.0f} turns/s  p50 {row['p50_ms']:7.2f} ms  p99 "
                        f"{row['p99_ms']:7.2f} ms  gateway CPU {row['gateway_cpu_us']:6.0f} us/turn  "
                        f"responder CPU {row['responder_cpu_us']:5.0f} us/turn  load generator CPU "
                        f"{row['loadgen_cpu_us']:5.0f} us/turn  idle {row['idle']:4.0%}",
                        flush=True,
                    )
    if args.memory:
        for body in args.body or ["small", "large"]:
            kib = memory_case(args.memory, body)
            print(f"memory per parked request ({body} body, {args.memory} parked): {kib:.1f} KiB", flush=True)
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
