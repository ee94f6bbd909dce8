"""The trainer's checkpoint schedule: when to save, and what a save holds (see :mod:`gdn2.checkpoint`
for the format)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from gdn2.checkpoint.state import rng_state, save_checkpoint
from gdn2.train.fabric_api import unwrap
from gdn2.train.schedule import due
from gdn2.train.setup import tokenizer_sha256

log = logging.getLogger("gdn2.train")


class Checkpointer:
    """The run's checkpoints: saves on the ``checkpoint`` section's schedule (never inside a run of
    skipped steps, which would rotate out older good ones), and on demand (a signal, a stop)."""

    def __init__(self, fabric: Any, recipe: Any, model: Any, optimizer: Any, state: Any, loader: Any,
                 max_steps: int, last: Optional[Path] = None, train_log: Any = None) -> None:
        self.fabric, self.recipe, self.model, self.optimizer = fabric, recipe, model, optimizer
        self.state, self.loader, self.max_steps, self.train_log = state, loader, max_steps, train_log
        self.last = last  # the newest checkpoint of this run (the one resumed from, at first)
        self.tokenizer_sha256 = tokenizer_sha256(recipe)

    def save(self) -> Path:
        c = self.recipe.checkpoint
        counters = self.state.state_dict()
        if self.train_log is not None:  # the open logging interval, continued by a resumed run
            counters["train_log"] = self.train_log.state_dict()
        trainer = {"model": unwrap(self.model), "optimizer": unwrap(self.optimizer), "trainer": counters}
        started = time.perf_counter()
        # a full disk is one error on every rank that names the folder, its free space and the last good
        # checkpoint (CheckpointWriteError)
        self.last = save_checkpoint(
            self.fabric, self.recipe.checkpoint_dir, self.state.step, trainer,
            rank_state={"data": self.loader.state_dict(), "rng": rng_state(), "rank": self.fabric.global_rank},
            config_yaml=self.recipe.to_yaml(),
            info={"tokens": self.state.tokens, "config_name": self.recipe.config_name,
                  "tokenizer_sha256": self.tokenizer_sha256}, keep_last=c.keep_last,
            sharded=c.state_dict_type == "sharded")
        if self.fabric.global_rank == 0:
            log.info("saved checkpoint %s in %.1f s", self.last, time.perf_counter() - started)
        return self.last

    def maybe_save(self, step: int, end: bool = False) -> Optional[Path]:
        c = self.recipe.checkpoint
        if not due(c.interval, c.at_end, step, self.max_steps, end):
            return None
        if not end and self.state.consecutive_nonfinite:
            return None
        return self.save()
