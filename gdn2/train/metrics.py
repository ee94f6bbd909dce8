"""Training metrics: the devices' dense bf16 peaks for MFU; the metrics log (JSONL, TensorBoard, CSV,
Weights & Biases; rank 0); the per-interval training record."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from gdn2.files import write_text_atomic

# Dense (no structured sparsity) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s per
# device. First match wins, so more specific names come first. Lightning's own table lists the
# sparse figures for Hopper, which would halve every MFU.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    (r"\bGH200\b", 989e12),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bH200\b", 989e12),  # SXM
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bH800\b.*\bPCIe\b", 756e12),
    (r"\bH800\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bGB200\b", 2500e12),
    (r"\bB200\b", 2250e12),
    (r"\bB100\b", 1750e12),
    (r"\bA100\b", 312e12),  # SXM and PCIe
    (r"\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
    (r"\bRTX 4090\b", 165e12),
    (r"\bMI300X\b", 1307e12),
]


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of the device called ``device_name`` (``torch.cuda.get_device_name``),
    or None when the device is not in :data:`PEAK_BF16_FLOPS`."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


def model_flops_utilization(flops_per_token: float, tokens_per_second_per_device: float,
                            peak_flops: Optional[float]) -> Optional[float]:
    """Fraction of the device peak the model's training FLOPs reach; None without a known peak."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second_per_device / peak_flops


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a null says "not a number" to every reader
    return value


