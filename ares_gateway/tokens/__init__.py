"""Token-in/token-out rendering: prompts rendered to ids with the model's chat template, completions parsed
back.

* :class:`ChatTokenizer` / :func:`load_tokenizer`: the model's tokenizer (``tokenizers``, no torch) and
  chat template, from a GGUF file or a Hugging Face directory; one per model, cached.
* :class:`ChatRenderer`: full renders, parsing of completion ids into a canonical ``Completion``, and
  the checked incremental extension of a previous turn (:meth:`ChatRenderer.bridge`).
* :class:`TokenStreams`: per-session streams; a request extends the deepest earlier turn it continues,
  fresh renders (history rewritten) are counted with their reason.

Needs the ``model`` extra (``pip install 'ares-gateway[model]'``). See ``docs/tito.md``.
"""

from ares_gateway.tokens.renderer import Bridge, ChatRenderer, Rendered, RenderError
from ares_gateway.tokens.streams import Prepared, StreamStats, TokenStreams
from ares_gateway.tokens.tokenizer import (
    ChatTokenizer,
    TokenizerLoadError,
    default_model_path,
    load_tokenizer,
    read_gguf_metadata,
)

__all__ = [
    "Bridge",
    "ChatRenderer",
    "ChatTokenizer",
    "Prepared",
    "RenderError",
    "Rendered",
    "StreamStats",
    "TokenStreams",
    "TokenizerLoadError",
    "default_model_path",
    "load_tokenizer",
    "read_gguf_metadata",
]
