"""Weights & Biases as a Fabric logger, over the W&B run's own API."""

from __future__ import annotations

from typing import Any, Optional

from gdn2.train.fabric_api import Logger


class WandbLogger(Logger):
    """A Fabric logger over one started W&B run: metrics by step, the run finished at the end."""

    def __init__(self, run: Any) -> None:
        super().__init__()
        self.run = run

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def version(self) -> str:
        return self.run.id

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.run.log(metrics, step=step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def finalize(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "success" else 1)
