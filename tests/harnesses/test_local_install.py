"""Agent installs for local sandboxes shared by processes on one host: two processes installing the
same agent into an empty root at once install it once, and nobody sees a half-written install."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ares_gateway.episodes.installs import ensure_local_install
from harnesses.tiny_agent import SCRIPT, VERSION

REPO = Path(__file__).resolve().parents[2]
INSTALL = ("import asyncio, sys; from ares_gateway.episodes.installs import ensure_local_install; "
           "print('ROOT', asyncio.run(ensure_local_install('tiny-agent', root=sys.argv[1])), flush=True)")


def _watch(final: Path, stop: threading.Event, seen: list[str]) -> None:
    """Record every moment the published path exists without a complete install behind it."""
    while not stop.is_set():
        if final.exists():
            agent = final / "bin" / "tiny-agent"
            marker = (final / ".ares-complete").is_file()
            text = agent.read_text() if agent.is_file() else ""
            if not marker or text != SCRIPT:
                seen.append(f"marker={marker} script={len(text)}/{len(SCRIPT)} bytes")
        time.sleep(0.002)


def test_two_processes_install_once_and_nobody_sees_half(tmp_path: Path) -> None:
    root = tmp_path / "agents"
    final = root / "tiny-agent" / VERSION
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch, args=(final, stop, seen), daemon=True)
    watcher.start()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", INSTALL, str(root)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    stop.set()
    watcher.join()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert f"ROOT {root}" in out
    installs = sum(out.count("installing tiny-agent") for out, _ in outs)
    assert installs == 1, outs
    assert seen == []
    # One install directory, published through the versioned name, and it runs.
    staged = [e for e in os.listdir(root / "tiny-agent") if not e.endswith(".lock")]
    assert sorted(staged) == sorted([VERSION, os.readlink(final)]), staged
    r = subprocess.run([sys.executable, str(final / "bin" / "tiny-agent"), "--version"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"tiny-agent {VERSION}"


def test_leftovers_of_an_interrupted_install_are_replaced(tmp_path: Path) -> None:
    root = tmp_path / "agents"
    parent = root / "tiny-agent"
    # An install interrupted in place (no completion marker) and a dead installer's staging directory.
    (parent / VERSION / "bin").mkdir(parents=True)
    (parent / VERSION / "bin" / "tiny-agent").write_text(SCRIPT[:40])
    (parent / f".{VERSION}.deadbeef").mkdir()
    assert asyncio.run(ensure_local_install("tiny-agent", root=str(root), quiet=True)) == str(root)
    final = parent / VERSION
    assert final.is_symlink() and (final / ".ares-complete").is_file()
    assert (final / "bin" / "tiny-agent").read_text() == SCRIPT
    assert sorted(e for e in os.listdir(parent)
                  if not e.endswith(".lock")) == sorted([VERSION, os.readlink(final)])
    # A second call reuses it.
    target = os.readlink(final)
    assert asyncio.run(ensure_local_install("tiny-agent", root=str(root), quiet=True)) == str(root)
    assert os.readlink(final) == target
