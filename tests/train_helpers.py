"""Helpers for the trainer tests: a small learnable corpus, a micro model config, running the CLI.

The corpus is documents built from a fixed set of short phrases, so a two-layer model's loss falls
within a few dozen steps; train and val come from the same distribution.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from gdn2.data.shards import write_shard

ROOT = Path(__file__).resolve().parents[1]

MICRO_MODEL = dict(block_size=64, vocab_size=256, n_layer=2, n_embd=64, n_head=2, intermediate_size=128,
                   gdn2_per_layer=2, sliding_window=32, gdn2_num_heads=2, gdn2_head_dim=32, gdn2_gate_rank=16)


def _phrase_stream(rng: np.random.Generator, phrases: list[np.ndarray], n: int) -> np.ndarray:
    out: list[int] = []
    while len(out) < n:
        picks = rng.integers(0, len(phrases), size=int(rng.integers(5, 30)))
        out.extend(np.concatenate([phrases[i] for i in picks]).tolist())
        out.append(2)  # EOS
    return np.asarray(out[:n], dtype=np.uint16)


def write_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    phrases = [rng.integers(3, 256, size=int(rng.integers(3, 8))) for _ in range(40)]
    write_shard(folder / "train_0000000000.bin", _phrase_stream(rng, phrases, 150_000))
    write_shard(folder / "train_0000000001.bin", _phrase_stream(rng, phrases, 50_000))
    write_shard(folder / "val_0000000000.bin", _phrase_stream(rng, phrases, 20_000))
    return folder


def micro_config(corpus: Path, folder: Path, **sections) -> Path:
    """Write a micro config YAML into ``folder``; ``sections`` update the defaults section by section."""
    cfg = {
        "model": dict(MICRO_MODEL),
        "train": dict(global_batch_size=4, micro_batch_size=2, max_steps=6, warmup_steps=1),
        "optimizer": dict(lr=3e-3),
        "data": dict(train=[str(corpus)], val=str(corpus), num_workers=0),
        "eval": dict(interval=0, num_batches=1, length_multipliers=[1, 2], at_end=False),
        "checkpoint": dict(interval=0, keep_last=3),
        "logging": dict(interval=1, progress_bar=False, tensorboard=False),
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = folder / "micro.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_main(args: list[str], env_extra: dict | None = None, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    """``python pretrain/main.py ARGS`` in a subprocess from the repository root."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, str(ROOT / "pretrain" / "main.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, **popen)


def read_state(checkpoint: Path) -> dict:
    """A training checkpoint's ``state`` in this process: ``{"model", "optimizer", "trainer"}`` with full
    tensors under the bare model's names, from either format (folder of shards or one file)."""
    import tempfile
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = Path(checkpoint) / "state"
    if state.is_file():
        return torch.load(state, weights_only=False)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_to_torch_save(state, Path(tmp) / "state.pt")
        blob = torch.load(Path(tmp) / "state.pt", weights_only=False)
    blob["trainer"] = torch.load(state / "meta.pt", weights_only=False)["trainer"]
    return blob
