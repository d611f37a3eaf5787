"""SkyRL's trainer takes real mini-swe-agent episodes from ``AresGenerator``, as a training step does.

The step's front half is SkyRL's own code: ``prepare_generator_input`` builds the batch from dataset rows
with the vLLM sampling parameters of SkyRL's default config, ``RayPPOTrainer.generate`` calls the
generator and runs ``validate_generator_output`` on what it returns, ``postprocess_generator_output``
turns the rewards into per-token rewards and ``convert_to_training_input`` pads the batch into the
tensors the policy trains on. What cannot run here:

* SkyRL's inference engines (vLLM on a GPU): the generator's ``inference_engine_client`` is a subclass of
  SkyRL's ``InferenceEngineInterface`` that treats ``InferenceEngineInput`` as SkyRL's remote client does
  (``logprobs`` given: one logprob per sampled token; ``top_k`` -1: off) and samples SmolLM2 on the
  project's llama.cpp engine.
* ``RayPPOTrainer.__init__`` (it builds dataloaders, a Ray metrics scraper and reroutes the process's
  logging through loguru): the trainer is made with ``__new__`` and given the attributes those three
  methods read (``cfg``, ``generator``, ``tokenizer``, ``all_metrics``, ``all_timings``, and as
  ``dispatch`` one data-parallel policy worker, where SkyRL's ``WorkerDispatch`` asks its Ray actors).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.engines.base import Sampling
from ares_gateway.trainers import TrainerError, UnknownTaskError
from harnesses import registry
from tests.helpers import BrokenInstallHarness
from tests.prereq import require
from tests.trainers.conftest import recorded_main_line, require_mini_install

pytestmark = pytest.mark.slow

EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"
# Every answer runs as a command: one that waits (on input, on a server) is cut after a few seconds.
MINI = {"action_regex": EVERY_ANSWER_IS_A_COMMAND, "command_timeout": 5}
TASKS = ["fix-median-bug", "write-greeting-file"]
MAX_TOKENS = 32


def _skyrl() -> Any:
    try:
        from ares_gateway.trainers import skyrl
    except Exception as exc:
        require(False, f"skyrl is not installed ({exc}): python3 -m pip install --no-deps 'skyrl==0.3.0' "
                       "&& python3 -m pip install -e '.[skyrl]'")
    return skyrl


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The trainer's tokenizer as SkyRL loads it (``skyrl.utils.tok.get_tokenizer``: pad = eos where the
    model has no pad token), from a Hugging Face folder holding the gateway's own SmolLM2 tokenizer."""
    _skyrl()
    from skyrl.utils.tok import get_tokenizer
    from transformers import PreTrainedTokenizerFast

    from ares_gateway.tokens.tokenizer import TokenizerLoadError, default_model_path, load_tokenizer

    try:
        ours = load_tokenizer(default_model_path())
    except TokenizerLoadError as exc:
        require(False, str(exc))
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=ours._tok, eos_token=ours.eos_token,
                            bos_token=ours.bos_token).save_pretrained(folder)
    return get_tokenizer(str(folder))


