"""TRL's AsyncGRPO harness rollout drives ``AresSessionFactory`` sessions through real mini-swe-agent
episodes.

TRL's own rollout loop of the harness worker
(``trl.experimental.async_grpo.openenv_harness._HarnessRolloutLoop``,
built with the arguments ``HarnessRolloutWorker`` gives it) calls the factory with its training sampling
(OpenEnv's ``training_sampling``) and plays each rollout with its own ``_run_session``: OpenEnv's
``TrainableSession`` check, ``wait_for_completion``, ``fetch_training_trace`` (OpenEnv's strict
``TrainingTrace``), ``verify`` and ``close``, then TRL's reconciler (``_chain_to_sequences``) turns the trace
into the training rows the trainer gets. What cannot run here:

* TRL's vLLM server (GPU, NCCL weight transfer): the sessions' turns are sampled by the project's llama.cpp
  engine on CPU, the engine a ``VLLMEngine(url=<TRL's server>)`` would be in training.
* The worker process and its queues around the loop (``AsyncGRPOTrainer`` spawns it): ``_run_session`` is
  called from threads, as the loop's session pool does.
* SmolLM2's chat template is none TRL knows a response schema for: the tokenizer gets a content-only one
  (TRL parses responses only in its adapter mode, never in the loop-owning mode used here).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.trainers import UnknownTaskError
from harnesses import registry
from sandbox import janitor
from tests.helpers import BrokenInstallHarness
from tests.prereq import require
from tests.trainers.conftest import recorded_main_line, require_mini_install

pytestmark = pytest.mark.slow

TASK = "fix-median-bug"
# Every answer runs as a command; one that waits is cut after a few seconds.
MINI = {"action_regex": r"\A(.+)\Z", "command_timeout": 5}


def _openenv() -> Any:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        from trl.experimental.async_grpo import openenv_harness

        from ares_gateway.trainers import openenv
    except Exception as exc:
        require(False, f"openenv or TRL's async_grpo is not installed ({exc}): python3 -m pip install -e "
                       "'.[openenv]' && python3 -m pip install --no-deps 'openenv==0.10.0'")
    return openenv, openenv_harness


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The trainer's tokenizer: a transformers tokenizer over the gateway's own SmolLM2 tokenizer."""
    _openenv()
    from transformers import PreTrainedTokenizerFast

    from ares_gateway.tokens.tokenizer import TokenizerLoadError, default_model_path, load_tokenizer

    try:
        ours = load_tokenizer(default_model_path())
    except TokenizerLoadError as exc:
        require(False, str(exc))
    tok = PreTrainedTokenizerFast(tokenizer_object=ours._tok, eos_token=ours.eos_token,
                                  bos_token=ours.bos_token)
    tok.chat_template = ours.chat_template
    tok.response_schema = {"type": "object",
                           "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    return tok


def _loop(factory: Any, tokenizer: Any) -> Any:
    """TRL's harness rollout loop, as ``HarnessRolloutWorker`` builds it in its process (loop-owning mode)."""
    from datasets import Dataset
    from trl.experimental.async_grpo.openenv_harness import _HarnessRolloutLoop

    return _HarnessRolloutLoop(
        harness_session_factory=factory, model_name="smollm2-135m",
        dataset=Dataset.from_dict({"prompt": [TASK]}), reward_funcs=[], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=mp.Queue(),
        model_version_value=mp.Value("i", 0), heartbeat_value=mp.Value("d", 0.0),
        failed_event=mp.Event(), exception_info_queue=mp.Queue(), metrics_queue=mp.Queue(),
        num_generations=2, max_tokens=32, temperature=1.0,
    )


def _results(out: Path) -> dict[str, dict[str, Any]]:
    results = {}
    for f in out.rglob("results.json"):
        for ep in json.loads(f.read_text())["episodes"]:
            results[ep["session_id"]] = ep
    return results


def test_trl_harness_rollout_trains_the_recorded_samples_of_real_episodes(tmp_path: Path,
                                                                          tokenizer: Any) -> None:
    openenv, _ = _openenv()
    require_mini_install()
    from openenv.core.harness import TrainableSession

    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine()
    made: list[tuple[dict[str, Any], Any]] = []

    def factory(**kwargs: Any) -> Any:
        f = openenv.AresSessionFactory(
            "examples", engine=engine, max_tokens=32,
            episode=EpisodeConfig("mini-swe-agent", step_limit=3, harness_options=MINI, sandbox="local"),
            run=RunConfig(out=str(tmp_path / "episodes")), **kwargs,
        )
        made.append((kwargs, f))
        return f

    loop = _loop(factory, tokenizer)
    (kwargs, fac), = made
    assert kwargs["sampling"]["temperature"] == 1.0 and fac.temperature == 1.0 and fac.top_k == 0
    session = fac.create([{"role": "user", "content": TASK}])
    assert isinstance(session, TrainableSession)  # what TRL checks before the loop-owning path
    time.sleep(3)  # its sandbox is up
    session.close()  # stopped: its episode is cancelled and has ended, its sandbox removed
    assert janitor.live_sandboxes() == []
    try:
        with ThreadPoolExecutor(2) as pool:  # a group of two rollouts, as the loop's session pool runs them
            runs = list(
                pool.map(lambda _: loop._run_session([{"role": "user", "content": TASK}], 0), range(2)))
    finally:
        fac.close()
        import asyncio

        asyncio.run(engine.aclose())

    assert janitor.live_sandboxes() == []
    results = _results(tmp_path / "episodes")
    trained = 0
    for (completion, completion_ids, sequences, _calls, _fails, reward), metrics in runs:
        assert metrics is not None  # a scored rollout, not an unscorable one
        (row,) = sequences  # the turns extend each other: one training row
        assert metrics["tally"]["fork"] == 0 and metrics["tally"]["realign"] == 0
        # The rollout's row is the episode's main-line sample as the gateway recorded it.
        matches = []
        for sid, ep in results.items():
            rec = recorded_main_line(tmp_path / "episodes", sid)
            n = len(rec["tokens"]) - rec["response_length"]
            last = n + max(i for i, m in enumerate(rec["loss_mask"]) if m)
            if row.input_ids == rec["tokens"][:last + 1]:
                matches.append((ep, rec, n, last))
        (ep, rec, n, last), = matches
        assert row.completion_mask == [0] * n + rec["loss_mask"][:last + 1 - n]
        for i, m in enumerate(row.completion_mask):
            if m:
                assert row.old_log_probs[i] == pytest.approx(rec["logprobs"][i - n], abs=1e-6)
        assert sum(row.completion_mask) == sum(rec["loss_mask"]) == len(completion_ids)
        # The verifier's reward is the rollout's; TRL counted the episode's model calls as its turns.
        assert reward == pytest.approx(ep["reward"]) and metrics["turns"] == ep["turns"] >= 1
        assert completion and completion[-1]["role"] == "assistant"
        trained += metrics["turns"] >= 2 and 0 in row.completion_mask[n:]
    assert len(results) >= 2  # the two rollouts (and the session closed at once, where it got that far)
    assert trained >= 1  # tool output between the model's turns, context only


def test_failed_and_unknown_sessions(tmp_path: Path, tokenizer: Any) -> None:
    openenv, _ = _openenv()
    from accelerate import PartialState

    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    PartialState()  # TRL's loop logs through accelerate's logger, as in its worker process
    engine = LlamaCppEngine()
    registry.register("broken-install", BrokenInstallHarness, replace=True)
    fac = openenv.AresSessionFactory(
        "examples", engine=engine,
        episode=EpisodeConfig(
            "broken-install", step_limit=2, harness_options={"install_root": str(tmp_path / "agents")},
            sandbox="local",
        ),
    )
    try:
        # The session of a failed episode: an empty trace and reward 0 with its error (TRL trains nothing).
        session = fac.create(TASK)
        assert session.wait_for_completion() == 1
        assert session.fetch_training_trace().turns == []
        verdict = session.verify([])
        assert verdict.env_reward == 0.0 and verdict.done
        # Retried on fresh sandboxes (an infrastructure failure), then infra_error with its cause.
        assert verdict.metrics[
            "exit_reason"] == "infra_error" and "install_error on every one of 3 tries" in verdict.metrics[
                "error"]
        assert "registry says no" in verdict.metrics["error"]
        assert verdict.metrics["episode_failed"] is True
        session.close()
        # Driven by TRL: a scored rollout with reward 0 and no training row.
        loop = _loop(lambda **kw: fac, tokenizer)
        (_completion, ids, sequences, _c, _f, reward), metrics = loop._run_session(TASK, 0)
        assert reward == 0.0 and sequences == [] and ids == [] and metrics is not None
        # A prompt that names no task: create refuses it, listing the tasks; TRL scores it unscorable.
        with pytest.raises(UnknownTaskError) as info:
            fac.create("no-such-task")
        assert "'no-such-task'" in str(info.value) and TASK in str(info.value)
        assert loop._run_session("no-such-task", 0) == (loop._EMPTY_ROLLOUT, None)
        # Tools are the agent's own, in its sandbox.
        session = fac.create(TASK)
        assert session.call_tool("bash", {}).error and session.list_tools() == []
        session.close()
    finally:
        registry.unregister("broken-install")
        fac.close()


def test_without_openenv_installed_the_error_names_the_extra() -> None:
    code = ("import sys; sys.modules['openenv'] = None\n"
            "from ares_gateway.trainers import MissingExtraError\n"
            "try:\n    import ares_gateway.trainers.openenv\nexcept MissingExtraError as e:\n    "
            "print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert "ERR openenv is not installed" in proc.stdout and "ares-gateway[openenv]" in proc.stdout
    assert "--no-deps 'openenv==0.10.0'" in proc.stdout
