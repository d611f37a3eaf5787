"""The real SmolLM2-135M model on in-process llama.cpp.

Skips (with the build command) only when ``llama_cpp`` is not importable; fails instead under
``ARES_CI=1``. Sizes are kept small (tens of tokens per answer) because the suite shares 2 cores;
the benchmark (``bench/bench_tito.py``) runs the long sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from ares_gateway.core.canonical import CanonicalRequest, Message, WireProtocol
from ares_gateway.engines import GenerateResult, PromptTooLongError, Sampling
from tests.tito.conftest import need_llama

# A batch of one token takes another CPU kernel than a batch of 2+; with consistent batching the
# recorded logprobs equal a teacher-forced pass bit for bit. The tolerance leaves room for libm.
TOL = 1e-4


class Recording:
    """Wraps an engine and keeps every result it produced (what the engine itself sampled)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.model = engine.model
        self.results: list[tuple[list[int], GenerateResult]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        res = await self.engine.generate(prompt_ids, sampling)
        self.results.append((list(prompt_ids), res))
        return res

    async def stream(self, prompt_ids: Sequence[int], sampling: Sampling):  # type: ignore[no-untyped-def]
        async for item in self.engine.stream(prompt_ids, sampling):
            if isinstance(item, GenerateResult):
                self.results.append((list(prompt_ids), item))
            yield item

    async def aclose(self) -> None:
        await self.engine.aclose()


async def test_sampling_is_seeded_and_logprobs_are_the_models(llama_engine, smol_renderer) -> None:  # type: ignore[no-untyped-def]
    eng = llama_engine
    prompt = smol_renderer.render(
        smol_renderer.template_messages([Message(role="user", content="Name three colors.")]))
    s = Sampling(max_tokens=24, seed=1234, stop_token_ids=tuple(smol_renderer.stop_token_ids))
    a = await eng.generate(prompt.prompt_ids, s)
    b = await eng.generate(prompt.prompt_ids, s)  # the cache now holds the prompt: only 2 tokens re-evaluated
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs and b.cached_tokens == len(
        prompt.prompt_ids) - 2
    assert all(lp <= 0 for lp in a.logprobs) and a.extra["seed"] == 1234
    ref = await eng.score(prompt.prompt_ids + a.output_ids, len(prompt.prompt_ids))
    assert np.max(np.abs(np.array(ref) - np.array(a.logprobs))) <= TOL
    greedy = await eng.generate(prompt.prompt_ids, Sampling(max_tokens=8, temperature=0.0))
    scored = await eng.score(prompt.prompt_ids + greedy.output_ids, len(prompt.prompt_ids))
    assert np.max(np.abs(np.array(scored) - np.array(greedy.logprobs))) <= TOL


async def test_stream_yields_what_generate_returns(llama_engine, smol_renderer) -> None:  # type: ignore[no-untyped-def]
    prompt = smol_renderer.render(
        smol_renderer.template_messages([Message(role="user", content="Say hello.")]))
    s = Sampling(max_tokens=16, seed=5)
    whole = await llama_engine.generate(prompt.prompt_ids, s)
    ids: list[int] = []
    result = None
    async for item in llama_engine.stream(prompt.prompt_ids, s):
        if isinstance(item, GenerateResult):
            result = item
        else:
            ids.extend(item.ids)
    assert result is not None and ids == result.output_ids == whole.output_ids
    # Leaving a stream early stops the sampling and frees the engine for the next call.
    agen = llama_engine.stream(prompt.prompt_ids, Sampling(max_tokens=400, seed=5))
    first = await agen.__anext__()
    assert not isinstance(first, GenerateResult)
    await agen.aclose()  # what the gateway does when the agent goes away
    assert llama_engine.aborted_streams == 1
    again = await llama_engine.generate(prompt.prompt_ids, s)
    assert again.output_ids == whole.output_ids


async def test_the_batch_of_one_kernel_differs(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    # Why consistent batching exists: decoding one token at a time gives logprobs a teacher-forced
    # pass does not reproduce. (If llama.cpp ever makes them agree, this test says so.)
    need_llama()
    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    eng = LlamaCppEngine(n_ctx=1024, consistent_batching=False)
    try:
        prompt = smol_renderer.render(
            smol_renderer.template_messages([Message(role="user", content="Count to ten.")]))
        res = await eng.generate(prompt.prompt_ids, Sampling(max_tokens=24, seed=3))
        ref = await eng.score(prompt.prompt_ids + res.output_ids, len(prompt.prompt_ids))
    finally:
        await eng.aclose()
    assert np.max(np.abs(np.array(ref) - np.array(res.logprobs))) > 1e-3


async def test_prompt_too_long(llama_engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PromptTooLongError, match="4096"):
        await llama_engine.generate([1] * 5000, Sampling(max_tokens=4))


async def test_multi_turn_session_through_the_gateway(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    """An agent loop on the official OpenAI SDK over loopback HTTP, answered by the tito policy."""
    need_llama()
    import openai

    from ares_gateway.engines.llama_cpp import LlamaCppEngine
    from ares_gateway.gateway import Gateway
    from ares_gateway.policies import PolicyServer
    from ares_gateway.policies.tito import TitoPolicy

    engine = Recording(LlamaCppEngine(n_ctx=4096))
    policy = TitoPolicy(engine, renderer=smol_renderer, max_tokens=24, seed=7)  # type: ignore[arg-type]
    turns = 5
    async with Gateway(port=0, request_timeout=300) as gw, PolicyServer(gw, policy, concurrency=1):
        session = await gw.create_session()
        client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
        messages: list[dict[str, Any]] = [
            {"role": "system",
             "content": "You are a shell agent. Answer with one bash command in a ```bash block."},
            {"role": "user", "content": "List the files in the current directory."},
        ]
        for k in range(turns):
            if k % 2:  # every other turn streams
                text = ""
                stream = await client.chat.completions.create(model="smol", messages=messages, stream=True)  # type: ignore[arg-type]
                async for chunk in stream:  # type: ignore[union-attr]
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
            else:
                r = await client.chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]
                text = r.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"exit code 0, output: file{k}.txt"}]
        await client.close()
        samples = gw.trajectory(session.session_id, reward=1.0)
        log = gw.turn_log(session.session_id)
        # The turn log carries each turn's sampling record (temperature, top_p, top_k, seed).
        recs = [t["completion"]["extra"]["tito"] for t in log]
        assert [r["mode"] for r in recs] == ["first"] + ["extend"] * (turns - 1)
        assert all(r["sampling"]["temperature"] == 1.0 and isinstance(r["sampling"]["seed"], int)
                   for r in recs)
        stats = policy.stats(session.session_id)
    await policy.aclose()

    assert len(engine.results) == turns
    from ares_gateway.policies.tito import episode_fidelity

    fid = episode_fidelity(samples, stats)
    assert fid["turns"] == turns and fid["fresh_renders"] == 0 and fid["main_line_drift"] == 0
    assert fid["trained_tokens"] == sum(len(r.output_ids) for _, r in engine.results)
    assert (stats.first, stats.extended, stats.fresh) == (1, turns - 1, 0)
    # Turn k+1's prompt starts with turn k's prompt + output ids exactly.
    for (p0, r0), (p1, _) in zip(engine.results, engine.results[1:], strict=False):
        assert p1[: len(p0) + len(r0.output_ids)] == p0 + r0.output_ids
    # One sample (a clean main line); its loss-1 tokens are exactly the engine's sampled tokens, in order.
    assert len(samples) == 1
    s = samples[0]
    s.check()
    resp = s.tokens[s.prompt_length :]
    trained = resp[s.loss_mask == 1].tolist()
    sampled = [t for _, r in engine.results for t in r.output_ids]
    assert trained == sampled
    assert np.allclose(s.logprobs[s.loss_mask == 1], [lp for _, r in engine.results for lp in r.logprobs],
                       atol=1e-6)
    # ... and everything not trained is prompt the gateway rendered (the last turn's prompt is a prefix of the
    # sample).
    last_prompt, last = engine.results[-1]
    assert s.tokens.tolist() == last_prompt + last.output_ids

    # A second, independent evaluation (a fresh model instance, one teacher-forced pass) agrees.
    ref_engine = LlamaCppEngine(n_ctx=4096)
    try:
        ref = await ref_engine.score(s.tokens.tolist(), s.prompt_length)
    finally:
        await ref_engine.aclose()
    ref_arr = np.array(ref)[s.loss_mask == 1]
    assert np.max(np.abs(ref_arr - s.logprobs[s.loss_mask == 1])) <= TOL


async def test_policy_on_the_default_engine_by_name(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    need_llama()
    from ares_gateway.policies import make_policy

    policy = make_policy("tito", engine="llama-cpp", max_tokens=8, engine_options={"n_ctx": 2048})
    try:
        c = await policy(CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT,
                                          messages=[Message(role="user", content="hi")]))
    finally:
        await policy.aclose()
    assert c.tokens is not None and 1 <= len(c.tokens.output_ids) <= 8
    info = policy.run_info()
    assert info["engine"] == "llama-cpp" and info["model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
