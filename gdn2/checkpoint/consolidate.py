"""Consolidation: a training checkpoint (sharded or not, from any number of ranks) -> one ``model.pt``
for evaluation, generation and sharing, and ``python -m gdn2 consolidate``.

``<run>/final/model.pt`` = ``{"model": fp32 state dict, "config": model config, "step", "tokens",
"recipe"}`` with its sha256 (``model.pt.sha256``), ``config.yaml`` and ``tokenizer.model`` beside it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gdn2.checkpoint.format import (CONFIG, STATE, _NAME, bare_state_dict, read_checkpoint_config, read_marker,
                                    verify_checkpoint)
from gdn2.checkpoint.resume import resume_candidates
from gdn2.checkpoint.state import quiet_single_process
from gdn2.commandline import option, parse_options
from gdn2.files import file_sha256, fsync_dir
from gdn2.tokenizer import TOKENIZER_FILE


def _load_sharded_model(state_dir: Path) -> dict[str, torch.Tensor]:
    """The model entries of a torch.distributed.checkpoint folder, read in one process (no optimizer)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(state_dir))
    metadata = reader.read_metadata()
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ValueError(f"{state_dir}: no model tensors in this distributed checkpoint")
    with quiet_single_process():
        load({"model": model}, storage_reader=reader, no_dist=True)
    return model


def consolidate_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint folder -> ``{"model": state_dict, "config": model config dict, "step", "tokens",
    "recipe"}`` with fp32 CPU tensors under the bare model's parameter names.

    ``GPT(Config.from_dict(d["config"])).load_state_dict(d["model"])`` restores the model.
    """
    path = Path(path)
    verify_checkpoint(path)
    marker = read_marker(path)
    recipe = read_checkpoint_config(path)
    state_path = path / STATE
    if state_path.is_dir():
        model = _load_sharded_model(state_path)
    else:
        model = torch.load(state_path, map_location="cpu", weights_only=False)["model"]
    model = bare_state_dict(model)
    return {"model": model, "config": recipe["model"], "step": marker["step"], "tokens": marker.get("tokens"),
            "recipe": recipe}



def default_consolidated_dir(checkpoint: Path) -> Path:
    """``<run>/final`` for a checkpoint ``<run>/checkpoints/step-<N>``: outside the folder that
    checkpoint rotation prunes."""
    checkpoint = Path(checkpoint).resolve()
    folder = checkpoint.parent if _NAME.match(checkpoint.name) else checkpoint
    return folder.parent / "final"


def _data_folders(run: dict) -> list[str]:
    """Folders of the data sources a saved run config names (``data.train`` / ``data.val``)."""
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    sources = list(data.get("train") or []) if isinstance(data.get("train"), list) else [data.get("train")]
    sources.append(data.get("val"))
    folders = []
    for src in sources:
        src = src.get("path") if isinstance(src, dict) else src
        if isinstance(src, str) and src:
            # a glob or a shard file names its folder; a folder names itself
            folders.append(src if not any(c in src for c in "*?[") and not src.endswith(".bin")
                           else os.path.dirname(src))
    return folders


def find_run_tokenizer(run: dict, bases: Sequence[Path]) -> Optional[Path]:
    """The tokenizer a saved run config leads to: ``data.tokenizer`` / ``tokenizer`` when recorded,
    else ``tokenizer.model`` in, or the ``manifest.json`` of, each data folder it trained on. Relative
    paths are tried against each of ``bases``."""
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    named = [v for v in (data.get("tokenizer"), run.get("tokenizer")) if isinstance(v, str) and v]
    candidates: list[Path] = [Path(v) for v in named]
    for folder in _data_folders(run):
        candidates.append(Path(folder) / TOKENIZER_FILE)
        for base in [Path(folder)] + [b / folder for b in bases]:
            manifest = base / "manifest.json"
            if manifest.is_file():
                try:
                    recorded = json.loads(manifest.read_text()).get("tokenizer", {})
                except ValueError:
                    continue
                if isinstance(recorded, dict) and recorded.get("path"):
                    candidates.append(Path(recorded["path"]))
    for c in candidates:
        for p in ([c] if c.is_absolute() else [b / c for b in bases]):
            p = p / TOKENIZER_FILE if p.is_dir() else p
            if p.is_file():
                return p
    return None


def write_consolidated(path: Path, out: Path) -> dict[str, Any]:
    """Consolidate checkpoint ``path`` into ``out/model.pt``, with the resolved recipe
    (``out/config.yaml``) and the run's tokenizer (``out/tokenizer.model``, when found) beside it."""
    consolidated = consolidate_checkpoint(path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.pt.tmp"
    torch.save(consolidated, tmp)
    (out / "model.pt.sha256").write_text(f"{file_sha256(tmp)}  model.pt\n")
    os.replace(tmp, out / "model.pt")
    shutil.copyfile(path / CONFIG, out / CONFIG)
    tokenizer = find_run_tokenizer(consolidated["recipe"], [Path.cwd(), path])
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.model")
    fsync_dir(out)
    return {"model": out / "model.pt", "tokenizer": tokenizer, "step": consolidated["step"],
            "parameters": sum(t.numel() for t in consolidated["model"].values()),
            "config_name": consolidated["config"].get("name")}


@dataclass(kw_only=True)
class ConsolidateOptions:
    checkpoint: str = option(help="a step-<N> checkpoint folder, or a folder of them (the newest complete one is used)",
                             positional=True)
    out: Optional[str] = option(None, "output folder", meaning_of_null="<run>/final, outside checkpoint rotation")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m gdn2 consolidate CHECKPOINT [--out DIR]``."""
    args = parse_options(
        ConsolidateOptions, list(argv or []), "gdn2 consolidate",
        "Turn a training checkpoint (sharded or not) into one model.pt for evaluation, generation and sharing: "
        "{model: fp32 state_dict under bare parameter names, config, step, tokens, recipe}, with config.yaml and "
        "tokenizer.model beside it. Runs in one CPU process, whatever the number of ranks that wrote the checkpoint.")
    if args is None:
        return 0
    root = Path(args.checkpoint)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint {root} does not exist")
    candidates, _ = resume_candidates(str(root), root)
    path = candidates[0]  # the newest: consolidating an older one is asked for by naming it
    out = Path(args.out) if args.out else default_consolidated_dir(path)
    info = write_consolidated(path, out)
    print(f"wrote {info['model']}: {info['parameters']:,} parameters, step {info['step']}, config "
          f"{info['config_name']}; tokenizer: {info['tokenizer'] or 'not found (pass --tokenizer when loading)'}")
    return 0