class MetricsLog:
    """Metrics sinks of one run, active on rank 0 only: ``metrics.jsonl`` (every record, as written),
    and through Fabric loggers TensorBoard (``tensorboard/``), CSV (``csv/metrics.csv``; both Fabric's
    own) and Weights & Biases (``wandb/``, ``gdn2.train.wandb_logger``; ``offline`` mode needs no
    network, and ``wandb sync`` uploads it later).

    On resume from step ``S``, records after ``S`` (written by the run that crashed after its last
    checkpoint) are dropped from the JSONL, CSV and TensorBoard logs, so each step appears once; the
    W&B run is continued under the id kept in ``wandb/run_id``.
    """

    def __init__(self, out_dir: str | os.PathLike, enabled: bool, jsonl: bool = True, tensorboard: bool = True,
                 resume_step: Optional[int] = None, csv: bool = False, wandb: bool = False,
                 wandb_project: str = "gdn2", wandb_mode: str = "online", run_name: Optional[str] = None,
                 config: Optional[dict[str, Any]] = None) -> None:
        self.enabled = enabled
        self.jsonl_path: Optional[Path] = None
        self._file = None
        self.loggers: list[Any] = []
        if not enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self.jsonl_path = out / "metrics.jsonl"
            if resume_step is not None and self.jsonl_path.exists():
                _truncate_jsonl_after(self.jsonl_path, resume_step)
            elif resume_step is None and self.jsonl_path.exists():
                self.jsonl_path.unlink()  # a fresh run in a used folder starts a fresh log
            self._file = open(self.jsonl_path, "a", buffering=1)
        if tensorboard:
            from gdn2.train.fabric_api import TensorBoardLogger

            purge = resume_step + 1 if resume_step is not None else None
            self.loggers.append(TensorBoardLogger(root_dir=str(out), name="", version="tensorboard",
                                                  default_hp_metric=False, purge_step=purge))
        if csv:
            self.loggers.append(_csv_logger(out, resume_step))
        if wandb:
            self.loggers.append(_wandb_logger(out, wandb_project, wandb_mode, run_name or out.name,
                                              resume_step is not None, config))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Write one record: ``{"kind", "step", **metrics}``; numeric values also go to the loggers, named
        ``<kind>/<key>`` (keys that hold a ``/`` already as they are)."""
        if not self.enabled:
            return
        if self._file is not None:
            record = {"kind": kind, "step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
            self._file.write(json.dumps(record) + "\n")
        numbers = {key if "/" in key else f"{kind}/{key}": float(value) for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None}
        if numbers:
            for logger in self.loggers:
                logger.log_metrics(numbers, step=step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        for logger in self.loggers:
            logger.save()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for logger in self.loggers:
            logger.finalize("success")
        self.loggers = []


def _wandb_logger(out: Path, project: str, mode: str, name: str, resuming: bool, config: Optional[dict]):
    """A Weights & Biases logger whose files land in ``out/wandb`` (``offline-run-*``, ``run_id``); a resumed
    run continues the W&B run it started."""
    try:
        import wandb
    except ImportError:
        raise ValueError("logging.wandb: the wandb package is not installed (pip install wandb)") from None
    folder = out / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    if resuming and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        import uuid

        run_id = uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
    # started now: a bad setting fails before training, not at the first log
    # W&B writes into a "wandb" folder inside the dir it is given: the run folder, so that is out/wandb
    run = wandb.init(project=project, name=name, dir=str(out), id=run_id, mode=mode, resume="allow",
                     config=config)
    from gdn2.train.wandb_logger import WandbLogger

    return WandbLogger(run)


def _csv_logger(out: Path, resume_step: Optional[int]):
    """Fabric's CSV logger on ``out/csv/metrics.csv``; a resumed run keeps the rows up to ``resume_step``,
    a fresh one starts an empty table.

    The logger's writer deletes the table it finds when it starts, so the rows to keep are read first
    and written back through the writer (values as floats, as :meth:`MetricsLog.log` gave them)."""
    import csv
    import warnings

    from gdn2.train.fabric_api import CSVLogger

    table = out / "csv" / "metrics.csv"
    kept: list[tuple[int, dict[str, float]]] = []
    if resume_step is not None and table.exists():
        with open(table, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("step") in (None, "") or int(float(row["step"])) > resume_step:
                    continue
                values = {k: float(v) for k, v in row.items() if k != "step" and k is not None and v not in (None, "")}
                kept.append((int(float(row["step"])), values))
    logger = CSVLogger(root_dir=str(out), name="", version="csv", flush_logs_every_n_steps=1)
    with warnings.catch_warnings():
        # its "previous log files will be deleted" is answered by the rows written back below
        warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
        writer = logger.experiment
    for step, values in kept:
        writer.log_metrics(values, step)
    logger.save()
    return logger


def _truncate_jsonl_after(path: Path, step: int) -> None:
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if record.get("step", 0) <= step:
                kept.append(json.dumps(record))
    write_text_atomic(path, "".join(k + "\n" for k in kept))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class TrainLog:
    """Training metrics of the last ``logging.interval`` steps: loss (steps not skipped), tokens/s per
    device, MFU, memory. Every interval (and at the last step) one record goes to the metrics log,
    to the progress bar, and, without a bar (a log file under SLURM), one console line."""

    def __init__(self, metrics: MetricsLog, interval: int, max_steps: int, first_step: int, world_size: int,
                 flops_per_token: float, peak_flops: Optional[float], device: Any, bar: Any, console: bool) -> None:
        import time

        self.metrics, self.interval, self.max_steps, self.world_size = metrics, interval, max_steps, world_size
        self.flops_per_token, self.peak_flops, self.device, self.bar, self.console = (
            flops_per_token, peak_flops, device, bar, console)
        self.first_step, self.started = first_step, time.time()
        self._reset()

    def _reset(self) -> None:
        self.loss, self.steps, self.seconds, self.tokens = 0.0, 0, 0.0, 0

    def state_dict(self) -> dict[str, float]:
        """The open interval's sums (saved with a checkpoint, so that the first record after a resume
        covers the whole interval, as in an uninterrupted run)."""
        return {"loss": self.loss, "steps": self.steps, "seconds": self.seconds, "tokens": self.tokens}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.loss, self.steps = float(d["loss"]), int(d["steps"])
        self.seconds, self.tokens = float(d["seconds"]), int(d["tokens"])

    def add(self, loss: float, skipped: bool, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens
        if not skipped:
            self.loss += loss
            self.steps += 1

    def maybe_log(self, step: int, total_tokens: int, lr: float, grad_norm: float, skipped_steps: int) -> None:
        import time

        import torch

        if step % self.interval and step != self.max_steps:
            return
        tps = self.tokens / max(self.seconds, 1e-9) / self.world_size
        loss = self.loss / self.steps if self.steps else float("nan")
        record: dict[str, Any] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)) if self.steps else float("nan"),
                                  "lr": lr, "grad_norm": grad_norm, "tokens": total_tokens,
                                  "tokens_per_sec_per_device": tps, "skipped_steps": skipped_steps,
                                  "step_time": self.seconds / max(1, self.interval)}
        mfu = model_flops_utilization(self.flops_per_token, tps, self.peak_flops)
        if mfu is not None:
            record["mfu"] = mfu
        if self.device.type == "cuda":
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.metrics.log(step, record)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
        if self.console:
            import logging

            per_step = (time.time() - self.started) / max(step - self.first_step, 1)
            logging.getLogger("gdn2.train").info(
                "step %d/%d loss %.4f lr %.3e grad norm %.3f %s tokens/s/device%s, ETA %s", step, self.max_steps,
                loss, lr, grad_norm, f"{tps:,.0f}", f" MFU {mfu:.1%}" if mfu is not None else "",
                format_seconds(per_step * (self.max_steps - step)))
        self._reset()
