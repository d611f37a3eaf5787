"""The transformers engine on SmolLM2's real weights, and the tokenizer parity the trainer adapters rely on.

The ids the gateway renders with (its GGUF tokenizer, the same ids llama.cpp uses) must be exactly
the trainer's (``AutoTokenizer`` loaded from the same GGUF), and the logprobs the engine records must
be the model's own, whatever the engine cached between calls.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from ares_gateway.engines import EngineError, PromptTooLongError, Sampling, collect, make_engine

# SmolLM2 loaded into transformers (about a minute) and sampled on CPU: a module of minutes.
pytestmark = pytest.mark.slow

PROBE = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
         "Write a shell command that counts the lines of README.md.<|im_end|>\n<|im_start|>assistant\n")

# Code, whitespace runs, digits, non-Latin scripts, emoji, control-token text, mini-swe-agent's format.
TEXTS = [
    "def median(xs):\n    xs = sorted(xs)\n    n = len(xs)\n    return (xs[n//2-1] + xs[n//2]) / 2 if n % 2 "
    "== 0 else xs[n//2]\n", "    \t\t  trailing spaces   \n\n\n  and 1234567890 digits 3.14159e-10 0x7fff",
    "Ünïcödé façade — naïve café; 日本語のテキスト; Привет мир; مرحبا; 🙂🚀👩‍💻",
    "THOUGHT: I need to look at the tests first.\n\n```mswea_bash_command\ncd /app && pytest -q tests/ 2>&1 "
    "| tail -n 20\n```",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|><|endoftext|>",
    '{"returncode": 1, "output": "Traceback (most recent call last):\\n  File \\"x.py\\", line 3"}',
]


def test_the_gateway_tokenizes_exactly_like_the_trainer_and_llama_cpp(smollm2: tuple[Any, Any]) -> None:
    from ares_gateway.tokens import ChatRenderer
    from ares_gateway.tokens.tokenizer import default_model_path

    _model, hf = smollm2
    renderer = ChatRenderer(default_model_path())
    ours = renderer.tokenizer
    chat = [{"role": "system", "content": TEXTS[0]}, {"role": "user", "content": TEXTS[2]},
            {"role": "assistant", "content": TEXTS[3]}, {"role": "user", "content": TEXTS[5]}]
    texts = [*TEXTS, hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
    try:
        from llama_cpp import Llama

        llm: Any = Llama(model_path=default_model_path(), vocab_only=True, verbose=False)
    except ImportError:
        llm = None
    for text in texts:
        theirs = list(hf.encode(text, add_special_tokens=False))
        assert list(ours.encode(text)) == theirs, text
        if llm is not None:
            assert list(llm.tokenize(text.encode(), add_bos=False, special=True)) == theirs, text
        assert hf.decode(theirs) == ours.decode(theirs)
    # A prompt rendered by the gateway (what the engine is given) is the trainer's own chat-template ids.
    hf_ids = list(hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert list(renderer.render(chat).prompt_ids) == hf_ids


def _engine(model: Any, **options: Any) -> Any:
    return make_engine("transformers", model=model, **options)


async def test_sampled_logprobs_are_the_models_own_through_the_prefix_cache(smollm2: tuple[Any, Any]) -> None:
    model, hf = smollm2
    engine = _engine(model)
    try:
        prompt = hf.encode(PROBE, add_special_tokens=False)
        first = await engine.generate(prompt, Sampling(max_tokens=24, seed=3))
        assert len(first.output_ids) == len(first.logprobs) >= 1 and first.cached_tokens == 0
        full = prompt + first.output_ids
        scored = await engine.score(full, len(prompt))
        assert max(abs(a - b) for a, b in zip(scored, first.logprobs, strict=True)) < 1e-4
        # The next turn extends the first: only its new tokens are evaluated, the numbers do not move.
        turn2 = full + hf.encode(
            "<|im_end|>\n<|im_start|>user\nAnd the words?<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False)
        second = await engine.generate(turn2, Sampling(max_tokens=16, seed=4))
        assert second.cached_tokens == len(full) - 1  # the first answer's last token was never evaluated
        again = await _engine(model, max_cached_sequences=0).generate(turn2, Sampling(max_tokens=16, seed=4))
        assert again.cached_tokens == 0 and again.output_ids == second.output_ids
        assert max(abs(a - b) for a, b in zip(again.logprobs, second.logprobs, strict=True)) < 1e-4
    finally:
        await engine.aclose()


async def test_top_k_top_p_and_temperature_logprobs_are_of_the_distribution_sampled(
    smollm2: tuple[Any, Any]) -> None:
    model, hf = smollm2
    engine = _engine(model)
    try:
        prompt = hf.encode(PROBE, add_special_tokens=False)
        plain = await engine.generate(prompt, Sampling(max_tokens=1, seed=1, temperature=0))
        greedy_lp = (await engine.score(prompt + plain.output_ids, len(prompt)))[0]
        assert abs(plain.logprobs[0] - greedy_lp) < 1e-4  # greedy records the temperature-1 log-softmax
        top1 = await engine.generate(prompt, Sampling(max_tokens=8, seed=1, top_k=1))
        assert all(abs(lp) < 1e-9 for lp in top1.logprobs)  # one candidate: probability 1
        assert top1.output_ids[0] == plain.output_ids[0]
        nucleus = await engine.generate(prompt, Sampling(max_tokens=8, seed=2, top_p=0.5, temperature=0.7))
        # Renormalized over the nucleus: each token's probability there is at least its full-softmax one.
        full = await engine.score(prompt + nucleus.output_ids[:1], len(prompt))
        assert nucleus.logprobs[0] >= full[0] - 1e-6 or math.isclose(nucleus.logprobs[0], full[0],
                                                                     abs_tol=1e-4)
    finally:
        await engine.aclose()


async def test_a_weight_update_drops_the_cache_and_the_next_call_samples_the_new_weights(
    smollm2: tuple[Any, Any]) -> None:
    import torch

    model, hf = smollm2
    engine = _engine(model)
    prompt = hf.encode(PROBE, add_special_tokens=False)
    head = model.get_output_embeddings().weight
    saved = head.detach().clone()
    try:
        before = await engine.generate(prompt, Sampling(max_tokens=4, seed=5))
        extended = prompt + before.output_ids
        version = engine.weights_version()
        with torch.no_grad():
            head.mul_(1.5)  # what an optimizer step does: an in-place update of a parameter
        assert engine.weights_version() != version
        after = await engine.generate(extended, Sampling(max_tokens=4, seed=6))
        assert after.cached_tokens == 0  # the cache was computed under the old weights
        scored = await engine.score(extended + after.output_ids, len(extended))
        assert max(abs(a - b) for a, b in zip(scored, after.logprobs, strict=True)) < 1e-4
        old_scored = await engine.score(prompt + before.output_ids, len(prompt))
        assert max(abs(a - b) for a, b in zip(old_scored, before.logprobs, strict=True)) > 1e-3
    finally:
        with torch.no_grad():
            head.copy_(saved)
        await engine.aclose()


async def test_concurrent_sessions_do_not_corrupt_each_other(smollm2: tuple[Any, Any]) -> None:
    model, hf = smollm2
    engine = _engine(model, max_cached_sequences=2)
    try:
        prompts = [hf.encode(PROBE.replace("README.md", name), add_special_tokens=False)
                   for name in ("a.txt", "setup.py", "the logs")]
        # Three sessions at once, each streamed and sampled with its own seed, twice (the cache holds two).
        for _round in range(2):
            results = await asyncio.gather(*(collect(engine.stream(p, Sampling(max_tokens=12, seed=i)))
                                             for i, p in enumerate(prompts)))
            for p, r in zip(prompts, results, strict=True):
                scored = await engine.score(p + r.output_ids, len(p))
                assert max(abs(a - b) for a, b in zip(scored, r.logprobs, strict=True)) < 1e-4
        alone = await _engine(model, max_cached_sequences=0).generate(prompts[1],
                                                                      Sampling(max_tokens=12, seed=1))
        # same seed, same ids: nothing leaked between sessions
        assert alone.output_ids == results[1].output_ids
        assert engine.calls == 6 and engine.busy_s > 0
    finally:
        await engine.aclose()


async def test_bad_calls_say_what_is_wrong(smollm2: tuple[Any, Any], tmp_path: Path) -> None:
    model, _hf = smollm2
    engine = _engine(model, context=64)
    try:
        with pytest.raises(PromptTooLongError, match="64"):
            await engine.generate(list(range(100)), Sampling(max_tokens=4))
        with pytest.raises(EngineError, match="empty prompt"):
            await engine.generate([], Sampling(max_tokens=4))
        with pytest.raises(EngineError, match="transformers model failed"):
            await engine.generate([10**9, 5], Sampling(max_tokens=4))  # an id outside the vocabulary
        ok = await engine.generate([1, 2, 3], Sampling(max_tokens=2, seed=0))  # still usable afterwards
        assert len(ok.output_ids) == 2
    finally:
        await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        await engine.generate([1, 2], Sampling(max_tokens=1))
    with pytest.raises(ValueError, match="needs model="):
        make_engine("transformers")
    with pytest.raises(TypeError, match="causal LM"):
        make_engine("transformers", model=object())
