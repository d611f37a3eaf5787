"""The llama.cpp build guard: a build that would segfault the process (llama.cpp's AMX backend on a CPU
whose kernel does not grant AMX) fails with the rebuild command instead. The crashing build itself is
played by a probe that dies of SIGSEGV, as the real one does in ggml_backend_amx_mul_mat."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tito.conftest import need_llama


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    need_llama()
    import llama_cpp

    from ares_gateway.engines import llama_cpp as mod

    monkeypatch.setattr(mod, "_checked", {})
    monkeypatch.setattr(llama_cpp, "llama_print_system_info",
                        lambda: b"CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | ")
    yield mod


def test_a_crashing_amx_build_fails_with_the_rebuild_command(guard, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.engines import EngineUnavailableError

    monkeypatch.setattr(guard, "_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    with pytest.raises(EngineUnavailableError) as info:
        guard.check_build()
    msg = str(info.value)
    assert "SIGSEGV" in msg and "AMX" in msg and guard.REBUILD_HINT in msg
    assert ("--no-cache-dir --force-reinstall" in guard.REBUILD_HINT
            and "-DGGML_NATIVE=OFF" in guard.REBUILD_HINT)
    # Remembered for the process: the engine's load fails the same way, without a second probe.
    monkeypatch.setattr(guard, "_PROBE", "raise SystemExit('must not run again')")
    eng = guard.LlamaCppEngine()
    with pytest.raises(EngineUnavailableError, match="SIGSEGV"):
        eng._load()


def test_an_amx_build_that_works_passes_the_probe(guard) -> None:  # type: ignore[no-untyped-def]
    # The real probe (load the embedded model, evaluate 4 tokens in a child) on this working build.
    assert "AMX_INT8" in guard.check_build()


def test_a_build_without_amx_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    need_llama()
    from ares_gateway.engines import llama_cpp as mod

    monkeypatch.setattr(mod, "_checked", {})
    monkeypatch.setattr(mod, "_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | FMA = 1 | ")
    assert "AVX2" in mod.check_build()
