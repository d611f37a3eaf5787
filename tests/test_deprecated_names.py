"""Renamed modules still import for one release, with a DeprecationWarning, and give the same objects."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("old", "new", "names"), [
    ("ares_gateway.protocols.base", "ares_gateway.core.wire",
     ("ProtocolAdapter", "RequestError", "Reuse", "StreamEncoder")),
    ("ares_gateway.engines.server", "ares_gateway.engines.engine_server",
     ("EngineServer", "MAX_NEW_TOKENS_CAP", "MAX_TEMPERATURE")),
])
def test_an_old_module_name_warns_and_is_the_new_one(old: str, new: str, names: tuple[str, ...]) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    current = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(current, name), name


def test_the_project_itself_imports_no_deprecated_module() -> None:
    code = ("import sys, ares_gateway, ares_gateway.protocols, ares_gateway.engines.engine_server, "
            "ares_gateway.trainers._served, ares_gateway.http.app; "
            "print(sorted(m for m in ('ares_gateway.protocols.base', 'ares_gateway.engines.server') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("module", ["ares_gateway", "ares_gateway.episodes", "ares_gateway.episodes.stream"])
def test_rollout_episode_warns_and_is_the_episode_record(module: str) -> None:
    from ares_gateway.episodes.driver import EpisodeRecord

    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match="RolloutEpisode is EpisodeRecord now"):
        old = mod.RolloutEpisode
    assert old is EpisodeRecord
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        mod.NoSuchName  # noqa: B018
