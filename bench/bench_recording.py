"""Recording at real session lengths: memory per session, recording cost per turn, samples, throughput.

    python3 bench/bench_recording.py                 # everything, briefly
    python3 bench/bench_recording.py memory --turns 200
    python3 bench/bench_recording.py memory --turns 200 --no-parse-reuse   # no parse memo between turns
    python3 bench/bench_recording.py sessions --sessions 64 --turns 200
    python3 bench/bench_recording.py throughput --agents 64 --throughput-turns 16 --rounds 5

Every case runs in a fresh subprocess (RSS is that process's). The agent side is real HTTP over
loopback (aiohttp) with a Claude-Code-sized Anthropic body (~96 KB: system, 25 tools, a
conversation) that grows by a tool_use and a ~2 KB tool_result every turn; the policy answers in
process with a token record whose prompt is the previous prompt + output + ~600 new ids (as an
engine that returns prompt token ids would), 64 output ids and their logprobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def trim() -> None:
    """Give free heap memory back to the OS (glibc), so RSS shows what is held, not the allocator's high-water
    mark."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cc_body(turn: int) -> dict[str, Any]:
    """The Claude-Code-sized body of turn ``turn`` (0-based): the base conversation plus ``turn`` steps."""
    tools = [
        {
            "name": f"Tool{i}",
            "description": "Runs a thing. " * 60,
            "input_schema": {"type": "object", "properties": {
                f"arg{j}": {"type": "string", "description": "x" * 40} for j in range(8)}},
        }
        for i in range(25)
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": "fix the bug"}]}]
    for i in range(12 + turn):
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"step {i}"}, {
            "type": "tool_use", "id": f"toolu_{i}", "name": "Tool1", "input": {"arg0": f"ls -la {i}"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"file{i}.txt\n" * 180}]})
    # Claude Code marks only the last message for caching, so last turn's last message changes.
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    # In the order Claude Code 2.1.332 writes its fields: the messages first, then the system prompt and
    # tools.
    return {
        "model": "claude-x",
        "messages": messages,
        "system": [
            {"type": "text", "text": "You are Claude Code. " * 300, "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "metadata": {"user_id": json.dumps({"device": "x"})},
        "max_tokens": 32000,
        "stream": False,
    }


def answer_for(turn: int) -> dict[str, Any]:
    """The completion the policy gives at ``turn``: the tool_use the next body echoes back."""
    i = 12 + turn
    return {"text": f"step {i}", "tool_calls": [
        {"id": f"toolu_{i}", "name": "Tool1", "arguments": json.dumps({"arg0": f"ls -la {i}"})}],
            "finish_reason": "tool_calls"}


class TokenModel:
    """Token ids as an engine would give them: the prompt is the previous prompt + output + new ids."""

    def __init__(self, first_prompt: int = 25_000, per_turn: int = 600, output: int = 64) -> None:
        import numpy as np

        self.np = np
        self.first = first_prompt
        self.per_turn = per_turn
        self.output = output
        self.full = np.zeros(0, dtype=np.int32)

    def record(self, turn: int) -> dict[str, Any]:
        np = self.np
        new = np.arange(self.first if turn == 0 else self.per_turn, dtype=np.int32) % 50_000 + 7
        prompt = np.concatenate([self.full, new])
        out = (np.arange(self.output, dtype=np.int32) + turn) % 50_000 + 3
        self.full = np.concatenate([prompt, out])
        return {"prompt_ids": prompt, "output_ids": out,
                "output_logprobs": np.full(self.output, -0.5, dtype=np.float32)}


async def _session(gw: Any, http: Any, turns: int, tokens: bool, timings: list[float] | None = None,
                   rss_at: dict[int, int] | None = None, sid: str | None = None) -> str:
    from ares_gateway import Completion

    info = await gw.create_session(sid)
    model = TokenModel()
    headers = {"authorization": f"Bearer {info.token}", "anthropic-version": "2023-06-01",
               "content-type": "application/json"}
    for t in range(turns):
        body = json.dumps(cc_body(t)).encode()
        post = asyncio.ensure_future(http.post(f"{info.base_url}/v1/messages", data=body, headers=headers))
        req = await gw.next_request(session=info.session_id, timeout=60)
        assert req is not None
        tok = model.record(t) if tokens else None
        t0 = time.perf_counter()
        await gw.respond(req.id, Completion.model_validate(answer_for(t)), tokens=tok)
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        resp = await post
        await resp.read()
        assert resp.status == 200, resp.status
        if rss_at is not None and (t + 1) in rss_at:
            del body, post, req, resp, tok  # this turn's request and answer: not what the session holds
            trim()
            # Less this bench's own token model (the ids it continues from), which the gateway does not hold.
            rss_at[t + 1] = rss_bytes() - (model.full.nbytes if tokens else 0)
    return info.session_id


def _traced() -> int:
    import tracemalloc

    return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0


#: The recorder's steps ``steps`` times (functions of ares_gateway.core.recorder, by name).
#: Each step: the module whose global the caller looks it up in, and its name there.
STEPS = {
    "_body_delta": "ares_gateway.core.record_codec",
    "continue_layout": "ares_gateway.core.record_codec",
    "_prompt_chat": "ares_gateway.core.session_recorder",
    "_tree_turn": "ares_gateway.core.session_recorder",
    "encode_tokens": "ares_gateway.core.session_recorder",
    "pack": "ares_gateway.core.session_recorder",
}


def _timed_steps() -> dict[str, list[float]]:
    """Wrap each of :data:`STEPS` to time its calls (the wrappers add a little to each)."""
    import importlib

    times: dict[str, list[float]] = {n: [] for n in STEPS}
    for name, module in STEPS.items():
        rec = importlib.import_module(module)
        fn = getattr(rec, name)

        def timed(*a: Any, _fn: Any = fn, _out: list[float] = times[name], **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                _out.append(time.perf_counter() - t0)

        setattr(rec, name, timed)
    return times


def _memory_main(turns: int, tokens: bool, durable: bool, trace: bool = False,
                 steps: bool = False, parse_reuse: bool = True) -> dict[str, Any]:
    import statistics
    import tracemalloc

    import aiohttp
    import uvloop

    from ares_gateway import Gateway

    out: dict[str, Any] = {}
    if trace:
        tracemalloc.start()
    step_s = _timed_steps() if steps else {}

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            async with Gateway(port=0, data_dir=tmp if durable else False, release_ended=False,
                               parse_reuse=parse_reuse) as gw, aiohttp.ClientSession() as http:
                # Warm-up session (imports, allocator, first-use caches), then forgotten.
                sid = await _session(gw, http, 3, tokens)
                await gw.delete_session(sid)
                trim()
                base = rss_bytes()
                traced0 = _traced()
                marks = {n: 0 for n in (50, 100, 200) if n <= turns} | {turns: 0}
                timings: list[float] = []
                # The recorder's own time per turn (encoding the record, the message tree, queueing the
                # write): its _record, which the gateway runs after the answer went out (deferred to the
                # end of the loop iteration), not the broker's on_turn, which only queues the turn.
                record = gw.recorder._record
                record_s: list[float] = []

                def timed(turn: Any) -> None:
                    t0 = time.perf_counter()
                    record(turn)
                    record_s.append(time.perf_counter() - t0)

                gw.recorder._record = timed  # type: ignore[method-assign]
                before = {n: len(v) for n, v in step_s.items()}  # the warm-up session's calls
                sid = await _session(gw, http, turns, tokens, timings, marks, sid="measured")
                del gw.recorder._record
                end_raw = rss_bytes()
                trim()
                end = rss_bytes()
                out["live_mb"] = (_traced() - traced0) / 2**20
                out["rss_growth_untrimmed_mb"] = (end_raw - base) / 2**20
                t0 = time.perf_counter()
                samples = gw.trajectory(sid, reward=1.0)
                out["samples_s"] = time.perf_counter() - t0
                out["samples"] = len(samples)
                out["sample_tokens"] = int(sum(s.tokens.shape[0] for s in samples))
                out["rss_growth_mb"] = (end - base) / 2**20
                out["rss_at_mb"] = {str(k): (v - base) / 2**20 for k, v in marks.items()}
                # Recording cost: respond (coerce + record + durable commit) per turn, early vs late.
                k = max(1, min(10, turns // 5))
                out["respond_ms_first"] = 1000 * sum(timings[1 : k + 1]) / k
                out["respond_ms_last"] = 1000 * sum(timings[-k:]) / k
                if steps:  # per step: the median of turns 2-10 and of the last 10 turns (by call)
                    mine = {n: v[before[n]:] for n, v in step_s.items()}
                    out["step_ms"] = {n: {"2-10": round(1000 * statistics.median(v[1:10]), 3),
                                          f"last 10 of {len(v)}": round(1000 * statistics.median(v[-10:]), 3)}
                                      for n, v in mine.items() if len(v) >= 20}
                out["record_ms"] = {f"{a + 1}-{b}": round(1000 * statistics.median(record_s[a:b]), 3)
                                    for a,
                                    b in ((1, 10), (40, 50), (90, 100), (190, 200)) if b <= len(record_s)}
                t0 = time.perf_counter()
                log = gw.turn_log(sid, tokens=False)
                out["turn_log_s"] = time.perf_counter() - t0
                out["turn_log_turns"] = len(log)

    uvloop.run(main())
    return out


def _throughput_main(agents: int, turns: int, durable: bool, record: bool = True) -> dict[str, Any]:
    """Turns a second with ``agents`` agents (in a child process) answered in process with token
    records; ``durable=False``: recorded in memory only; ``record=False``: not recorded at all (the
    broker's turn sink removed: what the gateway costs without a recorder). Also the gateway
    process's CPU time per turn (all its threads), steadier than wall time on a shared machine."""
    import uvloop

    from ares_gateway import Gateway
    from ares_gateway.cli._support import tune_gc

    tune_gc()  # as ``serve`` and ``run`` do
    out: dict[str, Any] = {}

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            async with Gateway(port=0, data_dir=tmp if durable else False) as gw:
                if not record:
                    gw.broker._on_turn = None
                wall, cpu, loop_cpu = await _drive(gw, agents, turns,
                                                   lambda: TokenModel(first_prompt=4000, per_turn=300))
                out["turns_per_s"] = agents * turns / wall
                out["cpu_us_per_turn"] = 1e6 * cpu / (agents * turns)
                out["loop_cpu_us_per_turn"] = 1e6 * loop_cpu / (agents * turns)
                out["wall_s"] = wall

    uvloop.run(main())
    return out


async def _drive(gw: Any, agents: int, turns: int, model: Any, on_progress: Any = None) -> tuple[float, float,
                                                                                                 float]:
    """Run ``agents`` sessions of ``turns`` turns, the agents in a child process and the policy here;
    returns the wall seconds, this process's CPU seconds and its loop thread's CPU seconds from the
    first request to the last answer."""
    from ares_gateway import Completion

    infos = [await gw.create_session() for _ in range(agents)]
    models = {i.session_id: model() for i in infos}
    turn_of = {i.session_id: 0 for i in infos}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        f"import sys; sys.path.insert(0, {HERE!r}); import bench_recording as b; b._agents_child()",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(
        json.dumps({"sessions": [[i.base_url, i.token] for i in infos], "turns": turns}).encode())
    child.stdin.close()
    done = 0
    req = await gw.next_request(timeout=120)
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    while True:
        assert req is not None
        sid = req.session_id
        t = turn_of[sid]
        turn_of[sid] += 1
        await gw.respond(req.id, Completion.model_validate(answer_for(t)), tokens=models[sid].record(t))
        done += 1
        if on_progress is not None:
            on_progress(done)
        if done == agents * turns:
            break
        req = await gw.next_request(timeout=120)
    wall, cpu, loop_cpu = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0
    await child.stdout.read()
    await child.wait()
    return wall, cpu, loop_cpu


def _agents_child() -> None:
    """The agents of the ``sessions`` case, in their own process (so the gateway's RSS is its own):
    reads ``{"sessions": [[base_url, token], ...], "turns": N}`` on stdin, runs every session's
    turns concurrently, prints the wall time."""
    import aiohttp
    import uvloop

    spec = json.loads(sys.stdin.read())
    turns = spec["turns"]
    base = cc_body(0)
    head = {k: v for k, v in base.items() if k != "messages"}
    # Every body is built from pre-serialized messages: the agents' CPU stays small next to the gateway's.
    steps = cc_body(turns)["messages"][1:]
    for m in steps:
        m["content"][-1].pop("cache_control", None)
    step_json = [json.dumps(m) for m in steps]
    # Each body's last message carries the cache_control mark (as Claude Code sends it).
    marked = [json.dumps(
        {**m, "content": [*m["content"][:-1], {**m["content"][-1], "cache_control": {"type": "ephemeral"}}]})
              for m in steps]
    head_json = json.dumps(head)[:-1]

    def body(i: int, t: int) -> bytes:
        first = json.dumps({"role": "user", "content": [
            {"type": "text", "text": f"<system-reminder>session {i}</system-reminder>"},
            {"type": "text", "text": f"fix bug {i}"}]})
        k = 2 * (12 + t)
        msgs = ",".join([first, *step_json[: k - 1], marked[k - 1]])
        return f'{head_json}, "messages": [{msgs}]}}'.encode()

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def agent(i: int, url: str, token: str) -> None:
                h = {"authorization": f"Bearer {token}", "anthropic-version": "2023-06-01",
                     "content-type": "application/json"}
                for t in range(turns):
                    async with http.post(f"{url}/v1/messages", data=body(i, t), headers=h) as r:
                        await r.read()
                        assert r.status == 200, r.status

            t0 = time.perf_counter()
            await asyncio.gather(*(agent(i, u, k) for i, (u, k) in enumerate(spec["sessions"])))
            print(json.dumps({"wall_s": time.perf_counter() - t0}))

    uvloop.run(main())


def _sessions_main(sessions: int, turns: int, durable: bool = True) -> dict[str, Any]:
    """``sessions`` Claude-Code-sized sessions of ``turns`` turns each, all live at once, with
    token records; the gateway's RSS growth (agents in a child process)."""
    import uvloop

    from ares_gateway import Gateway
    from ares_gateway.cli._support import tune_gc

    tune_gc()  # as ``serve`` and ``run`` do

    out: dict[str, Any] = {"sessions": sessions, "turns": turns}

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            async with Gateway(port=0, data_dir=tmp if durable else False, release_ended=False) as gw:
                trim()
                base = rss_bytes()
                peak = [base]

                def progress(done: int) -> None:
                    if done % 500 == 0:
                        peak[0] = max(peak[0], rss_bytes())

                wall, cpu, _ = await _drive(gw, sessions, turns, TokenModel, progress)
                end_raw = rss_bytes()
                trim()
                end = rss_bytes()
                out["turns_per_s"] = sessions * turns / wall
                out["cpu_us_per_turn"] = 1e6 * cpu / (sessions * turns)
                out["rss_growth_mb"] = (end - base) / 2**20
                out["rss_growth_untrimmed_mb"] = (end_raw - base) / 2**20
                out["rss_peak_growth_mb"] = (max(peak[0], end_raw) - base) / 2**20
                out["per_session_mb"] = out["rss_growth_untrimmed_mb"] / sessions
                t0 = time.perf_counter()
                n = sum(len(gw.trajectory(sid, reward=1.0)) for sid in gw.recorder.in_memory())
                out["samples_s"] = time.perf_counter() - t0
                out["samples"] = n

    uvloop.run(main())
    return out


def _sub(case: str, **kw: Any) -> dict[str, Any]:
    code = (f"import json,sys; sys.path.insert(0,{HERE!r}); import bench_recording as b; "
            f"print(json.dumps(b.{case}(**{kw!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise SystemExit(f"{case} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", nargs="?", choices=["all", "memory", "steps", "sessions", "throughput"],
                    default="all")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--throughput-turns", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-parse-reuse", dest="parse_reuse", action="store_false",
                    help="memory: the gateway with parse_reuse=False (no parse memo kept between turns)")
    args = ap.parse_args()
    if args.case in ("all", "memory"):
        for tokens in (True, False):
            r = _sub("_memory_main", turns=args.turns, tokens=tokens, durable=True,
                     parse_reuse=args.parse_reuse)
            print(f"memory  turns={args.turns} tokens={tokens} durable=True parse_reuse={args.parse_reuse}: "
                  f"{json.dumps(r)}", flush=True)
    if args.case == "steps":  # the recorder's steps timed one by one (not in "all": the timing adds to each)
        r = _sub("_memory_main", turns=args.turns, tokens=True, durable=True, steps=True)
        print(f"steps  turns={args.turns}: {json.dumps(r['step_ms'])}", flush=True)
    if args.case in ("all", "sessions"):
        r = _sub("_sessions_main", sessions=args.sessions, turns=args.turns)
        print(f"sessions={args.sessions} turns={args.turns} durable=True: {json.dumps(r)}", flush=True)
    if args.case in ("all", "throughput"):
        import statistics

        kinds = {"not recorded": {"durable": False, "record": False}, "in memory": {"durable": False},
                 "durable": {"durable": True}}
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):  # interleaved, so a noisy neighbour hits every kind alike
            for kind, kw in kinds.items():
                got = _sub("_throughput_main", agents=args.agents, turns=args.throughput_turns, **kw)
                rates[kind].append(got["turns_per_s"])
                cpu[kind].append(got["cpu_us_per_turn"])
            print(f"throughput round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}/s" for k, v in rates.items()),
                  flush=True)
        on_mem = [d / m for d, m in zip(rates["durable"], rates["in memory"], strict=True)]
        on_none = [d / n for d, n in zip(rates["durable"], rates["not recorded"], strict=True)]
        print(f"throughput agents={args.agents} turns={args.throughput_turns} rounds={args.rounds}: medians "
              + ", ".join(f"{k} {statistics.median(v):.1f}/s" for k, v in rates.items())
              + f"; durable/in memory {statistics.median(on_mem):.2f} (each round: "
              + " ".join(f"{x:.2f}" for x in on_mem)
              + f"), durable/not recorded {statistics.median(on_none):.2f}",
              flush=True)
        print("gateway CPU per turn (medians): "
              + ", ".join(f"{k} {statistics.median(v):.0f} us" for k, v in cpu.items())
              + "; in memory/durable "
                f"{statistics.median(cpu['in memory']) / statistics.median(cpu['durable']):.2f}",
              flush=True)


if __name__ == "__main__":
    main()
