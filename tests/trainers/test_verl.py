"""verl's own AgentLoopWorker runs the registered ``ares_gateway`` loop on real mini-swe-agent episodes.

The worker is verl's real class built from verl's real ``ppo_trainer`` config (hydra), with the loop's
options in a real agent-loop config file; it instantiates the loop per row with
``hydra.utils.instantiate`` and post-processes (pads) its outputs into a ``DataProto`` as in training.
What cannot run here is a GPU rollout server: the worker's ``LLMServerClient`` is verl's own class
with its one Ray hop (acquire a server from the load balancer actor, ``server.generate.remote``)
replaced by an in-process server that serves verl's ``sampling_params`` the way verl's vLLM server
does, sampling SmolLM2 on the project's llama.cpp engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ares_gateway.engines.base import Sampling
from ares_gateway.trainers import UnknownTaskError
from harnesses import registry
from tests.helpers import BrokenInstallHarness
from tests.prereq import require
from tests.trainers.conftest import recorded_main_line, require_mini_install

pytestmark = pytest.mark.slow

EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"
TASKS = ["fix-median-bug", "write-greeting-file"]
PROMPT_LENGTH = 2048
RESPONSE_LENGTH = 6144


def _verl() -> Any:
    try:
        from verl.experimental.agent_loop import agent_loop
    except Exception as exc:
        require(False, f"verl is not installed ({exc}): python3 -m pip install -e '.[verl]'")
    return agent_loop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What ``actor_rollout_ref.model.path`` points at: SmolLM2's tokenizer and config as a Hugging Face
    folder, saved from the embedded GGUF (the weights stay in the GGUF the llama.cpp server samples)."""
    _verl()
    from transformers import AutoConfig, AutoTokenizer

    from ares_gateway.tokens.tokenizer import TokenizerLoadError, default_model_path

    try:
        path = default_model_path()
    except TokenizerLoadError as exc:
        require(False, str(exc))
    folder, name = os.path.split(path)
    out = tmp_path_factory.mktemp("smollm2-hf")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = config.architectures or ["LlamaForCausalLM"]  # a GGUF names none; verl wants one
    config.save_pretrained(out)
    return str(out)


class _Remote:
    """A Ray actor method's ``.remote(...)``, in process (awaitable, as an ObjectRef is)."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, **kwargs: Any) -> Any:
        return self._fn(**kwargs)


class LlamaRolloutServer:
    """A rollout server as verl's vLLM server treats ``sampling_params`` (``max_tokens`` popped,
    ``logprobs`` a flag, ``top_k`` -1 off), sampling on the project's llama.cpp engine."""

    def __init__(self, engine: Any, *, fail_when: Any = None) -> None:
        self.engine = engine
        self.fail_when = fail_when
        self.params: list[dict[str, Any]] = []
        self.generate = _Remote(self._generate)

    async def _generate(self, *, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                        **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        sp = dict(sampling_params)
        self.params.append(dict(sp))
        if self.fail_when is not None and self.fail_when(prompt_ids):
            raise RuntimeError("the rollout replica died (injected)")
        max_tokens = sp.pop("max_tokens", RESPONSE_LENGTH)
        want_logprobs = bool(sp.pop("logprobs", False))
        r = await self.engine.generate(prompt_ids, Sampling(
            max_tokens=max_tokens, temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)), top_k=max(0, int(sp.get("top_k", -1))),
            stop_token_ids=tuple(sp.get("stop_token_ids", ())),
        ))
        return TokenOutput(token_ids=r.output_ids, log_probs=r.logprobs if want_logprobs else None,
                           stop_reason="completed", extra_fields={"global_steps": 7})


def _client(config: Any, server: LlamaRolloutServer) -> Any:
    from verl.workers.rollout.llm_server import LLMServerClient

    class InProcessServerClient(LLMServerClient):
        """verl's client, its server acquired in process instead of from the load-balancer actor."""

        def __init__(self) -> None:
            super().__init__(config, load_balancer_handle=None)
            self.routed: list[str] = []

        async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
            self.routed.append(request_id)
            return "llama-0", server

        def _release_server(self, server_id: str, request_id: str | None = None) -> None:
            pass

    return InProcessServerClient()


def _config(model_dir: str, loops: Path) -> Any:
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.name=vllm",  # what the servers would be (none runs here)
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            "data.return_raw_chat=True",
        ])


def _loops_file(tmp_path: Path, **options: Any) -> Path:
    entry = {"name": "ares_gateway", "_target_": "ares_gateway.trainers.verl.AresAgentLoop", **options}
    path = tmp_path / "agent_loops.yaml"
    path.write_text(json.dumps([entry]))  # JSON is YAML
    return path


def _batch(tasks: Sequence[str]) -> Any:
    from verl.protocol import DataProto

    raw = np.empty(len(tasks), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in tasks]
    return DataProto.from_dict(non_tensors={
        "raw_prompt": raw,
        "agent_name": np.array(["ares_gateway"] * len(tasks), dtype=object),
        "index": np.arange(len(tasks)),
    }, meta_info={"global_steps": 1, "validate": False})


def _worker(model_dir: str, loops: Path, server: LlamaRolloutServer) -> tuple[Any, Any]:
    agent_loop = _verl()
    import ares_gateway.trainers.verl  # noqa: F401  (registers the loop, as a trainer's import does)

    config = _config(model_dir, loops)
    client = _client(config, server)
    return agent_loop.AgentLoopWorker(config, llm_client=client), client


