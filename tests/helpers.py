"""Helpers shared by test modules of several suites: loopback ports, the CLI's command line, a served
gateway in a child process, what local sandboxes leave behind, waiting on a CLI process, token records,
and harnesses that fail on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp

from ares_gateway.core.canonical import TokenRecord
from harnesses.tiny_agent import TinyAgentHarness


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a server may take it, a client is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    """The ``ares-gateway`` command line, run with this interpreter."""
    return [sys.executable, "-m", "ares_gateway.cli", *args]


def start_serve(*args: str, env: Mapping[str, str] | None = None,
                merge_stderr: bool = False) -> subprocess.Popen[str]:
    """``ares-gateway serve ARGS`` in a child process, its output piped as text (``merge_stderr``: stderr
    into stdout); ``env``: its whole environment (default: this one's)."""
    return subprocess.Popen(cli("serve", *args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            env=None if env is None else dict(env))


async def wait_serving(url: str, proc: subprocess.Popen[str], *, timeout: float = 20.0) -> None:
    """Wait until ``url``'s ``/healthz`` answers 200; fails with the server's output if it exits first, or
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stderr or proc.stdout
                raise AssertionError(f"serve exited: {out.read() if out else ''}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/healthz") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError(f"serve did not come up in {timeout:.0f} s")


async def eventually(check: Callable[[], object], what: str = "the condition", *, timeout: float = 5.0,
                     every: float = 0.01) -> None:
    """Wait on the running loop until ``check()`` is true; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)


def left_behind(root: Path) -> list[str]:
    """The names of the entries under a local sandbox root (``[]`` when it was never created)."""
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def wait_while_running(proc: subprocess.Popen[str], ready: Callable[[], object], *, timeout: float,
                       what: str, every: float = 0.3) -> None:
    """Wait until ``ready()`` is true while ``proc`` still runs: fails with its output if it exits first,
    and with ``what`` (what did not happen) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, what
        time.sleep(every)


def token_record(prompt: list[int], output: list[int]) -> TokenRecord:
    """A generation's tokens, every output token at logprob -0.5."""
    return TokenRecord(prompt_ids=prompt, output_ids=output, output_logprobs=[-0.5] * len(output))


class BrokenInstallHarness(TinyAgentHarness):
    """tiny-agent whose install fails (as a registry refusing the download would): an infrastructure
    failure before the agent's first LLM call."""

    name = "broken-install"

    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        return [("download the agent", "echo 'registry says no' >&2; exit 4")]


class CrashingHarness(TinyAgentHarness):
    """tiny-agent whose agent exits 7 at once, saying so on stderr: the agent's own failure."""

    def agent_command(self, ctx, prep, prompt):  # type: ignore[no-untyped-def]
        return "sh -c \"echo 'agent blew up' >&2; exit 7\""
