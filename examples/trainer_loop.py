"""An example trainer loop: GatewayEnv episodes in parallel over real sandboxes, samples collected.

Each episode runs a real agent CLI (mini-swe-agent by default) on a bundled task in its own sandbox;
every LLM call it makes is one env step, answered by ``ToyModel``. At the end the env's reward is the
task's tests' and ``env.trajectory()`` gives token-faithful training samples, which a trainer would
turn into a gradient step (here: printed); the foreign ones, conversations that do not extend the
session's first request, are left out.

``ToyModel`` stands in for an inference engine: it decides with the oracle policy (the task's reference
solution, played through the agent's own tools) and attaches byte-level token ids and logprobs to each
answer, as an engine returns them. Replace ``ToyModel.generate`` with your engine (vLLM, SGLang, ...)
and keep the rest.

    python examples/trainer_loop.py --sandbox local --episodes 4 --concurrency 2 --iterations 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from ares_gateway import Completion, EpisodeConfig, Gateway, GatewayEnv, ParkedRequest, TokenRecord
from ares_gateway.episodes.episode import harness_side_call_detector
from ares_gateway.episodes.tasks import Task, load_dataset
from ares_gateway.policies import call_policy, make_policy


class ToyModel:
    """A stand-in for an inference engine (see the module docstring)."""

    def __init__(self) -> None:
        self.oracle = make_policy("oracle")

    def start_episode(self, session_id: str, agent: str, task: Task) -> None:
        self.oracle.bind(session_id, agent=agent, task=task)

    def end_episode(self, session_id: str) -> None:
        self.oracle.unbind(session_id)

    @staticmethod
    def _tokens(messages: list[dict[str, Any]]) -> list[int]:
        # A byte-level "chat template": one JSON line per message.
        return list("".join(json.dumps(m, sort_keys=True) + "\n" for m in messages).encode())

    async def generate(self, request: ParkedRequest) -> Completion:
        completion = await call_policy(self.oracle, request)
        assert isinstance(completion, Completion)
        prompt = self._tokens([m.to_chat_dict() for m in request.request.messages])
        output = self._tokens([completion.to_message().to_chat_dict()])
        tokens = TokenRecord(prompt_ids=prompt, output_ids=output, output_logprobs=[-0.05] * len(output),
                             finish_reason=completion.finish_reason)
        return completion.model_copy(update={"tokens": tokens})


async def run_episode(gw: Gateway, model: ToyModel, task: Task, args: argparse.Namespace) -> dict[str, Any]:
    config = EpisodeConfig(args.harness, sandbox=args.sandbox, step_limit=args.step_limit)
    env = GatewayEnv.for_task(task, config, gateway=gw)
    started = time.monotonic()
    try:
        ts = await env.reset()
        if not ts.last():
            assert env.session is not None
            model.start_episode(env.session.session_id, "mini-swe-agent", task)
        while not ts.last():
            assert ts.observation is not None
            ts = await env.step(await model.generate(ts.observation))
        # A foreign sample is a conversation that does not extend the session's first request (one the
        # agent's own tool commands sent with the session's credentials): never trained.
        samples = [s for s in env.trajectory() if not s.metadata.get("foreign")]
        return {"task": task.name, "reward": ts.reward, "steps": ts.info.get("steps"), "samples": samples,
                "exit_reason": ts.info.get("exit_reason"), "seconds": time.monotonic() - started}
    finally:
        if env.session is not None:
            model.end_episode(env.session.session_id)
        await env.close()


async def main(args: argparse.Namespace) -> int:
    tasks = list(load_dataset(args.dataset).tasks)
    model = ToyModel()
    limit = asyncio.Semaphore(args.concurrency)

    async def bounded(task: Task) -> dict[str, Any]:
        async with limit:
            return await run_episode(gw, model, task, args)

    ok = True
    # One gateway for every episode; the harness's side-call detector tags its side requests.
    async with Gateway(port=0, side_call_detector=harness_side_call_detector(args.harness)) as gw:
        for it in range(args.iterations):
            batch = [tasks[(it * args.episodes + i) % len(tasks)] for i in range(args.episodes)]
            results = await asyncio.gather(*(bounded(t) for t in batch))
            samples = [s for r in results for s in r["samples"]]
            # A real trainer would compute a policy-gradient loss over these samples here.
            trained = sum(int(s.loss_mask.sum()) for s in samples)
            mean = sum(r["reward"] for r in results) / len(results)
            for r in results:
                print(f"  {r['task']}: reward {r['reward']:.2f}, {r['steps']} steps, "
                      f"{len(r['samples'])} sample(s), {r['exit_reason']}, {r['seconds']:.1f}s")
            print(f"iteration {it}: {len(results)} episodes, mean reward {mean:.3f}, {len(samples)} samples, "
                  f"{sum(len(s.tokens) for s in samples)} tokens ({trained} trained)", flush=True)
            ok = ok and all(r["samples"] for r in results)
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="examples")
    ap.add_argument("--harness", default="mini-swe-agent",
                    help="mini-swe-agent or tiny-agent (both speak its format)")
    ap.add_argument("--sandbox", default="local", choices=("auto", "local", "docker", "daytona"))
    ap.add_argument("--episodes", type=int, default=4, help="episodes per iteration")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--step-limit", type=int, default=20)
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
