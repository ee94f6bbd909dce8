"""gdn2 checkpoints <-> Hugging Face model folders.

    python -m gdn2 hf export --checkpoint out/run/final/model.pt --out hf/my-model [--dtype bfloat16]
    python -m gdn2 hf import --model hf/my-model --out out/imported

An exported folder holds ``config.json``, ``model.safetensors`` (gdn2's state dict, its parameter
names unchanged), the tokenizer (``tokenizer.model`` and ``tokenizer_config.json``) and the modeling
code registered through ``auto_map``: ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` and ``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` load
it on a machine without gdn2, and lm-eval's ``hf`` model runs on it. Import writes a consolidated gdn2
checkpoint (``model.pt`` with its sha256, ``tokenizer.model``); export -> import -> export is lossless.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from gdn2.files import file_sha256
from dataclasses import dataclass

from gdn2.checkpoint.load import DTYPES, read_checkpoint
from gdn2.commandline import option, parse_options
from gdn2.config import Config
from gdn2.tokenizer import Tokenizer

AUTO_MAP = {"AutoConfig": "configuration_gdn2.GDN2Config", "AutoModelForCausalLM": "modeling_gdn2.GDN2ForCausalLM"}
REMOTE_CODE = ("configuration_gdn2.py", "modeling_gdn2.py", "tokenization_gdn2.py")
HERE = Path(__file__).resolve().parent


def hf_config(config: Config, dtype: torch.dtype, extra: dict):
    from gdn2.hf.configuration_gdn2 import GDN2Config

    fields = config.to_dict()
    name = fields.pop("name")
    hf = GDN2Config(**fields, gdn2_name=name, architectures=["GDN2ForCausalLM"])
    hf.auto_map = dict(AUTO_MAP)
    hf.gdn2_step, hf.gdn2_tokens = extra.get("step"), extra.get("tokens")
    import transformers
    from packaging.version import Version

    field_name = "dtype" if Version(transformers.__version__) >= Version("5") else "torch_dtype"
    setattr(hf, field_name, str(dtype).replace("torch.", ""))
    return hf


def export(checkpoint: str | Path, out: str | Path, dtype: Optional[str] = None,
           tokenizer: Optional[str] = None) -> Path:
    """Write the Hugging Face folder ``out`` for a gdn2 checkpoint (consolidated or training)."""
    from safetensors.torch import save_file

    found = read_checkpoint(checkpoint, tokenizer=tokenizer)
    chosen = DTYPES[dtype] if dtype else torch.float32
    keep_fp32 = ("A_log", "dt_bias")  # the decay parameters stay fp32, as in training
    state = {k: (v if k.rsplit(".", 1)[-1] in keep_fp32 else v.to(chosen)).detach().cpu().contiguous()
             for k, v in found.state_dict.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in REMOTE_CODE:
        shutil.copyfile(HERE / name, out / name)
    hf_config(found.config, chosen, found.extra).to_json_file(out / "config.json")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(found.tokenizer, out / "tokenizer.model")
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
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": sp.bos_id if sp.bos_id >= 0 else None, "eos_token_id": sp.eos_id,
                  "pad_token_id": sp.eos_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def import_folder(model: str | Path, out: str | Path) -> Path:
    """A consolidated gdn2 checkpoint (``out/model.pt`` + ``tokenizer.model``) from an exported folder."""
    from safetensors.torch import load_file

    model = Path(model)
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        if not (model / name).is_file():
            raise FileNotFoundError(f"--model: {model / name} does not exist (not a folder written by gdn2 hf "
                                    "export?)")
    hf = json.loads((model / "config.json").read_text())
    if hf.get("model_type") != "gdn2":
        raise ValueError(f"{model / 'config.json'}: model_type {hf.get('model_type')!r}, not a gdn2 model")
    fields = {f: hf[f] for f in Config.__dataclass_fields__ if f != "name" and f in hf}
    config = Config(name=hf.get("gdn2_name") or model.name, **fields)
    state = load_file(str(model / "model.safetensors"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    blob = {"model": state, "config": config.to_dict(), "step": hf.get("gdn2_step"), "tokens": hf.get("gdn2_tokens"),
            "recipe": None}
    tmp = out / "model.pt.tmp"
    torch.save(blob, tmp)
    (out / "model.pt.sha256").write_text(f"{file_sha256(tmp)}  model.pt\n")
    tmp.replace(out / "model.pt")
    shutil.copyfile(model / "tokenizer.model", out / "tokenizer.model")
    return out / "model.pt"


@dataclass(kw_only=True)
class ExportOptions:
    checkpoint: str = option(help="model.pt, a training checkpoint or a folder of them")
    out: str = option(help="the model folder to write")
    dtype: Optional[str] = option(None, "weights' dtype (A_log and dt_bias stay float32)",
                                  choices=["float32", "bfloat16", "float16"], meaning_of_null="float32")
    tokenizer: Optional[str] = option(None, "tokenizer.model", meaning_of_null="found beside the checkpoint")


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
        out = export(args.checkpoint, args.out, args.dtype, args.tokenizer)
        print(f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    else:
        path = import_folder(args.model, args.out)
        print(f"wrote {path}")
    return 0
