"""Run harbor's Terminus-2 agent inside this sandbox, with an environment whose exec is local.

Uploaded by ``harnesses.terminus2`` and run with the virtual environment that holds ``harbor``
(Python >= 3.12). Terminus-2 drives a tmux session through ``environment.exec``; here that is a plain
local subprocess, so the agent, tmux and the shell all live in the sandbox. LLM calls go through
litellm to ``--api-base`` (the gateway session, OpenAI chat completions) with ``OPENAI_API_KEY``.

Exit status: 0 when the agent loop ended (task_complete confirmed, or max turns), 1 on an error.
"""

# ruff: noqa: ASYNC240  (a standalone script in the sandbox; its few tiny file operations may block)
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
from pathlib import Path, PurePosixPath
from typing import Any


class LocalEnvironment:
    """The slice of harbor's BaseEnvironment that Terminus-2 and its TmuxSession use, run locally."""

    def __init__(self, workdir: str, session_id: str) -> None:
        self.workdir = workdir
        self.session_id = session_id
        self.default_user: str | None = None
        self.trial_paths = None

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,  # the sandbox already runs us as the agent's user
    ) -> Any:
        from harbor.environments.base import ExecResult

        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command,
            cwd=cwd or self.workdir,
            env={**os.environ, **(env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            return ExecResult(stdout=out.decode(errors="replace"), stderr="timed out", return_code=124)
        return ExecResult(
            stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
            return_code=proc.returncode or 0
        )

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return Path(path).is_dir()

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return Path(path).is_file()

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        Path(target_path).write_bytes(Path(source_path).read_bytes())

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).write_bytes(Path(source_path).read_bytes())


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instruction-file", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-base", required=True)
    ap.add_argument("--logs-dir", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--session-id", default="ares")
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--context-tokens", type=int, default=128_000)
    args = ap.parse_args()

    import harbor.agents.terminus_2.terminus_2 as t2
    from harbor.models.agent.context import AgentContext

    logs = Path(args.logs_dir)
    logs.mkdir(parents=True, exist_ok=True)

    class _Paths:  # the pane log goes to our logs dir instead of harbor's /logs/agent mount
        agent_dir = PurePosixPath(str(logs))

    t2.EnvironmentPaths = _Paths  # type: ignore[assignment,misc]
    env = LocalEnvironment(args.workdir, args.session_id)
    agent = t2.Terminus2(
        logs_dir=logs,
        model_name=args.model,
        api_base=args.api_base,
        max_turns=args.max_turns,
        record_terminal_session=False,
        model_info={
            "max_input_tokens": args.context_tokens,
            "max_output_tokens": 8192,
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
        },
    )
    context = AgentContext()
    code = 0
    try:
        await agent.setup(env)  # type: ignore[arg-type]
        instruction = Path(args.instruction_file).read_text()
        await agent.run(instruction, env, context)  # type: ignore[arg-type]
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        try:
            (logs / "context.json").write_text(context.model_dump_json(indent=2))
        except Exception:
            pass
        await env.exec("tmux kill-server 2>/dev/null || true")
    print(json.dumps({"terminus2_exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
