"""Benchmarks of the token-in/token-out layer, printed as a table (``--json`` for JSON).

    python3 bench/bench_tito.py [--turns 1,32,128] [--repeat N] [--no-engine]

(a) Per-turn prompt building at 1, 32 and 128 turns (up to ~69k tokens, ~540 tokens a turn):
    the incremental path (:meth:`TokenStreams.prepare`: message keys, the checked template
    bridge, tokenizing only the new messages) against a full re-render (template + tokenize the
    whole conversation), on the SmolLM2 tokenizer and chat template. Goal: incremental <= 5 % of
    a full re-render at 128 turns.
(b) Engine tokens/s on this CPU (in-process llama.cpp, SmolLM2-135M Q4_1): prefill of a ~1,000-token
    prompt, decode of 128 tokens, with consistent batching (the default: 2 tokens per decode step,
    logprobs equal a teacher-forced pass) and with plain batch-of-one decoding.
(c) The tito policy's own time per turn (render + parse + bookkeeping) against the engine's time.

The machine has 2 cores shared with other work: figures are medians of ``--repeat`` runs and
carry that noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ares_gateway.core.canonical import CanonicalRequest, Message, WireProtocol
from ares_gateway.tokens import ChatRenderer, TokenStreams

ROWS: list[tuple[str, str, str]] = []
RESULTS: dict[str, Any] = {}

_WORDS = (
    "def test_parse(): assert parse('x') == 1 # see tests/test_api.py line 42\n"
    "Traceback (most recent call last): File \"/repo/src/app.py\", line 17, in <module>\n"
    "$ pytest -q tests/ 2>&1 | tail -20 && git diff --stat HEAD~1\n"
    "The function returns None when the cache is empty; update the docstring and retry.\n"
).split(" ")


def _text(seed: int, n_words: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i * 13) % len(_WORDS)] for i in range(n_words))


def _turn_messages(k: int) -> tuple[Message, str]:
    """The tool output of turn k (~400 tokens) and the answer the model gives (~140 tokens)."""
    return Message(role="user", content=f"[tool output {k}]\n" + _text(k, 180)), "ok " + _text(k + 1, 60)


def _session(renderer: ChatRenderer, turns: int) -> tuple[TokenStreams, list[Message], dict[str, float]]:
    """Play ``turns`` turns through TokenStreams (answers tokenized in context, as a sampler emits them).

    Returns the streams, the messages of the next request, and the timing of the last turn.
    """
    st = TokenStreams(renderer, max_turns_kept=4)
    msgs = [Message(role="system", content="You are a coding agent. " + _text(0, 300))]
    tok = renderer.tokenizer
    eos = tok.eos_token_id
    assert eos is not None
    last: dict[str, float] = {}
    for k in range(turns):
        new, answer = _turn_messages(k)
        msgs = [*msgs, new]
        t0 = time.perf_counter()
        p = st.prepare("bench", msgs)
        t1 = time.perf_counter()
        out = [*tok.encode(answer), eos]
        c, _ = renderer.parse(out, prompt_ids=p.prompt_ids)
        st.commit(p, out, c.to_message())
        msgs = [*msgs, c.to_message()]
        last = {"prepare_s": t1 - t0, "prompt_tokens": float(len(p.prompt_ids)),
                "mode": float(p.mode == "extend")}
    return st, msgs, last


def bench_render(renderer: ChatRenderer, turns_list: list[int], repeat: int) -> None:
    for turns in turns_list:
        st, msgs, _ = _session(renderer, turns - 1) if turns > 1 else (TokenStreams(renderer), [
            Message(role="system", content="You are a coding agent. " + _text(0, 300))], {})
        new, _ = _turn_messages(turns - 1)
        req = [*msgs, new]
        inc: list[float] = []
        full: list[float] = []
        tmpl: list[float] = []
        n_tokens = 0
        mode = ""
        for _ in range(repeat):
            t0 = time.perf_counter()
            p = st.prepare("bench", req)
            inc.append(time.perf_counter() - t0)
            mode = p.mode
            t0 = time.perf_counter()
            tm = renderer.template_messages(req)
            text = renderer.tokenizer.render_text(tm, add_generation_prompt=True)
            t1 = time.perf_counter()
            ids = renderer.tokenizer.encode(text)
            full.append(time.perf_counter() - t0)
            tmpl.append(t1 - t0)
            n_tokens = len(ids)
            assert turns == 1 or ids == p.prompt_ids, "bench conversation must be append-only"
        i, f = statistics.median(inc), statistics.median(full)
        ratio = i / f
        RESULTS[f"render_{turns}"] = {
            "turns": turns, "prompt_tokens": n_tokens, "incremental_ms": i * 1e3, "full_ms": f * 1e3,
            "full_template_ms": statistics.median(tmpl) * 1e3, "ratio": ratio, "mode": mode,
        }
        goal = " (goal <= 5 %)" if turns == 128 else ""
        ROWS.append((
            f"prompt build, turn {turns} ({n_tokens:,} tokens)",
            f"incremental {i * 1e3:.2f} ms ({mode}) vs full re-render {f * 1e3:.2f} ms "
            f"(template {statistics.median(tmpl) * 1e3:.2f} ms)",
            f"{ratio * 100:.1f} %{goal}",
        ))


async def bench_engine(renderer: ChatRenderer, repeat: int) -> None:
    from ares_gateway.engines import Sampling
    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    prompt = renderer.render(renderer.template_messages(
        [Message(role="system", content=_text(3, 600)),
         Message(role="user", content="Summarize the log above.")]
    )).prompt_ids
    for consistent in (True, False):
        eng = LlamaCppEngine(n_ctx=4096, consistent_batching=consistent)
        await eng.load()
        pre: list[float] = []
        dec: list[float] = []
        try:
            for r in range(repeat):
                # A fresh cache each time: a different first token defeats the prefix cache.
                res = await eng.generate([r + 3, *prompt[1:]], Sampling(max_tokens=128, seed=r))
                pre.append(len(prompt) / res.prefill_s)
                dec.append(len(res.output_ids) / res.decode_s)
        finally:
            await eng.aclose()
        name = "consistent (2 tokens/step)" if consistent else "batch of one"
        RESULTS[f"engine_{'consistent' if consistent else 'single'}"] = {
            "prompt_tokens": len(prompt), "prefill_tok_s": statistics.median(pre),
            "decode_tok_s": statistics.median(dec), "load_s": eng.load_s, "threads": eng.n_threads,
        }
        ROWS.append((
            f"llama.cpp SmolLM2-135M Q4_1, {name}",
            f"prefill {statistics.median(pre):,.0f} tok/s ({len(prompt)} tokens), decode "
            f"{statistics.median(dec):,.1f} tok/s", f"{eng.n_threads} threads, load {eng.load_s:.2f} s",
        ))


async def bench_policy_overhead(renderer: ChatRenderer, turns: int) -> None:
    from ares_gateway.engines.llama_cpp import LlamaCppEngine
    from ares_gateway.policies.tito import TitoPolicy

    eng = LlamaCppEngine(n_ctx=8192)
    policy = TitoPolicy(eng, renderer=renderer, max_tokens=48, seed=1)
    msgs = [Message(role="system", content="You are a coding agent. " + _text(0, 300))]
    total = 0.0
    engine = 0.0
    try:
        for k in range(turns):
            new, _ = _turn_messages(k)
            msgs = [*msgs, Message(role="user", content=new.text()[:600])]
            t0 = time.perf_counter()
            c = await policy(CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, messages=msgs))
            dt = time.perf_counter() - t0
            assert not isinstance(c, dict) and hasattr(c, "extra")
            rec = c.extra["tito"]  # type: ignore[union-attr]
            if k:  # the first turn includes loading the model
                total += dt
                engine += rec["prefill_s"] + rec["decode_s"]
            msgs = [*msgs, c.to_message()]  # type: ignore[union-attr]
        stats = policy.stats("direct")
    finally:
        await policy.aclose()
    share = (total - engine) / total
    RESULTS["policy_overhead"] = {"turns": turns - 1, "policy_s": total, "engine_s": engine, "share": share,
                                  "extended": stats.extended, "fresh": stats.fresh}
    ROWS.append((
        f"tito policy per turn vs engine ({turns - 1} turns, {stats.extended} extended, {stats.fresh} fresh)",
        f"policy {total / (turns - 1) * 1e3:.1f} ms/turn, engine {engine / (turns - 1) * 1e3:.1f} ms/turn",
        f"overhead {share * 100:.2f} % (goal <= 2 %)",
    ))


async def bench_gateway_overhead(renderer: ChatRenderer, turns: int) -> None:
    """Agent-side wall time per turn (official OpenAI SDK over loopback HTTP, through the Gateway and
    PolicyServer) against the engine's own prefill + decode time."""
    import openai

    from ares_gateway.engines.llama_cpp import LlamaCppEngine
    from ares_gateway.gateway import Gateway
    from ares_gateway.policies import PolicyServer
    from ares_gateway.policies.tito import TitoPolicy

    eng = LlamaCppEngine(n_ctx=8192)
    await eng.load()
    policy = TitoPolicy(eng, renderer=renderer, max_tokens=48, seed=2)
    wall = 0.0
    engine = 0.0
    async with Gateway(port=0, request_timeout=600) as gw, PolicyServer(gw, policy, concurrency=1):
        session = await gw.create_session()
        client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. " + _text(0, 300)}]
        for k in range(turns):
            new, _ = _turn_messages(k)
            messages.append({"role": "user", "content": new.text()[:600]})
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]
            dt = time.perf_counter() - t0
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            rec = policy.last_record
            assert rec is not None
            wall += dt
            engine += rec["prefill_s"] + rec["decode_s"]
        await client.close()
    await policy.aclose()
    share = (wall - engine) / wall
    RESULTS["gateway_overhead"] = {"turns": turns, "wall_s": wall, "engine_s": engine, "share": share}
    ROWS.append((
        f"gateway + tito per turn vs engine ({turns} turns, OpenAI SDK over loopback)",
        f"agent waits {wall / turns * 1e3:.1f} ms/turn, engine {engine / turns * 1e3:.1f} ms/turn",
        f"overhead {share * 100:.2f} % (goal <= 2 %)",
    ))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", default="1,32,128")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-engine", action="store_true", help="only the render benchmark (no llama.cpp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    renderer = ChatRenderer()
    bench_render(renderer, [int(t) for t in args.turns.split(",")], args.repeat)
    if not args.no_engine:
        asyncio.run(bench_engine(renderer, max(1, min(args.repeat, 3))))
        asyncio.run(bench_policy_overhead(renderer, 8))
        asyncio.run(bench_gateway_overhead(renderer, 8))
    if args.json:
        print(json.dumps(RESULTS, indent=2))
        return
    w = max(len(r[0]) for r in ROWS)
    for name, value, verdict in ROWS:
        print(f"{name:<{w}}  {value}  [{verdict}]")


if __name__ == "__main__":
    main()
