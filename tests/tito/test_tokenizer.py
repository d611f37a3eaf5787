"""The tokenizer rebuilt from the SmolLM2 GGUF: round trips, special tokens, parity with llama.cpp."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.tito.conftest import need_llama

TEXTS = [
    "Hello 12345 world!  how are   you?\n\n  def f(x):\n\treturn x",
    "ünïcödé 日本語 emoji 🎉 tabs\t\tand\r\nCRLF line ends",
    "    indented\n        code()  # comment 3.14159 and 1,000,000",
    "$ ls -la /tmp && echo 'done' | grep -v \"x\" > out.txt 2>&1",
    "```bash\ncat <<'EOF' > a.py\nprint(\"hi\")\nEOF\n```",
    "",
    " leading space, trailing space ",
    "a" * 300 + " " + "9" * 50,
]


def test_gguf_metadata_and_specials(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import default_model_path, read_gguf_metadata

    meta = read_gguf_metadata(default_model_path())
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 == smol_tokenizer.vocab_size
    assert meta["llama.context_length"] == 8192
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    tok = smol_tokenizer
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    # Special-token text is one id, never split into pieces.
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tok.encode("user\nhi"), 2]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smol_tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = smol_tokenizer.encode(text)
    assert smol_tokenizer.decode(ids) == text
    # Digits are split one by one (the GGUF's 'smollm' pre-tokenizer), as llama.cpp does.
    if "12345" in text:
        five = smol_tokenizer.encode("12345")
        assert len(five) == 5


def test_loaded_once(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import load_tokenizer

    assert load_tokenizer() is smol_tokenizer
    assert load_tokenizer(smol_tokenizer.name_or_path) is smol_tokenizer


def test_same_ids_as_llama_cpp(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    need_llama()
    from llama_cpp import Llama

    from ares_gateway.tokens import default_model_path

    llm = Llama(model_path=default_model_path(), vocab_only=True, verbose=False)
    chat = smol_tokenizer.render_text(
        [{"role": "system", "content": TEXTS[0]}, {"role": "user", "content": TEXTS[1]},
         {"role": "assistant", "content": TEXTS[4]}, {"role": "user", "content": TEXTS[3]}],
        add_generation_prompt=True,
    )
    for text in [*TEXTS, chat]:
        assert smol_tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=False,
                                                           special=True), text[:40]


def test_bad_files_say_why(tmp_path: Path) -> None:
    from ares_gateway.tokens import TokenizerLoadError, load_tokenizer, read_gguf_metadata

    with pytest.raises(TokenizerLoadError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all, just bytes" * 4)
    with pytest.raises(TokenizerLoadError, match="no GGUF magic"):
        load_tokenizer(junk)
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\x03")
    with pytest.raises(TokenizerLoadError, match="truncated"):
        read_gguf_metadata(str(short))
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