def _client(engine: Any, *, fail_when: Any = None) -> Any:
    from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface

    class LlamaInferenceClient(InferenceEngineInterface):  # type: ignore[misc]
        """SkyRL's client interface, sampling on llama.cpp as SkyRL's remote client reads vLLM's answer."""

        def __init__(self) -> None:
            self.requests: list[dict[str, Any]] = []
            self.finished: list[str] = []

        @property
        def model_name(self) -> str:
            return "smollm2-135m"

        async def generate(self, input_batch: Any, model: str | None = None) -> Any:
            self.requests.append(input_batch)
            (ids,) = input_batch["prompt_token_ids"]
            if fail_when is not None and fail_when(ids):
                raise RuntimeError("the inference engine died (injected)")
            sp = dict(input_batch["sampling_params"])
            r = await engine.generate(ids, Sampling(
                max_tokens=int(sp["max_tokens"]), temperature=float(sp["temperature"]),
                top_p=float(sp["top_p"]), top_k=max(0, int(sp["top_k"])),
                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ))
            return {"responses": [""], "response_ids": [r.output_ids], "stop_reasons": [r.finish_reason],
                    "response_logprobs": [r.logprobs] if sp.get("logprobs") is not None else None,
                    "prompt_logprobs": None, "rollout_expert_indices": None}

        async def finish_session(self, session_id: str) -> None:
            self.finished.append(session_id)

        def _absent(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("not served by the CPU stand-in")

        get_endpoint_url = chat_completion = render_chat_completion = completion = _absent
        get_world_size = init_weight_update_communicator = update_named_weights = _absent
        pause_generation = resume_generation = reset_prefix_cache = sleep = wake_up = teardown = _absent

    return LlamaInferenceClient()


def _trainer(generator: Any, tokenizer: Any, *, n: int, prompts: int) -> Any:
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.trainer import RayPPOTrainer

    cfg = SkyRLTrainConfig()
    cfg.generator.n_samples_per_prompt = n
    cfg.generator.sampling_params.max_generate_length = MAX_TOKENS
    cfg.trainer.train_batch_size = cfg.trainer.policy_mini_batch_size = prompts
    cfg.environment.env_class = "ares_gateway"
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.cfg, trainer.generator, trainer.tokenizer = cfg, generator, tokenizer
    trainer.all_metrics, trainer.all_timings = {}, {}
    # The policy workers' data-parallel size (SkyRL's WorkerDispatch over Ray actors): one worker, no padding.
    trainer.dispatch = SimpleNamespace(get_lcm_dp_size=lambda: 1)
    return trainer


def _input(trainer: Any, tasks: Sequence[str]) -> tuple[Any, list[str]]:
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.train.generators.utils import prepare_generator_input

    rows = [{"prompt": [{"role": "user", "content": t}], "env_class": None, "env_extras": {"task": t},
             "uid": f"row-{i}"} for i, t in enumerate(tasks)]
    cfg = trainer.cfg
    return prepare_generator_input(rows, cfg.generator.n_samples_per_prompt,
                                   get_sampling_params_for_backend("vllm", cfg.generator.sampling_params),
                                   cfg.environment.env_class, "train", 3)


def test_skyrl_training_step_takes_real_episodes_as_the_recorded_samples(tmp_path: Path,
                                                                         tokenizer: Any) -> None:
    skyrl = _skyrl()
    require_mini_install()
    from skyrl.train.generators.base import GeneratorInterface, TrajectoryID

    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine()
    client = _client(engine)
    generator = skyrl.AresGenerator(
        "examples", inference_engine_client=client, trainer_tokenizer=tokenizer,
        episode=EpisodeConfig("mini-swe-agent", sandbox="local", step_limit=3, harness_options=MINI),
        run=RunConfig(out=str(tmp_path / "episodes")),
    )
    assert isinstance(generator, GeneratorInterface)
    trainer = _trainer(generator, tokenizer, n=2, prompts=1)
    gen_input, uids = _input(trainer, [TASKS[0]])
    try:
        out = asyncio.run(trainer.generate(gen_input))  # the generator, then validate_generator_output
    finally:
        asyncio.run(engine.aclose())

    n = len(gen_input["prompts"])
    assert n == 2 and uids == ["row-0", "row-0"]
    for key in ("prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs", "rewards",
                "stop_reasons", "trajectory_generation_times", "env_metrics"):
        assert isinstance(out[key], list) and len(out[key]) == n, key
    assert out["trajectory_ids"] == gen_input["trajectory_ids"]
    assert all(isinstance(t, TrajectoryID) for t in out["trajectory_ids"])
    assert all(isinstance(r, float) for r in out["rewards"])  # response-level rewards
    assert trainer.all_metrics["ares/episodes"] == 2 and "generate/avg_num_tokens" in trainer.all_metrics
    facts = out["env_metrics"]
    assert [f["task"] for f in facts] == [TASKS[0], TASKS[0]]
    sessions = [f["session_id"] for f in facts]
    assert len(set(sessions)) == 2 and all(sessions)

    results = {}
    for f in (tmp_path / "episodes").rglob("results.json"):
        for ep in json.loads(f.read_text())["episodes"]:
            results[ep["session_id"]] = ep
    assert set(results) == set(sessions)  # every entry is a real episode the gateway ran
    multi_turn = 0
    for i, sid in enumerate(sessions):
        rec = recorded_main_line(tmp_path / "episodes", sid)
        cut = len(rec["tokens"]) - rec["response_length"]
        # Exactly the recorded sample: ids, loss mask, the engine's logprobs.
        assert out["prompt_token_ids"][i] == rec["tokens"][:cut]
        assert out["response_ids"][i] == rec["tokens"][cut:]
        assert out["loss_masks"][i] == rec["loss_mask"]
        assert out["rollout_logprobs"][i] == pytest.approx(rec["logprobs"], abs=1e-6)
        assert all(type(t) is int for t in out["response_ids"][i] + out["prompt_token_ids"][i])
        assert out["rewards"][i] == pytest.approx(results[sid]["reward"])
        ended = results[sid]["exit_reason"]
        assert out["stop_reasons"][i] == ("length" if results[sid]["truncated"] else
                                          "stop" if ended == "completed" else ended)
        assert out["trajectory_generation_times"][i] == pytest.approx(results[sid]["duration"], rel=0.01)
        # Every turn went out under the episode's session, with SkyRL's sampling and the gateway's stop and
        # cap.
        # (a request still waiting when the time limit ended the episode is no turn)
        turns = [r for r in client.requests if r["session_ids"] == [sid]]
        late = 1 if ended == "time_limit" else 0
        assert results[sid]["turns"] <= len(turns) <= results[sid]["turns"] + late and len(turns) >= 1
        multi_turn += 0 in rec["loss_mask"] and 1 in rec["loss_mask"]
    assert multi_turn >= 1  # tool output between the model's turns, masked out
    assert len(client.requests) == sum(len([r for r in client.requests if r["session_ids"] == [s]])
                                       for s in sessions)
    for r in client.requests:
        sp = r["sampling_params"]
        assert sp["temperature"] == 1.0 and sp["top_k"] == -1 and sp["logprobs"] == 0
        assert sp["max_tokens"] == MAX_TOKENS and sp["stop_token_ids"] and "stop" not in sp
        assert sp["min_p"] == 0.0 and sp["skip_special_tokens"] is True  # SkyRL's own keys, passed through
    assert sorted(client.finished) == sorted(sessions)  # each session released to SkyRL's router

    # SkyRL's post-processing: the reward on each response's last token.
    post, post_uids = trainer.postprocess_generator_output(out, uids)
    assert post_uids == uids
    for i, rewards in enumerate(post["rewards"]):
        assert len(rewards) == len(out["response_ids"][i]) and rewards[-1] == pytest.approx(
            results[sessions[i]]["reward"])
        assert not any(rewards[:-1])

    # SkyRL's padded training batch holds the episodes right-aligned, as the policy's loss reads it.
    batch = trainer.convert_to_training_input(post, post_uids)
    width = max(len(r) for r in out["response_ids"])
    assert batch["loss_mask"].shape == batch["rollout_logprobs"].shape == batch["response_mask"].shape == (
        2, width)
    assert batch["sequences"].shape == batch["attention_mask"].shape
    for i in range(2):
        length = len(out["response_ids"][i])
        seq = batch["sequences"][i][batch["attention_mask"][i].bool()].tolist()
        assert seq == out["prompt_token_ids"][i] + out["response_ids"][i]
        assert batch["loss_mask"][i, width - length:].tolist() == [float(m) for m in out["loss_masks"][i]]
        assert int(batch["loss_mask"][i, :width - length].sum()) == 0
        assert batch["rollout_logprobs"][i, width
                                         - length:].tolist() == pytest.approx(out["rollout_logprobs"][i],
                                                                                         abs=1e-6)
        assert int(batch["response_mask"][i].sum()) == length


def test_failed_episodes_are_reward_0_entries_and_the_step_goes_on(tmp_path: Path, tokenizer: Any) -> None:
    skyrl = _skyrl()
    require_mini_install()
    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine()
    # A harness that cannot be installed: no LLM call, a masked one-token response, reward 0, its error.
    registry.register("broken-install", BrokenInstallHarness, replace=True)
    try:
        generator = skyrl.AresGenerator(
            "examples", inference_engine_client=_client(engine),
            episode=EpisodeConfig(
                "broken-install", step_limit=2, harness_options={"install_root": str(tmp_path / "agents")},
                sandbox="local",
            ),
        )
        trainer = _trainer(generator, tokenizer, n=1, prompts=1)
        out = asyncio.run(trainer.generate(_input(trainer, [TASKS[1]])[0]))
    finally:
        registry.unregister("broken-install")
    assert out["response_ids"] == [[tokenizer.eos_token_id]] and out["loss_masks"] == [[0]]
    assert out["rollout_logprobs"] == [[0.0]] and out["rewards"] == [0.0]
    assert out["stop_reasons"] == ["infra_error"]  # install_error on every try
    assert out["env_metrics"][0]["episode_failed"] is True and "registry says no" in out["env_metrics"][0][
        "error"]
    assert trainer.all_metrics["ares/failed"] == 1

    # The inference engine dies on every call of one episode (its prompts hold its task's file): that
    # episode's agent gets error answers and ends with reward 0; the other episode is untouched.
    client = _client(engine, fail_when=lambda ids: "stats.py" in tokenizer.decode(ids))
    generator = skyrl.AresGenerator(
        "examples", inference_engine_client=client,
        episode=EpisodeConfig("mini-swe-agent", step_limit=2, harness_options=MINI, sandbox="local"),
    )
    trainer = _trainer(generator, tokenizer, n=1, prompts=2)
    try:
        out = asyncio.run(trainer.generate(_input(trainer, TASKS)[0]))
    finally:
        asyncio.run(engine.aclose())
    doomed, fine = out["env_metrics"]
    assert doomed["error"] and "inference engine died" in doomed["error"] and out["rewards"][0] == 0.0
    assert fine["error"] is None and sum(out["loss_masks"][1]) > 0

    # A prompt that names no task is a configuration error that lists the dataset's tasks.
    with pytest.raises(UnknownTaskError) as info:
        asyncio.run(generator.generate(_input(trainer, ["no-such-task", TASKS[0]])[0]))
    assert "'no-such-task'" in str(info.value) and all(t in str(info.value) for t in TASKS)
    with pytest.raises(TrainerError, match="exactly one"):
        skyrl.AresGenerator("examples")

    # A trainer tokenizer with other ids than the gateway's is refused before any episode starts.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from ares_gateway.trainers.trl import TokenizerMismatchError

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    client = _client(engine)
    generator = skyrl.AresGenerator("examples", inference_engine_client=client, trainer_tokenizer=other)
    with pytest.raises(TokenizerMismatchError, match="tokenizer="):
        asyncio.run(generator.generate(_input(trainer, [TASKS[0], TASKS[1]])[0]))
    assert client.requests == []


def test_without_skyrl_installed_the_error_names_the_extra() -> None:
    code = ("import sys; sys.modules['skyrl'] = None\n"
            "from ares_gateway.trainers import MissingExtraError\n"
            "try:\n    import ares_gateway.trainers.skyrl\nexcept MissingExtraError as e:\n    "
            "print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert "ERR skyrl is not installed" in proc.stdout and "ares-gateway[skyrl]" in proc.stdout
    assert "--no-deps 'skyrl==0.3.0'" in proc.stdout
