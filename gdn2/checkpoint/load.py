"""Reading a checkpoint for inference: the weights (a consolidated file, a training checkpoint folder, or
a folder of those), the config that belongs to them (saved in the checkpoint, or a run config beside
it) and the tokenizer (beside it, or where the run's data came from); :func:`load_model` builds the GPT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml

from gdn2.checkpoint.consolidate import consolidate_checkpoint, find_run_tokenizer, recorded_tokenizer
from gdn2.checkpoint.format import MARKER, bare_state_dict, is_complete, list_checkpoints, verify_consolidated
from gdn2.checkpoint.safe_load import UnsafeFileError, load_torch_file
from gdn2.config import Config
from gdn2.files import file_sha256
from gdn2.model import GPT
from gdn2.tokenizer import TOKENIZER_FILE, Tokenizer


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def parse_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """``None``/'auto': bf16 on CUDA, fp32 elsewhere; else a dtype or one of :data:`DTYPES`' names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[name]


@dataclass
class FoundCheckpoint:
    """A checkpoint's weights with the config and tokenizer that belong to it."""

    path: Path
    state_dict: dict[str, torch.Tensor]
    config: Config
    tokenizer: Path
    extra: dict = field(default_factory=dict)


# Where a consolidated file keeps its parts (checked in this order).
STATE_KEYS = ("model", "state_dict", "model_state_dict")
CONFIG_KEYS = ("config", "model_config")
CONSOLIDATED_NAMES = ("model.pt", "consolidated.pt", "lit_model.pth", "model.pth")
RUN_CONFIG_NAMES = ("config.yaml", "hparams.yaml", "run_config.yaml")


def _search_dirs(path: Path) -> list[Path]:
    """The checkpoint's folder and up to two parents (a run folder holds its checkpoints in a subfolder)."""
    start = path if path.is_dir() else path.parent
    return [start, *list(start.parents)[:2]]


def _config_from_saved(data: Any, where: str) -> Optional[Config]:
    """A Config from a saved dict: either the model fields or a whole run config with a 'model' section."""
    if isinstance(data, Config):
        return data
    if isinstance(data, dict):
        model = data.get("model", data) if isinstance(data.get("model"), dict) else data
        return Config.from_dict(dict(model), where=f"{where}: model")
    return None


def check_tokenizer(tokenizer: Path, recorded: Optional[tuple[str, str]], checkpoint: Path,
                    allow_mismatch: bool = False) -> None:
    """ValueError when ``tokenizer`` is not the one the run of ``checkpoint`` trained with (``recorded``:
    its sha256 and where that is recorded; None: nothing to compare with), unless ``allow_mismatch``.
    Another tokenizer of the same size would turn every id into another piece without an error."""
    if recorded is None or allow_mismatch:
        return
    digest = file_sha256(tokenizer)
    if digest != recorded[0]:
        raise ValueError(f"tokenizer {str(tokenizer)!r} (sha256 {digest[:12]}...) is not the one checkpoint "
                         f"{str(checkpoint)!r} was trained with (sha256 {recorded[0][:12]}..., recorded in "
                         f"{recorded[1]}); pass that tokenizer with --tokenizer, or --allow_tokenizer_mismatch to "
                         "use this one anyway")