def test_verl_agent_loop_worker_runs_real_episodes_and_returns_the_recorded_samples(tmp_path: Path,
                                                                                    model_dir: str) -> None:
    require_mini_install()
    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine()
    server = LlamaRolloutServer(engine)
    loops = _loops_file(tmp_path, dataset="examples", harness="mini-swe-agent", sandbox="local", step_limit=3,
                        max_tokens=32, out=str(tmp_path / "episodes"),
                        harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND})
    worker, client = _worker(model_dir, loops, server)
    batch = _batch([TASKS[0], TASKS[0], TASKS[1]])
    try:
        out = asyncio.run(worker.generate_sequences(batch))
    finally:
        asyncio.run(engine.aclose())

    b, nt = out.batch, out.non_tensor_batch
    assert b["responses"].shape == (3, RESPONSE_LENGTH) and b["prompts"].shape == (3, PROMPT_LENGTH)
    assert list(nt["task"]) == [TASKS[0], TASKS[0], TASKS[1]]
    sessions = [str(s) for s in nt["session_id"]]
    assert len(set(sessions)) == 3 and all(sessions)
    results = {}
    for f in (tmp_path / "episodes").rglob("results.json"):
        for ep in json.loads(f.read_text())["episodes"]:
            results[ep["session_id"]] = ep
    assert set(results) == set(sessions)  # every output is a real episode the gateway ran
    multi_turn = 0
    for i, sid in enumerate(sessions):
        rec = recorded_main_line(tmp_path / "episodes", sid)
        n = len(rec["tokens"]) - rec["response_length"]
        length = int(b["attention_mask"][i, PROMPT_LENGTH:].sum())
        assert length == rec["response_length"]
        # verl's padded tensors hold exactly the recorded sample: ids, loss mask, the server's logprobs.
        assert b["responses"][i, :length].tolist() == rec["tokens"][n:]
        assert b["response_mask"][i, :length].tolist() == rec["loss_mask"]
        assert b["rollout_log_probs"][i, :length].tolist() == pytest.approx(rec["logprobs"], abs=0)
        assert int(b["response_mask"][i, length:].sum()) == 0
        prompt = b["prompts"][i][b["attention_mask"][i, :PROMPT_LENGTH].bool()].tolist()
        assert prompt == rec["tokens"][:n]
        # The verifier's reward on the last response token, as verl's reward tensor.
        assert float(b["rm_scores"][i].sum()) == pytest.approx(results[sid]["reward"])
        assert int(nt["__num_turns__"][i]) == results[sid]["turns"] >= 1
        # Every turn went to the server with the session as its sticky request id.
        assert client.routed.count(sid) == results[sid]["turns"]
        multi_turn += 0 in rec["loss_mask"] and 1 in rec["loss_mask"]
    assert multi_turn >= 1  # tool output between the model's turns, masked out
    assert len(client.routed) == len(server.params) == sum(results[s]["turns"] for s in sessions)
    for sp in server.params:  # verl's sampling params for training, and the gateway's stop and cap
        assert sp["temperature"] == 1.0 and sp["top_k"] == -1 and sp["logprobs"] is True
        assert sp["max_tokens"] == 32 and sp["stop_token_ids"]


def test_failed_episodes_are_reward_0_outputs_and_the_batch_completes(tmp_path: Path, model_dir: str) -> None:
    require_mini_install()
    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    # A harness that cannot be installed: no LLM call, a masked one-token response, reward 0, its error.
    registry.register("broken-install", BrokenInstallHarness, replace=True)
    engine = LlamaCppEngine()
    try:
        loops = _loops_file(tmp_path, harness="broken-install", step_limit=2,
                            harness_options={"install_root": str(tmp_path / "agents")})
        worker, _ = _worker(model_dir, loops, LlamaRolloutServer(engine))
        out = asyncio.run(worker.generate_sequences(_batch([TASKS[1]])))
    finally:
        registry.unregister("broken-install")
    nt = out.non_tensor_batch
    # install_error on every try and "registry says no" in nt["error"][0]
    assert list(nt["exit_reason"]) == ["infra_error"]
    assert int(out.batch["response_mask"].sum()) == 0 and float(out.batch["rm_scores"].sum()) == 0.0
    assert int(out.batch["attention_mask"][0, PROMPT_LENGTH:].sum()) == 1
    assert list(nt["episode_failed"]) == [True]

    # The rollout server dies on every call of one episode (its prompts hold its task's file): that
    # episode's agent gets error answers and ends; the other episode is untouched; the batch completes.
    doomed = TASKS[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    server = LlamaRolloutServer(engine, fail_when=lambda ids: "stats.py" in tok.decode(ids))
    loops = _loops_file(tmp_path, step_limit=2, max_tokens=16,
                        harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND})
    worker, _ = _worker(model_dir, loops, server)
    try:
        out = asyncio.run(worker.generate_sequences(_batch([doomed, TASKS[1]])))
    finally:
        asyncio.run(engine.aclose())
    nt = out.non_tensor_batch
    assert nt["error"][0] and "rollout replica died" in nt["error"][0]
    assert float(out.batch["rm_scores"][0].sum()) == 0.0
    assert nt["error"][1] is None and int(out.batch["response_mask"][1].sum()) > 0

    # A row that names no task is a configuration error that lists the dataset's tasks.
    worker, _ = _worker(model_dir, _loops_file(tmp_path), LlamaRolloutServer(engine))
    with pytest.raises(UnknownTaskError) as info:
        asyncio.run(worker.generate_sequences(_batch(["no-such-task"])))
    assert "'no-such-task'" in str(info.value) and all(t in str(info.value) for t in TASKS)


def test_without_verl_installed_the_error_names_the_extra() -> None:
    code = ("import sys; sys.modules['verl'] = None\n"
            "from ares_gateway.trainers import MissingExtraError\n"
            "try:\n    import ares_gateway.trainers.verl\nexcept MissingExtraError as e:\n    "
            "print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert "ERR verl is not installed" in proc.stdout and "ares-gateway[verl]" in proc.stdout
