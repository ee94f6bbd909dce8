"""Consolidation: a training checkpoint (sharded or not, from any number of ranks) -> one ``model.pt``
for evaluation, generation and sharing, and ``python -m gdn2 consolidate``.

``<run>/final/`` holds ``model.pt`` = ``{"model": fp32 state dict, "config": model config, "step",
"tokens", "recipe", "tokenizer_sha256"}``, its sha256 (``model.pt.sha256``), ``config.yaml`` and the
run's ``tokenizer.model``. The folder is written whole (:func:`write_model_folder`): a crash, a full
disk or a SIGTERM leaves the previous one as it was, never a model beside another model's digest.

The run's tokenizer is the one whose sha256 the run recorded (the checkpoint's marker, else the run's
``run.json``, else the ``manifest.json`` of the data it trained on): a file that a saved recipe or a
manifest merely names is never copied unless its digest matches, so no other local file can end up in
an export.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gdn2.checkpoint.format import (CONFIG, STATE, _NAME, bare_state_dict, read_checkpoint_config, read_marker,
                                    verify_checkpoint)
from gdn2.checkpoint.resume import resume_candidates
from gdn2.checkpoint.safe_load import load_distributed, load_torch_file, read_dcp_metadata
from gdn2.checkpoint.state import quiet_single_process
from gdn2.commandline import option, parse_options
from gdn2.data.shards import MANIFEST_NAME, read_manifest
from gdn2.files import atomic_folder, file_sha256, full_disk_error
from gdn2.tokenizer import TOKENIZER_FILE

MODEL_FILE = "model.pt"
DIGEST_FILE = MODEL_FILE + ".sha256"
# What a consolidated folder holds (model.pt.tmp: left by versions that wrote the model in place).
CONSOLIDATED_FILES = (MODEL_FILE, DIGEST_FILE, CONFIG, TOKENIZER_FILE, MODEL_FILE + ".tmp")


def _load_sharded_model(state_dir: Path) -> dict[str, torch.Tensor]:
    """The model entries of a torch.distributed.checkpoint folder, read in one process (no optimizer)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(state_dir / ".metadata")
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ValueError(f"{state_dir}: no model tensors in this distributed checkpoint")
    with quiet_single_process():
        load_distributed({"model": model}, state_dir, no_dist=True)
    return model