def read_checkpoint(checkpoint: Union[str, os.PathLike], config: Optional[Union[str, Config]] = None,
                    tokenizer: Optional[Union[str, os.PathLike]] = None,
                    allow_tokenizer_mismatch: bool = False) -> FoundCheckpoint:
    """Find and read a checkpoint, its config and its tokenizer.

    ``checkpoint``: a consolidated file (``python -m gdn2 consolidate``: ``{"model": state_dict,
    "config": model config dict, "step", "tokens", "recipe"}``; a bare state dict works when the
    config is found elsewhere), a training checkpoint folder ``step-<N>`` (its ``model.pt`` when
    consolidated, else its shards are read through the trainer's ``consolidate_checkpoint``), or a
    folder of those (the newest complete one). The config comes from ``config`` (a name, YAML path or
    Config), else the file, else a run config (``config.yaml``) beside the checkpoint or up to two
    folders above it. The tokenizer comes from ``tokenizer``, else ``tokenizer.model`` in those
    folders, else the data folders the saved run trained on (their ``tokenizer.model`` or the
    tokenizer their ``manifest.json`` records).

    Where the checkpoint's run recorded its tokenizer's sha256 (the checkpoint itself, the run's
    ``run.json``, the data's ``manifest.json``), the tokenizer must have it: a found one that does not is
    passed over, and a given one that does not is a ValueError, unless ``allow_tokenizer_mismatch``.
    The file is read without running code (UnsafeFileError naming a forged one).
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    extra: dict = {}
    saved_config = None
    if path.is_dir() and not any((path / n).is_file() for n in CONSOLIDATED_NAMES):
        path = _newest_step_folder(path)
    if path.is_dir():
        files = [path / n for n in CONSOLIDATED_NAMES if (path / n).is_file()]
        if files:
            path = files[0]
    if path.is_dir():
        state, saved_config, extra = _read_sharded(path)
    else:
        verify_consolidated(path)
        try:
            blob = load_torch_file(path)
        except UnsafeFileError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(f"checkpoint {str(path)!r} could not be read as a torch file: {e}") from e
        if not isinstance(blob, dict):
            raise ValueError(f"checkpoint {str(path)!r}: expected a dict, got {type(blob).__name__}")
        state = next((blob[k] for k in STATE_KEYS if isinstance(blob.get(k), dict)), None)
        if state is None:
            if all(isinstance(v, torch.Tensor) for v in blob.values()):
                state = blob
            else:
                raise ValueError(f"checkpoint {str(path)!r}: no model state dict under {', '.join(STATE_KEYS)}")
        saved_config = next((blob[k] for k in CONFIG_KEYS if k in blob), None)
        extra = {k: v for k, v in blob.items() if k not in STATE_KEYS + CONFIG_KEYS}
    state = bare_state_dict(state)

    runs: list[tuple[Path, dict]] = []
    if isinstance(extra.get("recipe"), dict):
        runs.append((path, extra["recipe"]))
    for d in _search_dirs(path):
        for name in RUN_CONFIG_NAMES:
            f = d / name
            if f.is_file():
                with open(f) as fh:
                    data = yaml.safe_load(fh)
                if isinstance(data, dict):
                    runs.append((f, data))

    if isinstance(config, Config):
        cfg = config
    elif config is not None:
        cfg = Config.from_name(str(config))
    elif saved_config is not None:
        cfg = _config_from_saved(saved_config, str(path))
    else:
        cfg = next((_config_from_saved(data, str(f)) for f, data in runs if isinstance(data.get("model"), dict)),
                   None)
    if cfg is None:
        looked = ", ".join(str(d / n) for d in _search_dirs(path) for n in RUN_CONFIG_NAMES)
        raise ValueError(f"checkpoint {str(path)!r}: model config missing: none saved in the checkpoint, none of "
                         f"{looked} exists; pass config=<name or YAML path>")

    # relative data paths in a run config are relative to where the run was started
    # (or to the checkout holding this package, for the built-in corpus of a run started there)
    bases = [Path.cwd(), *_search_dirs(path), Path(__file__).resolve().parents[2]]
    run = next((data for _, data in runs if isinstance(data.get("data"), dict)), None)
    recorded = recorded_tokenizer(extra.get("tokenizer_sha256"), path, run, bases)
    digest = recorded[0] if recorded else None
    if tokenizer is not None:
        tok = Path(tokenizer)
        tok = tok / TOKENIZER_FILE if tok.is_dir() else tok
        if not tok.is_file():
            raise FileNotFoundError(f"tokenizer {str(tok)!r} does not exist")
    else:
        candidates = [d / TOKENIZER_FILE for d in _search_dirs(path)]
        beside = [c for c in candidates if c.is_file()]
        tok = next((c for c in beside if digest is None or file_sha256(c) == digest), None)
        if tok is None:
            tok = next((t for _, data in runs if (t := find_run_tokenizer(data, bases, digest)) is not None), None)
        if tok is None and beside:
            tok = beside[0]  # not the run's own: check_tokenizer below says so
        if tok is None:
            raise FileNotFoundError(
                f"checkpoint {str(path)!r}: tokenizer missing: none of {', '.join(map(str, candidates))} exists and "
                "no saved run config leads to one; pass tokenizer=<path to tokenizer.model>")
    check_tokenizer(tok, recorded, path, allow_tokenizer_mismatch)
    return FoundCheckpoint(path, state, cfg, tok, extra)


def _newest_step_folder(path: Path) -> Path:
    """``path`` itself when it is a checkpoint folder, else its newest complete ``step-<N>`` child."""
    if is_complete(path):
        return path
    found = list_checkpoints(path)
    return found[-1][1] if found else path


def _read_sharded(path: Path) -> tuple[dict[str, torch.Tensor], Optional[Any], dict]:
    """Model weights of a training checkpoint folder, through the consolidation above."""
    if not is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r}: neither a consolidated model file "
                         f"({', '.join(CONSOLIDATED_NAMES)}) nor a complete training checkpoint (step-<N> with "
                         f"its {MARKER} marker) nor a folder of those")
    blob = consolidate_checkpoint(path)
    return blob["model"], blob["config"], {k: v for k, v in blob.items() if k not in ("model", "config")}


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Tokenizer
    config: Config
    checkpoint: Path
    extra: dict = field(default_factory=dict)


def load_model(checkpoint: Union[str, os.PathLike], config: Optional[Union[str, Config]] = None,
               tokenizer: Optional[Union[str, os.PathLike]] = None, device: Union[str, torch.device, None] = None,
               dtype: Union[str, torch.dtype, None] = None, allow_tokenizer_mismatch: bool = False) -> LoadedModel:
    """Model (eval mode), tokenizer and config from a checkpoint (see :func:`read_checkpoint`).

    ``dtype``: see :func:`parse_dtype`; the GDN-2 decay parameters ``A_log`` / ``dt_bias`` stay fp32
    as in training. Raises FileNotFoundError / ValueError naming what is missing: the checkpoint, its
    config or its tokenizer, or a tokenizer that is not the run's (``allow_tokenizer_mismatch``: see
    :func:`read_checkpoint`).
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(dtype, device)
    found = read_checkpoint(checkpoint, config=config, tokenizer=tokenizer,
                            allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    tok = Tokenizer(found.tokenizer)
    with torch.device("meta"):
        model = GPT(found.config)
    model = model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(found.state_dict, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"checkpoint {str(found.path)!r} does not match config {found.config.name!r}: {e}") from e
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(found.path)!r} does not match config {found.config.name!r}: "
                         f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    keep_fp32 = {id(p) for block in model.transformer.h if block.kind == "gdn2"
                 for p in (block.mixer.A_log, block.mixer.dt_bias)}
    for p in model.parameters():
        if id(p) not in keep_fp32 or dtype == torch.float64:
            p.data = p.data.to(dtype)
        else:
            p.data = p.data.float()
    model.eval()
    return LoadedModel(model, tok, found.config, found.path, found.extra)
