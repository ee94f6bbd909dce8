"""``train.profile_steps``: a torch.profiler trace of a few optimizer steps, readable in TensorBoard's
profiler and in Perfetto (``ui.perfetto.dev``), written to ``<run>/profile/``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("gdn2.train")


def parse_steps(spec: Optional[str]) -> Optional[tuple[int, int]]:
    """``"10-12"`` -> (10, 12), ``"7"`` -> (7, 7); None -> None. ValueError naming the key otherwise."""
    if spec is None or str(spec).strip() == "":
        return None
    first, _, last = str(spec).partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"train.profile_steps: expected 'N' or 'A-B' (optimizer steps), got {spec!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"train.profile_steps: expected 1 <= A <= B, got {spec!r}")
    return a, b


class StepProfiler:
    """Records optimizer steps ``first..last`` (1-based, as logged) on this rank, then writes one
    Chrome-trace JSON per rank: ``profile/steps-<first>-<last>.rank<r>.pt.trace.json``."""

    def __init__(self, spec: Optional[str], out_dir: Path, rank: int) -> None:
        self.steps = parse_steps(spec)
        self.out_dir, self.rank = Path(out_dir) / "profile", rank
        self._profiler: Optional[torch.profiler.profile] = None
        self.trace: Optional[Path] = None

    def before_step(self, step: int) -> None:
        """``step``: the optimizer step about to run."""
        if self.steps is None or self._profiler is not None or step != self.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def after_step(self, step: int, end: bool = False) -> None:
        """``step``: the optimizer step just done; ``end``: the run stops here."""
        if self._profiler is None or (step < self.steps[1] and not end):
            return
        self._profiler.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        first, last = self.steps[0], min(step, self.steps[1])
        self.trace = self.out_dir / f"steps-{first}-{last}.rank{self.rank}.pt.trace.json"
        self._profiler.export_chrome_trace(str(self.trace))
        self._profiler = None
        log.info("profile of steps %d-%d: %s (TensorBoard profiler or ui.perfetto.dev)", first, last, self.trace)