def consolidate_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint folder -> ``{"model": state_dict, "config": model config dict, "step", "tokens",
    "recipe", "tokenizer_sha256"}`` with fp32 CPU tensors under the bare model's parameter names
    (``tokenizer_sha256``: what the checkpoint's marker recorded, else None).

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
        model = load_torch_file(state_path)["model"]
    model = bare_state_dict(model)
    return {"model": model, "config": recipe["model"], "step": marker["step"], "tokens": marker.get("tokens"),
            "recipe": recipe, "tokenizer_sha256": marker.get("tokenizer_sha256")}


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


def _inside(base: Path, relative: str, where: str) -> Path:
    """``base / relative``, which a file names relative to ``base``: ValueError naming ``where`` when it
    leaves that folder (``..``)."""
    path = Path(base) / relative
    if not path.resolve().is_relative_to(Path(base).resolve()):
        raise ValueError(f"{where}: {relative!r} leaves its folder {base}; refused")
    return path


def _manifests(run: dict, bases: Sequence[Path]) -> list[tuple[Path, dict]]:
    """(folder, manifest) of each data folder a saved run config trained on, tried against each base."""
    found = []
    for folder in _data_folders(run):
        for base in [Path(b) for b in bases]:
            directory = base / folder
            try:
                manifest = read_manifest(directory) if directory.is_dir() else None
            except ValueError:  # a damaged manifest records nothing usable here
                manifest = None
            if manifest is not None:
                found.append((directory, manifest))
    return found


def _run_json_sha256(folder: Path) -> Optional[str]:
    """The tokenizer sha256 a run folder's ``run.json`` records for its training data, when all its
    sources agree on one."""
    try:
        info = json.loads((folder / "run.json").read_text())
    except (OSError, ValueError):
        return None
    sources = ((info.get("data") or {}).get("train") or []) if isinstance(info, dict) else []
    digests = {s.get("tokenizer_sha256") for s in sources if isinstance(s, dict)} - {None}
    return digests.pop() if len(digests) == 1 else None


def recorded_tokenizer(own: Optional[str], checkpoint: Path, run: Optional[dict],
                       bases: Sequence[Path]) -> Optional[tuple[str, str]]:
    """(sha256, where it is recorded) of the tokenizer the run of ``checkpoint`` trained with: ``own``
    (what the checkpoint itself recorded), else the ``run.json`` of its folder or of up to two folders
    above it, else the manifest of the data its saved run config ``run`` trained on; None when nothing
    records one."""
    if own:
        return own, str(checkpoint)
    start = checkpoint if checkpoint.is_dir() else checkpoint.parent
    for folder in [start, *list(start.parents)[:2]]:
        digest = _run_json_sha256(folder)
        if digest:
            return digest, str(folder / "run.json")
    for folder, manifest in _manifests(run or {}, bases):
        recorded = manifest.get("tokenizer")
        digest = recorded.get("sha256") if isinstance(recorded, dict) else None
        if isinstance(digest, str) and digest:
            return digest, str(folder / MANIFEST_NAME)
    return None


def find_run_tokenizer(run: dict, bases: Sequence[Path], sha256: Optional[str] = None) -> Optional[Path]:
    """The tokenizer a saved run config leads to: ``tokenizer.model`` in each data folder it trained
    on, the tokenizer the folder's ``manifest.json`` names, or ``data.tokenizer`` / ``tokenizer`` when
    the config names one. Relative paths are tried against each of ``bases``.

    With ``sha256`` only a file of that digest is taken. A file that the config or a manifest names is
    taken only when its digest matches (``sha256``, or the one the manifest records beside the name): a
    forged config cannot pick an arbitrary file. A named path that leaves its folder is a ValueError."""
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    # (path, the digest it must have: None means any, the fixed name only)
    candidates: list[tuple[Path, Optional[str]]] = []
    for key, value in (("data.tokenizer", data.get("tokenizer")), ("tokenizer", run.get("tokenizer"))):
        if isinstance(value, str) and value and sha256 is not None:
            paths = [Path(value)] if Path(value).is_absolute() else \
                [_inside(Path(b), value, f"run config {key}") for b in bases]
            candidates += [(p, sha256) for p in paths]
    for folder in _data_folders(run):
        for base in [Path(b) for b in bases]:
            candidates.append((base / folder / TOKENIZER_FILE, sha256))
    for folder, manifest in _manifests(run, bases):
        recorded = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
        name, digest = recorded.get("path"), sha256 or recorded.get("sha256")
        if isinstance(name, str) and name and isinstance(digest, str):
            path = Path(name) if Path(name).is_absolute() else \
                _inside(folder, name, f"{folder / MANIFEST_NAME}: tokenizer.path")
            candidates.append((path, digest))
    for path, digest in candidates:
        if path.is_file() and (digest is None or file_sha256(path) == digest):
            return path
    return None


def write_model_folder(out: Path, blob: dict[str, Any], config_yaml: Optional[str] = None,
                       tokenizer: Optional[Path] = None) -> Path:
    """Write the consolidated folder ``out``: ``model.pt`` (``blob``), ``model.pt.sha256``, and when given
    ``config.yaml`` and ``tokenizer.model`` (whose bytes must have ``blob["tokenizer_sha256"]`` when that
    is set). Returns ``out / "model.pt"``.

    Atomic: everything is written into a temporary folder beside ``out``, the digest of the model
    included, and that folder then takes ``out``'s place in one step (:func:`gdn2.files.atomic_folder`);
    the digest therefore always belongs to the model beside it, and a crash, SIGTERM or full disk leaves
    the previous folder untouched and no partial file. ``out`` may be new, empty, or an earlier
    consolidated folder (which is replaced); a folder holding anything else is refused. A full disk is
    an OSError naming the disk and the last good model."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; the output is a folder")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in CONSOLIDATED_FILES)
        if foreign:
            raise ValueError(f"{out} holds files that are not a consolidated model ({', '.join(foreign[:5])}); "
                             "write into a new or empty folder")
    tokenizer_bytes = Path(tokenizer).read_bytes() if tokenizer is not None else None
    expected = blob.get("tokenizer_sha256")
    if tokenizer_bytes is not None and expected and hashlib.sha256(tokenizer_bytes).hexdigest() != expected:
        raise ValueError(f"{tokenizer}: changed while being copied (its sha256 is no longer {expected})")
    last_good = out / MODEL_FILE if (out / MODEL_FILE).is_file() else None
    try:
        with atomic_folder(out) as tmp:
            with open(tmp / MODEL_FILE, "wb") as f:  # a file object: a full disk is an OSError, not a torch error
                torch.save(blob, f)
            (tmp / DIGEST_FILE).write_text(f"{file_sha256(tmp / MODEL_FILE)}  {MODEL_FILE}\n")
            if config_yaml is not None:
                (tmp / CONFIG).write_text(config_yaml)
            if tokenizer_bytes is not None:
                (tmp / TOKENIZER_FILE).write_bytes(tokenizer_bytes)
    except OSError as error:
        raise full_disk_error(error, out / MODEL_FILE,
                              f"and the last good model is {last_good or 'none (there was none)'}") from error
    return out / MODEL_FILE


def write_consolidated(path: Path, out: Path) -> dict[str, Any]:
    """Consolidate checkpoint ``path`` into ``out/model.pt`` (:func:`write_model_folder`), with the
    resolved recipe (``out/config.yaml``) and the run's tokenizer (``out/tokenizer.model``, when one
    matching the recorded sha256 is found; with no sha256 recorded, only a ``tokenizer.model`` of the
    data folders)."""
    path = Path(path)
    consolidated = consolidate_checkpoint(path)
    bases = [Path.cwd(), path]
    recorded = recorded_tokenizer(consolidated["tokenizer_sha256"], path, consolidated["recipe"], bases)
    digest = recorded[0] if recorded else None
    tokenizer = find_run_tokenizer(consolidated["recipe"], bases, digest)
    if digest is None and tokenizer is not None:
        digest = file_sha256(tokenizer)
    consolidated["tokenizer_sha256"] = digest
    model = write_model_folder(out, consolidated, (path / CONFIG).read_text(), tokenizer)
    if tokenizer is not None:
        note = str(tokenizer)
    elif recorded is not None:
        note = (f"not copied: no file with the sha256 recorded in {recorded[1]} was found (pass --tokenizer when "
                "loading)")
    else:
        note = "not found (pass --tokenizer when loading)"
    return {"model": model, "tokenizer": tokenizer, "tokenizer_note": note, "step": consolidated["step"],
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
          f"{info['config_name']}; tokenizer: {info['tokenizer_note']}")
    return 0

