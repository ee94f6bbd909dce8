"""gdn2 checkpoints <-> Hugging Face model folders.

    python -m gdn2 hf export --checkpoint out/run/final/model.pt --out hf/my-model [--dtype bfloat16] [--overwrite]
    python -m gdn2 hf import --model hf/my-model --out out/imported

An exported folder holds ``config.json``, ``model.safetensors`` (gdn2's state dict, its parameter
names unchanged), the tokenizer (``tokenizer.model`` and ``tokenizer_config.json``) and the modeling
code registered through ``auto_map``: ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` and ``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` load
it on a machine without gdn2, and lm-eval's ``hf`` model runs on it. Import writes a consolidated gdn2
checkpoint (``model.pt`` with its sha256, ``tokenizer.model``); export -> import -> export is lossless.

Both write their folder whole (``gdn2.files.atomic_folder``): a failure, Ctrl-C or SIGTERM leaves the
previous folder as it was, never a new ``config.json`` over old weights. Export takes a new or empty
folder, or replaces an earlier export when told to (``--overwrite``); import checks the weights against
``config.json`` (every parameter present, of its shape, floating point) before writing anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from gdn2.checkpoint.consolidate import write_model_folder
from gdn2.checkpoint.load import DTYPES, read_checkpoint
from gdn2.commandline import option, parse_options
from gdn2.config import Config
from gdn2.files import atomic_folder, file_sha256, full_disk_error
from gdn2.tokenizer import TOKENIZER_FILE, Tokenizer

AUTO_MAP = {"AutoConfig": "configuration_gdn2.GDN2Config", "AutoModelForCausalLM": "modeling_gdn2.GDN2ForCausalLM"}
REMOTE_CODE = ("configuration_gdn2.py", "modeling_gdn2.py", "tokenization_gdn2.py")
HERE = Path(__file__).resolve().parent
WEIGHTS = "model.safetensors"


def hf_config(config: Config, dtype: torch.dtype, extra: dict, tokenizer_sha256: Optional[str] = None):
    from gdn2.hf.configuration_gdn2 import GDN2Config

    fields = config.to_dict()
    name = fields.pop("name")
    hf = GDN2Config(**fields, gdn2_name=name, architectures=["GDN2ForCausalLM"])
    hf.auto_map = dict(AUTO_MAP)
    hf.gdn2_step, hf.gdn2_tokens = extra.get("step"), extra.get("tokens")
    hf.gdn2_tokenizer_sha256 = tokenizer_sha256
    import transformers
    from packaging.version import Version

    field_name = "dtype" if Version(transformers.__version__) >= Version("5") else "torch_dtype"
    setattr(hf, field_name, str(dtype).replace("torch.", ""))
    return hf


def _is_export(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "gdn2"
    except (OSError, ValueError, AttributeError):
        return False


def check_export_target(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """ValueError unless ``out`` may receive an export of ``checkpoint``: new or empty, or (with
    ``overwrite``) an earlier gdn2 export; never the folder that holds the checkpoint."""
    source = Path(checkpoint).resolve()
    target = out.resolve()
    if source == target or target in source.parents:
        raise ValueError(f"--out {out} holds the checkpoint being exported ({checkpoint}); export into another folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; the export is a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--out {out} is not empty; pass --overwrite to replace an earlier export, or choose "
                             "a new folder")
        if not _is_export(out):
            raise ValueError(f"--out {out} holds files that are not a gdn2 export (no config.json of model_type "
                             "gdn2); --overwrite replaces only an earlier export")


def export(checkpoint: str | Path, out: str | Path, dtype: Optional[str] = None, tokenizer: Optional[str] = None,
           overwrite: bool = False, allow_tokenizer_mismatch: bool = False) -> Path:
    """Write the Hugging Face folder ``out`` for a gdn2 checkpoint (consolidated or training), whole or
    not at all. ``out``: see :func:`check_export_target`. The tokenizer is the checkpoint's run's own
    (see ``read_checkpoint``; ``allow_tokenizer_mismatch`` accepts another one given as ``tokenizer``)."""
    from safetensors.torch import save_file

    out = Path(out)
    check_export_target(out, Path(checkpoint), overwrite)
    found = read_checkpoint(checkpoint, tokenizer=tokenizer, allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    check_export_target(out, found.path, overwrite)
    chosen = DTYPES[dtype] if dtype else torch.float32
    keep_fp32 = ("A_log", "dt_bias")  # the decay parameters stay fp32, as in training
    state = {k: (v if k.rsplit(".", 1)[-1] in keep_fp32 else v.to(chosen)).detach().cpu().contiguous()
             for k, v in found.state_dict.items()}
    tokenizer_bytes = found.tokenizer.read_bytes()
    sp = Tokenizer(found.tokenizer)
    piece = sp.processor.IdToPiece
    if sp.eos_id < 0:
        raise ValueError(f"tokenizer {found.tokenizer}: defines no EOS token, which generation and padding need")
    # padding uses EOS (the tokenizer has no pad piece): the attention mask hides it, and the generation
    # config names the same id; on the left, as a decoder-only model is batched for generation
    tokenizer_config = {
        "tokenizer_class": "GDN2Tokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_gdn2.GDN2Tokenizer", None]},
        "bos_token": piece(sp.bos_id) if sp.bos_id >= 0 else None, "eos_token": piece(sp.eos_id),
        "unk_token": piece(sp.processor.unk_id()), "pad_token": piece(sp.eos_id), "padding_side": "left",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": found.config.block_size,
    }
    earlier = "and the earlier export there is untouched" if out.is_dir() and any(out.iterdir()) else \
        "and there was no earlier export"
    try:
        with atomic_folder(out) as tmp:
            for name in REMOTE_CODE:
                (tmp / name).write_bytes((HERE / name).read_bytes())
            try:
                save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
            except Exception as error:  # noqa: BLE001 - safetensors reports an OS error as its own type, code in text
                code = re.search(r"os error (\d+)", str(error))
                if code is None:
                    raise
                raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from error
            (tmp / TOKENIZER_FILE).write_bytes(tokenizer_bytes)
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
            generation = {"bos_token_id": sp.bos_id if sp.bos_id >= 0 else None, "eos_token_id": sp.eos_id,
                          "pad_token_id": sp.eos_id}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            hf_config(found.config, chosen, found.extra,
                      hashlib.sha256(tokenizer_bytes).hexdigest()).to_json_file(tmp / "config.json")
    except OSError as error:
        raise full_disk_error(error, out, earlier) from error
    return out


def check_weights(state: dict[str, torch.Tensor], config: Config, where: Path) -> None:
    """ValueError naming ``where`` and the key unless ``state`` holds exactly the parameters of a GPT of
    ``config``, each of its shape and floating point."""
    from gdn2.model import GPT

    with torch.device("meta"):
        expected = GPT(config).state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"{where}: {missing[0]} is missing ({len(missing)} of the {len(expected)} tensors "
                         "config.json calls for are)")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise ValueError(f"{where}: {unexpected[0]} is not a parameter of the model config.json describes")
    for key, want in expected.items():
        got = state[key]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{where}: {key} has shape {list(got.shape)}, config.json calls for {list(want.shape)}")
        if not got.dtype.is_floating_point:
            raise ValueError(f"{where}: {key} is {str(got.dtype).replace('torch.', '')}, not floating point")


def _read_hf_config(path: Path) -> dict[str, Any]:
    try:
        hf = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON file ({error})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    if hf.get("model_type") != "gdn2":
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r}, not a gdn2 model")
    return hf


def import_folder(model: str | Path, out: str | Path) -> Path:
    """A consolidated gdn2 checkpoint (``out/model.pt`` + ``tokenizer.model``) from an exported folder,
    written whole (``write_model_folder``) once the weights are known to fit ``config.json``."""
    from safetensors.torch import load_file

    model = Path(model)
    for name in ("config.json", WEIGHTS, TOKENIZER_FILE):
        if not (model / name).is_file():
            raise FileNotFoundError(f"--model: {model / name} does not exist (not a folder written by gdn2 hf "
                                    "export?)")
    hf = _read_hf_config(model / "config.json")
    fields = {f: hf[f] for f in Config.__dataclass_fields__ if f != "name" and f in hf}
    name = hf.get("gdn2_name") if isinstance(hf.get("gdn2_name"), str) else model.name
    try:
        config = Config.from_dict({"name": name, **fields}, where=str(model / "config.json"))
    except (TypeError, ValueError) as error:
        message = str(error)
        raise ValueError(message if str(model / "config.json") in message else f"{model / 'config.json'}: {message}") \
            from None
    try:
        state = load_file(str(model / WEIGHTS))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise ValueError(f"{model / WEIGHTS}: not a readable safetensors file ({error})") from None
    check_weights(state, config, model / WEIGHTS)
    recorded = hf.get("gdn2_tokenizer_sha256")
    digest = file_sha256(model / TOKENIZER_FILE)
    if isinstance(recorded, str) and recorded and digest != recorded:
        raise ValueError(f"{model / TOKENIZER_FILE}: sha256 {digest[:12]}..., but config.json records the exported "
                         f"tokenizer's as {recorded[:12]}...")
    blob = {"model": state, "config": config.to_dict(), "step": hf.get("gdn2_step"), "tokens": hf.get("gdn2_tokens"),
            "recipe": None, "tokenizer_sha256": digest}
    return write_model_folder(Path(out), blob, tokenizer=model / TOKENIZER_FILE)


@dataclass(kw_only=True)
class ExportOptions:
    checkpoint: str = option(help="model.pt, a training checkpoint or a folder of them")
    out: str = option(help="the model folder to write")
    dtype: Optional[str] = option(None, "weights' dtype (A_log and dt_bias stay float32)",
                                  choices=["float32", "bfloat16", "float16"], meaning_of_null="float32")
    tokenizer: Optional[str] = option(None, "tokenizer.model", meaning_of_null="the run's own, found beside the "
                                                                              "checkpoint or its data")
    overwrite: bool = option(False, "replace an earlier export in --out")
    allow_tokenizer_mismatch: bool = option(False, "export with --tokenizer even when it is not the tokenizer the "
                                                   "checkpoint's run recorded (its sha256 differs)")


@dataclass(kw_only=True)
class ImportOptions:
    model: str = option(help="the model folder")
    out: str = option(help="folder for model.pt and tokenizer.model")


ACTIONS = {"export": (ExportOptions, "a gdn2 checkpoint -> a Hugging Face model folder"),
           "import": (ImportOptions, "a Hugging Face folder written by export -> a gdn2 checkpoint")}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gdn2 hf {export,import} [options]   (gdn2 hf export --help for its options)\n\n"
              + __doc__.split("\n\n")[0] + "\n\n"
              + "\n".join(f"  {name:<7} {text}" for name, (_, text) in ACTIONS.items()))
        return 0 if argv else 2
    if argv[0] not in ACTIONS:
        raise ValueError(f"unknown action {argv[0]!r}; gdn2 hf takes export or import")
    cls, text = ACTIONS[argv[0]]
    args = parse_options(cls, argv[1:], f"gdn2 hf {argv[0]}", text)
    if args is None:
        return 0
    if isinstance(args, ExportOptions):
        out = export(args.checkpoint, args.out, args.dtype, args.tokenizer, overwrite=args.overwrite,
                     allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)
        print(f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    else:
        path = import_folder(args.model, args.out)
        print(f"wrote {path}")
    return 0
