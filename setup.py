"""Build: the modules on an agent turn's path are compiled with mypyc when a C compiler is there.

Everything else about the distribution is in pyproject.toml. The compiled
modules are the same source, type-checked by mypy and turned into C; they
cut the gateway's own CPU per turn by about a third (docs/performance.md).
Without a compiler, or with ``ARES_GATEWAY_COMPILE=0`` at build time, the
install is pure Python and behaves the same. ``ares_gateway/_native.py``
checks at import time that compiled modules still match their sources.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
from pathlib import Path

from setuptools import setup

# The module list lives in ares_gateway/_native.py (standard library only), which also guards at import time.
COMPILED = [
    name.replace(".", "/") + ".py" for name in runpy.run_path("ares_gateway/_native.py")["COMPILED_MODULES"]
]
MANIFEST = Path("ares_gateway/_native.json")


def _extensions() -> list:
    MANIFEST.unlink(missing_ok=True)
    if os.environ.get("ARES_GATEWAY_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # mypy is a build requirement, but a --no-build-isolation build may lack it
        print("ares-gateway: mypyc not found; installing pure Python")
        return []
    # What was compiled, by content: _native.py falls back to the sources when they differ
    # (an edited editable install), so a stale extension never runs.
    MANIFEST.write_text(json.dumps({
        path.removesuffix(".py").replace("/", "."): hashlib.sha256(Path(path).read_bytes()).hexdigest()
        for path in COMPILED
    }, indent=1) + "\n")
    extensions = mypycify(COMPILED, opt_level="3", debug_level="0")
    for ext in extensions:
        ext.optional = True  # no C compiler: a warning and a pure-Python install, not a failed one
    return extensions


setup(ext_modules=_extensions(), package_data={"ares_gateway": ["_native.json"]})
