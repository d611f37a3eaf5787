"""Trainer adapters: real agents' episodes as a trainer's rollouts, one module per trainer.

* :mod:`ares_gateway.trainers.trl` — TRL's ``GRPOTrainer(rollout_func=...)``:
:func:`~ares_gateway.trainers.trl.rollout_func`
  and :func:`~ares_gateway.trainers.trl.reward_from_episode` (extra ``.[trl]``).
* :mod:`ares_gateway.trainers.verl` — verl's agent loop: :class:`~ares_gateway.trainers.verl.AresAgentLoop`,
  registered as ``ares_gateway`` when imported (extra ``.[verl]``).
* :mod:`ares_gateway.trainers.skyrl` — SkyRL's generator: :class:`~ares_gateway.trainers.skyrl.AresGenerator`
  (extra ``.[skyrl]``, then skyrl itself with ``--no-deps``).

Each imports its trainer's package only when used: the base install needs no torch, trl or verl, and
a missing one is a :class:`MissingExtraError` naming the extra. What they share (tasks named by
prompts, episodes played, the main-line sample of each: the harness CLI's own conversation) is in
:mod:`ares_gateway.trainers.episodes`;
see docs/training.md.
"""

from ares_gateway.trainers.episodes import (
    EpisodeSample,
    MissingExtraError,
    TrainerEntry,
    TrainerError,
    UnknownTaskError,
    exclude_infra_errors,
    foreign_count,
    main_sample,
    play_episodes,
    resolve_dataset,
    task_name_of,
    trainer_entry,
)

__all__ = [
    "EpisodeSample",
    "MissingExtraError",
    "TrainerEntry",
    "TrainerError",
    "UnknownTaskError",
    "exclude_infra_errors",
    "foreign_count",
    "main_sample",
    "play_episodes",
    "resolve_dataset",
    "task_name_of",
    "trainer_entry",
]
