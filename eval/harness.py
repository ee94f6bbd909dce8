"""Running lm-eval tasks: the task manager that knows gdn2's own task folder, and evaluation of a live model.

lm-eval has no registry of task folders: gdn2's offline tasks (``eval/tasks``, package data) are found
through the ``include_path`` of a TaskManager. :func:`make_task_manager` makes one with that folder on
its path; pass it to ``lm_eval.simple_evaluate(..., task_manager=...)``. lm-eval's own command line
takes the folder as ``--include_path`` (``python -m gdn2 eval --print_include_path`` prints it).
Nothing in lm-eval is patched.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import lm_eval
from lm_eval.tasks import TaskManager

from gdn2.eval import LOCAL_TASKS
from gdn2.eval.lm import GDN2LM
from gdn2.eval.results import summarize
from gdn2.model import GPT
from gdn2.tokenizer import Tokenizer

__all__ = ["LOCAL_TASKS", "make_task_manager", "evaluate_model", "quiet_local_tasks", "include_paths"]


def include_paths(include_path: Any) -> list[str]:
    """``include_path`` (None, a folder, or a list of them) with gdn2's task folder added."""
    paths = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) \
        else [include_path]
    paths = [str(p) for p in paths]
    if not any(Path(p).resolve() == LOCAL_TASKS for p in paths):
        paths.append(str(LOCAL_TASKS))
    return paths


class _QuietLocalTasks(logging.Filter):
    """Our tasks load their data through ``custom_dataset``; lm-eval then advises passing custom kwargs,
    which these tasks do not take: drop that advice for them only."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("gdn2_") and "Custom kwargs can be passed" in message)


@contextmanager
def quiet_local_tasks() -> Iterator[None]:
    """Inside the block, lm-eval's advice about custom kwargs is not logged for gdn2's tasks."""
    logger, quiet = logging.getLogger("lm_eval.api.task"), _QuietLocalTasks()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def make_task_manager(tasks: Sequence[str], include_path: Union[str, os.PathLike, Sequence, None] = None,
                      **kwargs: Any) -> TaskManager:
    """A TaskManager that knows ``tasks``, with gdn2's task folder (and ``include_path``: folders of
    extra task YAMLs) on its path: only the local folders when they define them all (indexing lm-eval's
    own task library takes half a minute), else the library too. ``kwargs`` go to TaskManager."""
    paths = include_paths(include_path)
    local = TaskManager(include_path=paths, include_defaults=False, **kwargs)
    if all(t in local.all_tasks for t in tasks):
        return local
    return TaskManager(include_path=paths, **kwargs)


def evaluate_model(model: GPT, tokenizer: Union[Tokenizer, str, os.PathLike], tasks: Union[str, Sequence[str]],
                   limit: Optional[Union[int, float]] = None,
                   include_path: Union[str, os.PathLike, None] = None, batch_size: int = 8,
                   max_length: Optional[int] = None, num_fewshot: Optional[int] = None,
                   bootstrap_iters: int = 0, return_raw: bool = False) -> dict[str, Any]:
    """Evaluate a live model on lm-eval tasks; returns ``{"task/metric": value, ..., "avg": ...}``.

    model: a plain (unwrapped, unsharded) GPT on its device; it is put in eval mode and given back in
    the mode it came in. Under an initialised process group every rank must call this (requests are
    split across ranks) and every rank receives the same dictionary. ``limit``: examples per task
    (int) or fraction (float). ``bootstrap_iters=0`` skips bootstrap standard errors (fast).
    ``return_raw``: also return lm-eval's full results under ``"raw"``.
    """
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    if not tasks:
        raise ValueError("tasks: give at least one task name")
    lm = GDN2LM(model=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    manager = make_task_manager(tasks, include_path, metadata={"tokenizer": str(lm.tokenizer.path)})
    was_training = model.training
    model.eval()
    try:
        with quiet_local_tasks():
            raw = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot,
                                          task_manager=manager, log_samples=False, bootstrap_iters=bootstrap_iters)
    finally:
        model.train(was_training)
        lm.release()
    summary: dict[str, Any] = summarize(raw) if raw is not None else {}
    if return_raw and raw is not None:
        summary["raw"] = raw
    if lm.world_size > 1:
        import torch.distributed as dist

        box = [summary]
        dist.broadcast_object_list(box, src=0)
        summary = box[0]
    return summary
