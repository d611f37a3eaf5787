"""Token-in/token-out: tokenizer, renderer, token streams, engines, the tito policy (docs/tito.md)."""
