#!/bin/sh
set -eu
cat > slug.py <<'PY'
"""URL slugs."""

import re


def slugify(text):
    """Turn a title into a URL slug, e.g. "Hello, World!" -> "hello-world"."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words)
PY
python3 -m unittest -q test_slug
