"""The tito policy with a scripted engine: token records, per-turn sampling record, streaming, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    CompletionDelta,
    Message,
    SamplingParams,
    WireProtocol,
)
from ares_gateway.engines import (
    EngineUnavailableError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)


class ScriptedEngine:
    """Answers each call with the next scripted text (tokenized, then EOS); logprob -0.1 per token."""

    name = "scripted"
    model = "scripted-model"

    def __init__(self, tokenizer, answers: list[str]) -> None:  # type: ignore[no-untyped-def]
        self.tok = tokenizer
        self.answers = list(answers)
        self.calls: list[tuple[list[int], Sampling]] = []
        self.results: list[GenerateResult] = []
        self.fail: Exception | None = None

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        if self.fail is not None:
            raise self.fail
        self.calls.append((list(prompt_ids), sampling))
        ids = [*self.tok.encode(self.answers.pop(0)), self.tok.eos_token_id][: sampling.max_tokens]
        res = GenerateResult(ids, [-0.1] * len(ids), "stop" if ids[-1] == self.tok.eos_token_id else "length",
                             prompt_tokens=len(prompt_ids))
        self.results.append(res)
        return res

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        res = await self.generate(prompt_ids, sampling)
        for t, lp in zip(res.output_ids, res.logprobs, strict=True):
            yield TokenChunk([t], [lp])
        yield res

    async def aclose(self) -> None:
        pass


def _req(messages: list[Message], **kw) -> CanonicalRequest:  # type: ignore[no-untyped-def]
    return CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, model="agent-model", messages=messages, **kw)


async def test_make_policy_builds_tito_and_records_tokens(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.policies import make_policy, policy_names

    assert "tito" in policy_names()
    eng = ScriptedEngine(smol_renderer.tokenizer, ["Let me look.", "Found it: ünï 🎉"])
    policy = make_policy("tito", engine=eng, renderer=smol_renderer, seed=42, max_tokens=64)
    msgs = [Message(role="system", content="sys"), Message(role="user", content="task")]
    c1 = await policy(_req(msgs, sampling=SamplingParams(max_tokens=32000, temperature=0.2)))
    assert isinstance(c1, Completion) and c1.text == "Let me look." and c1.finish_reason == "stop"
    assert c1.tokens is not None
    assert c1.tokens.output_ids.tolist() == eng.results[
        0].output_ids and c1.tokens.output_logprobs.tolist() == [-0.1] * 5
    assert c1.tokens.prompt_ids.tolist() == list(eng.calls[0][0])
    rec = c1.extra["tito"]
    # Temperature 1.0 as configured (the request's 0.2 is not honored by default); max_tokens capped.
    assert rec["sampling"]["temperature"] == 1.0 and rec["sampling"]["max_tokens"] == 64
    assert rec["sampling"]["top_p"] == 1.0 and rec["sampling"]["top_k"] == 0
    assert isinstance(rec["sampling"]["seed"], int) and rec["mode"] == "first"
    assert (rec["engine"], rec["model"], rec["renderer"]) == ("scripted", "scripted-model", "default")
    msgs2 = [*msgs, Message(role="assistant", content=c1.text), Message(role="user", content="go on")]
    c2 = await policy(_req(msgs2))
    assert isinstance(c2, Completion) and c2.tokens is not None
    assert c2.extra["tito"]["mode"] == "extend"
    assert c2.tokens.prompt_ids[: len(c1.tokens.prompt_ids)
                                + 5].tolist() == c1.tokens.prompt_ids.tolist() + c1.tokens.output_ids.tolist()
    assert c2.extra["tito"]["sampling"]["seed"] != rec["sampling"]["seed"]  # derived per turn
    assert policy.stats("direct").to_dict()["extended"] == 1
    assert policy.run_info()["policy"] == "tito" and policy.run_info()["sampling"]["temperature"] == 1.0


async def test_request_sampling_is_honored_when_asked(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.policies.tito import TitoPolicy

    eng = ScriptedEngine(smol_renderer.tokenizer, ["a"])
    policy = TitoPolicy(eng, renderer=smol_renderer, honor_request_sampling=True)
    sp = SamplingParams(temperature=0.3, top_p=0.5, top_k=7, seed=11, max_tokens=9)
    c = await policy(_req([Message(role="user", content="x")], sampling=sp))
    assert isinstance(c, Completion)
    s = eng.calls[0][1]
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (0.3, 0.5, 7, 11, 9)
    assert c.extra["tito"]["sampling"] == {"max_tokens": 9, "temperature": 0.3, "top_p": 0.5, "top_k": 7,
                                           "seed": 11}


async def test_streaming_deltas_spell_the_recorded_answer(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.policies.tito import TitoPolicy

    text = "Streamed: 日本語 and 🎉 emoji, split across byte-level tokens."
    eng = ScriptedEngine(smol_renderer.tokenizer, [text])
    policy = TitoPolicy(eng, renderer=smol_renderer)
    out = await policy(_req([Message(role="user", content="x")], stream=True))
    assert hasattr(out, "__aiter__")
    deltas: list[str] = []
    final: Completion | None = None
    async for item in out:  # type: ignore[union-attr]
        if isinstance(item, CompletionDelta):
            assert item.text and "\ufffd" not in item.text
            deltas.append(item.text)
        else:
            final = item
    assert final is not None and final.text == text == "".join(deltas)
    assert len(deltas) > 5 and final.tokens is not None


async def test_engine_errors_become_policy_errors(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.core.canonical import ContentPart
    from ares_gateway.policies import PolicyError
    from ares_gateway.policies.tito import TitoPolicy

    eng = ScriptedEngine(smol_renderer.tokenizer, [])
    policy = TitoPolicy(eng, renderer=smol_renderer)
    eng.fail = PromptTooLongError(9000, 8192)
    with pytest.raises(PolicyError, match="9000 tokens") as e:
        await policy(_req([Message(role="user", content="x")]))
    assert e.value.status == 400
    eng.fail = EngineUnavailableError("down")
    with pytest.raises(PolicyError) as e:
        await policy(_req([Message(role="user", content="x")]))
    assert e.value.status == 503
    with pytest.raises(PolicyError, match="image") as e:
        await policy(_req([Message(role="user", content=[ContentPart(type="image", url="data:,")])]))
    assert e.value.status == 400


def test_http_engines_need_a_tokenizer_and_url() -> None:
    from ares_gateway.policies.tito import TitoPolicy

    with pytest.raises(ValueError, match="needs url="):
        TitoPolicy("sglang")
    with pytest.raises(ValueError, match="needs tokenizer="):
        TitoPolicy("vllm", url="http://127.0.0.1:8000", model="m")
