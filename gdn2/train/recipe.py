"""The training recipe: every non-model section of a named config, CLI overrides, the derived plan.

A named config (``configs/<name>.yaml``) holds the ``model`` section (``gdn2.config.Config``) and the
sections below, one dataclass each. ``--section.key value`` on the command line overrides one key.
Everything is validated before any work starts; errors name the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from gdn2.commandline import describe_option, option, parse_text_value, strip_optional
from gdn2.config import Config, dataclass_from_dict, find_config_file, load_yaml


@dataclass
class TrainConfig:
    global_batch_size: int = option(128, "sequences per optimizer step over all ranks (128 x 4096 = 0.5M tokens)")
    micro_batch_size: int = option(4, "sequences per forward/backward on one device; gradient accumulation "
                                    "= global_batch_size / (micro_batch_size x world size)")
    max_tokens: Optional[int] = option(100_000_000_000, "training length in tokens, rounded up to whole "
                                                      "optimizer steps")
    max_steps: Optional[int] = option(None, "training length in optimizer steps; overrides max_tokens")
    warmup_fraction: float = option(0.01, "linear warmup length as a fraction of the optimizer steps")
    warmup_steps: Optional[int] = option(None, "linear warmup length in optimizer steps; overrides warmup_fraction")
    min_lr_ratio: float = option(0.1, "the cosine decays to optimizer.lr x min_lr_ratio")
    grad_clip: Optional[float] = option(1.0, "clip the global gradient norm to this; null: no clipping")
    seed: int = option(3407, "seed of the model init and of the data order")
    activation_checkpointing: bool = option(False, "recompute each Block's activations in the backward pass")
    compile: bool = option(True, "fuse the model's elementwise stages (norms, gates, short convolutions, "
                               "SwiGLU, RoPE) with torch.compile; CUDA only")
    max_wall_time: Optional[str] = option(None, "save and exit cleanly after this much wall time: seconds, "
                                              "'HH:MM:SS' or 'D-HH:MM:SS'")
    stop_at_step: Optional[int] = option(None, "save and exit after this optimizer step; the schedule still "
                                             "spans the whole run")
    max_consecutive_nonfinite: int = option(5, "stop with an error after more than this many optimizer steps "
                                             "in a row skipped for a non-finite loss or gradient norm")
    loss_chunk_tokens: int = option(8192, "the fp32 cross-entropy runs over this many tokens at a time")
    fused_loss: bool = option(True, "the loss straight from the final hidden states and the head's weight, "
                                   "a slice of tokens at a time: the logits never exist whole")
    grouped_projections: bool = option(True, "one GEMM for the projections that read one input (a GDN-2 "
                                            "layer's seven, the MLP's two)")
    recompute: bool = option(False, "the GDN-2 layers' short-convolution outputs, gates, output gate and gated "
                                  "norm, and the GDN-2 operator's chunk intermediates, rebuilt in the backward "
                                  "instead of kept (swa_gdn2_1.3B at 4 x 4096: 44.2 GiB instead of 51.0, a few "
                                  "percent more step time); no effect with activation_checkpointing")
    float8: Optional[str] = option(None, "the blocks' projections as float8 GEMMs (torchao): tensorwise, rowwise "
                                       "or rowwise_with_gw_hp scaling; null: bf16. Needs a GPU of compute "
                                       "capability 8.9+ and pip install 'gdn2[float8]'")
    profile_steps: Optional[str] = option(None, "record these optimizer steps with torch.profiler ('10-12' or '7'), "
                                              "a trace per rank in <out_dir>/profile/")


@dataclass
class OptimizerConfig:
    lr: float = option(4e-4, "peak learning rate (AdamW)")
    betas: list[float] = option([0.9, 0.95], "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    weight_decay: float = option(0.1, "decoupled weight decay of matrices and embeddings")
    decay_all: bool = option(False, "also decay A_log, dt_bias, norm weights and biases (the reference "
                                  "code's behaviour)")
    fused: Optional[bool] = option(None, "fused AdamW kernel; null: on CUDA only")


@dataclass
class DataConfig:
    train: list[Any] = option(["data/default"], "training sources: a list of paths / globs / directories, "
                                              "or of {path, weight} mappings")
    val: Optional[str] = option("data/default", "validation source (directory means its val_*.bin); "
                                               "null: no validation")
    num_workers: int = option(2, "data-loader worker processes per rank")
    document_masking: bool = option(False, "restart GDN-2 state, conv and attention at every EOS (cu_seqlens)")
    eos_id: int = option(2, "end-of-document token id")
    prepare_default: bool = option(False, "when the built-in corpus's folder data/default holds no shards, build "
                                        "it first (python -m gdn2 corpus); no other folder is ever built")


@dataclass
class EvalConfig:
    interval: int = option(1000, "validate every this many optimizer steps; 0: never")
    num_batches: int = option(16, "micro-batches per rank and per length")
    length_multipliers: list[int] = option([1, 2, 3, 4], "validate at these multiples of model.block_size")
    micro_batch_size: Optional[int] = option(None, "validation micro-batch at 1x; null: train.micro_batch_size. "
                                                 "Divided by the multiplier at longer lengths (at least 1)")
    at_end: bool = option(True, "validate after the last step")


@dataclass
class LmEvalConfig:
    interval: int = option(0, "run lm-eval tasks every this many optimizer steps; 0: never")
    tasks: list[str] = option(["gdn2_local"], "lm-eval task or group names (gdn2_local: offline tasks shipped "
                                            "with gdn2)")
    limit: Optional[float] = option(None, "examples per task: an integer count, or a fraction below 1; "
                                        "null: all")
    batch_size: int = option(8, "sequences per scoring batch")
    include_path: Optional[str] = option(None, "folder of extra task YAMLs (lm-eval's and gdn2's own are always "
                                             "available)")
    tokenizer: Optional[str] = option(None, "SentencePiece model; null: tokenizer.model of the training data")
    at_end: bool = option(False, "also run them after the last step")


@dataclass
class CheckpointConfig:
    interval: int = option(1000, "save every this many optimizer steps; 0: only at the end and on signals")
    keep_last: int = option(3, "keep this many complete checkpoints, delete older ones")
    dir: Optional[str] = option(None, "checkpoint folder; null: <out_dir>/checkpoints")
    state_dict_type: str = option("sharded", "'sharded' (torch.distributed.checkpoint, each rank writes its "
                                           "shards) or 'full' (rank 0 writes one file); either resumes on "
                                           "any number of ranks")
    at_end: bool = option(True, "save after the last step")


@dataclass
class LoggingConfig:
    interval: int = option(10, "log train metrics every this many optimizer steps")
    tensorboard: bool = option(True, "write TensorBoard events to <out_dir>/tensorboard")
    jsonl: bool = option(True, "append metrics to <out_dir>/metrics.jsonl")
    csv: bool = option(False, "also write <out_dir>/csv/metrics.csv (Fabric's CSVLogger)")
    wandb: bool = option(False, "also log to Weights & Biases (pip install wandb), files in <out_dir>/wandb")
    wandb_project: str = option("gdn2", "Weights & Biases project")
    wandb_mode: str = option("online", "online, or offline (no network; upload later with wandb sync)")
    progress_bar: bool = option(True, "tqdm progress bar with ETA on rank 0")
    peak_flops: Optional[float] = option(None, "dense bf16 peak FLOP/s of one device for MFU; null: look "
                                             "up the device name")


@dataclass
class DistributedConfig:
    accelerator: str = option("auto", "auto | cuda | cpu")
    devices: Optional[int] = option(None, "devices per node; null: from SLURM / torchrun, else every GPU "
                                        "(1 on CPU)")
    num_nodes: Optional[int] = option(None, "nodes; null: from SLURM / torchrun, else 1")
    precision: str = option("auto", "auto (bf16-mixed on CUDA, 32-true on CPU) | bf16-mixed | 32-true")
    strategy: str = option("auto", "auto (fsdp with several CUDA devices, ddp with several CPU processes) "
                                 "| fsdp | fsdp2 (fully_shard; CUDA or CPU processes) | ddp")
    sharding: str = option("auto", "FSDP sharding: auto (full on one node, hybrid across nodes) | full | "
                                 "hybrid | grad_op")
    replicas: Optional[int] = option(None, "hybrid sharding: groups of ranks, the model sharded within each and "
                                         "replicated across them; null: one group per node")
    requeue: bool = option(True, "under SLURM, after saving on SIGUSR1/SIGTERM, requeue the job (scontrol)")
    timeout_minutes: int = option(30, "collective-communication timeout")
    timeout_seconds: Optional[int] = option(None, "collective-communication timeout in seconds (at least 10); "
                                                "overrides timeout_minutes. A peer that hangs is found after "
                                                "this long")

    @property
    def collective_timeout(self) -> float:
        """The collective timeout in seconds: ``timeout_seconds``, else ``timeout_minutes``."""
        return float(self.timeout_seconds if self.timeout_seconds is not None else 60 * self.timeout_minutes)


SECTIONS: dict[str, type] = {
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "lm_eval": LmEvalConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
}

_CHOICES = {
    ("distributed", "accelerator"): ("auto", "cuda", "gpu", "cpu"),
    ("distributed", "precision"): ("auto", "bf16-mixed", "32-true"),
    ("distributed", "strategy"): ("auto", "fsdp", "fsdp2", "ddp"),
    ("distributed", "sharding"): ("auto", "full", "hybrid", "grad_op"),
    ("checkpoint", "state_dict_type"): ("sharded", "full"),
    ("logging", "wandb_mode"): ("online", "offline"),
}


@dataclass
class DataSource:
    path: str
    weight: float = 1.0


@dataclass
class Recipe:
    """A whole run: the model architecture and every training section."""

    config_name: str
    model: Config
    train: TrainConfig
    optimizer: OptimizerConfig
    data: DataConfig
    eval: EvalConfig
    lm_eval: LmEvalConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    distributed: DistributedConfig
    out_dir: str

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.out_dir) / "checkpoints"

    def train_sources(self) -> list[DataSource]:
        return parse_sources(self.data.train)

    def sections_dict(self) -> dict[str, dict[str, Any]]:
        """All sections as plain data (the YAML written beside the checkpoints)."""
        out: dict[str, dict[str, Any]] = {"model": self.model.to_dict()}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def to_yaml(self) -> str:
        header = f"# resolved config of {self.config_name!r}; usable as --config <this file>\n"
        return header + yaml.safe_dump(self.sections_dict(), sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------------------------------
# values from text: the CLI and (for numbers PyYAML leaves as strings, e.g. 4e-4) the YAML files
# --------------------------------------------------------------------------------------------------

def _coerce_section(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """Numbers written as text in YAML (PyYAML reads ``4e-4`` as a string) become numbers."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        if key in hints and isinstance(value, str):
            inner, _ = strip_optional(hints[key])
            if inner in (int, float):
                out[key] = parse_text_value(value, hints[key], f"{where}.{key}")
    return out


def parse_sources(entries: list[Any], key: str = "data.train") -> list[DataSource]:
    """``data.train`` entries (a path string or a {path, weight} mapping) as DataSource objects."""
    if not entries:
        raise ValueError(f"{key}: needs at least one source")
    sources = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"{key}[{i}]: expected a path or a {{path, weight}} mapping, got {entry!r}")
        src = dataclass_from_dict(DataSource, _coerce_section(DataSource, entry, f"{key}[{i}]"), f"{key}[{i}]")
        if not (math.isfinite(src.weight) and src.weight > 0):
            raise ValueError(f"{key}[{i}].weight: must be positive, got {src.weight}")
        sources.append(src)
    return sources


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------

def _validate(recipe: Recipe) -> None:
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ValueError(f"{key}: {msg}")

    t, o, e, c, lg, d = recipe.train, recipe.optimizer, recipe.eval, recipe.checkpoint, recipe.logging, recipe.distributed
    need(t.global_batch_size > 0, "train.global_batch_size", f"must be positive, got {t.global_batch_size}")
    need(t.micro_batch_size > 0, "train.micro_batch_size", f"must be positive, got {t.micro_batch_size}")
    need(t.max_steps is not None or t.max_tokens is not None, "train.max_steps",
         "one of train.max_steps and train.max_tokens must be set")
    if t.max_steps is not None:
        need(t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    if t.max_tokens is not None:
        need(t.max_tokens > 0, "train.max_tokens", f"must be positive, got {t.max_tokens}")
    need(0.0 <= t.warmup_fraction < 1.0, "train.warmup_fraction", f"must be in [0, 1), got {t.warmup_fraction}")
    if t.warmup_steps is not None:
        need(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    need(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    if t.grad_clip is not None:
        need(t.grad_clip > 0, "train.grad_clip", f"must be positive or null, got {t.grad_clip}")
    if t.max_wall_time is not None:
        from gdn2.train.slurm import parse_duration

        try:
            parse_duration(t.max_wall_time)
        except ValueError as err:
            raise ValueError(f"train.max_wall_time: {err}") from None
    if t.stop_at_step is not None:
        need(t.stop_at_step > 0, "train.stop_at_step", f"must be positive, got {t.stop_at_step}")
    need(t.max_consecutive_nonfinite >= 0, "train.max_consecutive_nonfinite",
         f"must be >= 0, got {t.max_consecutive_nonfinite}")
    need(t.loss_chunk_tokens > 0, "train.loss_chunk_tokens", f"must be positive, got {t.loss_chunk_tokens}")
    if t.float8 is not None:
        from gdn2.float8 import check_recipe, require_torchao

        check_recipe(t.float8)
        require_torchao()
    from gdn2.train.profile import parse_steps

    parse_steps(t.profile_steps)

    need(o.lr > 0 and math.isfinite(o.lr), "optimizer.lr", f"must be positive, got {o.lr}")
    need(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "optimizer.betas",
         f"must be two numbers in [0, 1), got {o.betas}")
    need(o.eps > 0, "optimizer.eps", f"must be positive, got {o.eps}")
    need(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")

    recipe.train_sources()  # validates data.train
    need(recipe.data.num_workers >= 0, "data.num_workers", f"must be >= 0, got {recipe.data.num_workers}")

    need(e.interval >= 0, "eval.interval", f"must be >= 0, got {e.interval}")
    need(e.num_batches > 0, "eval.num_batches", f"must be positive, got {e.num_batches}")
    need(len(e.length_multipliers) > 0 and all(m >= 1 for m in e.length_multipliers),
         "eval.length_multipliers", f"must be a non-empty list of integers >= 1, got {e.length_multipliers}")
    if e.micro_batch_size is not None:
        need(e.micro_batch_size > 0, "eval.micro_batch_size", f"must be positive, got {e.micro_batch_size}")

    le = recipe.lm_eval
    need(le.interval >= 0, "lm_eval.interval", f"must be >= 0, got {le.interval}")
    need(le.batch_size > 0, "lm_eval.batch_size", f"must be positive, got {le.batch_size}")
    need(bool(le.tasks) or not (le.interval or le.at_end), "lm_eval.tasks", "must name at least one task")
    if le.limit is not None:
        need(le.limit > 0 and (le.limit < 1 or float(le.limit).is_integer()), "lm_eval.limit",
             f"must be a count or a fraction below 1, got {le.limit}")

    need(c.interval >= 0, "checkpoint.interval", f"must be >= 0, got {c.interval}")
    need(c.keep_last >= 1, "checkpoint.keep_last", f"must be >= 1, got {c.keep_last}")
    need(lg.interval >= 1, "logging.interval", f"must be >= 1, got {lg.interval}")
    if lg.peak_flops is not None:
        need(lg.peak_flops > 0, "logging.peak_flops", f"must be positive, got {lg.peak_flops}")
    if d.devices is not None:
        need(d.devices >= 1, "distributed.devices", f"must be >= 1, got {d.devices}")
    if d.num_nodes is not None:
        need(d.num_nodes >= 1, "distributed.num_nodes", f"must be >= 1, got {d.num_nodes}")
    need(d.timeout_minutes >= 1, "distributed.timeout_minutes", f"must be >= 1, got {d.timeout_minutes}")
    if d.timeout_seconds is not None:
        need(d.timeout_seconds >= 10, "distributed.timeout_seconds", f"must be >= 10, got {d.timeout_seconds}")
    if d.replicas is not None:
        need(d.replicas >= 1, "distributed.replicas", f"must be >= 1, got {d.replicas}")
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(recipe, section), key)
        need(value in choices, f"{section}.{key}", f"must be one of {', '.join(choices)}; got {value!r}")


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------

def section_fields(section: str) -> dict[str, dataclasses.Field]:
    cls = Config if section == "model" else SECTIONS[section]
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def load_recipe(config: str, overrides: Optional[dict[str, str]] = None, out_dir: Optional[str] = None) -> Recipe:
    """Read the named config ``<config>`` (or a YAML path) and apply ``--section.key`` text overrides.

    ``overrides`` maps ``"section.key"`` to the text given on the command line. Raises ValueError naming
    the key for an unknown section or key, a value of the wrong type or out of range.
    """
    path = find_config_file(config)
    data = load_yaml(path)
    unknown = sorted(set(data) - set(SECTIONS) - {"model"})
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)}; "
                         f"valid sections: model, {', '.join(SECTIONS)}")
    if "model" not in data:
        raise ValueError(f"{path}: no 'model' section")

    by_section: dict[str, dict[str, Any]] = {}
    for dotted, raw in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS and section != "model":
            raise ValueError(f"--{dotted}: unknown section {section!r}; valid sections: model, {', '.join(SECTIONS)}")
        fields = section_fields(section)
        if key not in fields:
            raise ValueError(f"--{dotted}: unknown key {key!r} in section {section!r}; "
                             f"valid keys: {', '.join(sorted(fields))}")
        hint = typing.get_type_hints(Config if section == "model" else SECTIONS[section])[key]
        by_section.setdefault(section, {})[key] = parse_text_value(raw, hint, f"--{dotted}")

    model = Config.from_name(str(path), **by_section.get("model", {}))
    if model.name == path.stem and not Path(config).suffix:
        model.name = config
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        raw_section = data.get(name) or {}
        where = f"{path}: {name}"
        if not isinstance(raw_section, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(raw_section).__name__}")
        merged = _coerce_section(cls, raw_section, where)
        merged.update(by_section.get(name, {}))
        sections[name] = dataclass_from_dict(cls, merged, where)
    name = Path(config).stem if Path(config).suffix in (".yaml", ".yml") else config
    recipe = Recipe(config_name=name, model=model, out_dir=out_dir or str(Path("out") / name), **sections)
    _validate(recipe)
    return recipe


# --------------------------------------------------------------------------------------------------
# the plan: what follows from the recipe and the world size
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainPlan:
    world_size: int
    block_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    tokens_per_step: int
    max_steps: int
    warmup_steps: int
    min_lr: float


def make_plan(recipe: Recipe, world_size: int) -> TrainPlan:
    """Gradient accumulation, step counts and warmup for ``world_size`` data-parallel ranks.

    Raises ValueError when ``train.global_batch_size`` is not a multiple of
    ``train.micro_batch_size x world_size``.
    """
    t = recipe.train
    per_pass = t.micro_batch_size * world_size
    if t.global_batch_size % per_pass != 0:
        raise ValueError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size}) x world size ({world_size}) = {per_pass}")
    block = recipe.model.block_size
    tokens_per_step = t.global_batch_size * block
    if t.max_steps is not None:
        max_steps = t.max_steps
    else:
        max_steps = max(1, math.ceil(t.max_tokens / tokens_per_step))
    warmup = t.warmup_steps if t.warmup_steps is not None else round(t.warmup_fraction * max_steps)
    return TrainPlan(
        world_size=world_size, block_size=block, global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, grad_accum_steps=t.global_batch_size // per_pass,
        tokens_per_step=tokens_per_step, max_steps=max_steps, warmup_steps=min(warmup, max_steps),
        min_lr=recipe.optimizer.lr * t.min_lr_ratio)


# --------------------------------------------------------------------------------------------------
# --help
# --------------------------------------------------------------------------------------------------

# What a null default stands for, as --help shows it.
_NULL_MEANS = {
    ("eval", "micro_batch_size"): lambda r: f"train.micro_batch_size = {r.train.micro_batch_size}" if r
    else "train.micro_batch_size",
    ("optimizer", "fused"): lambda r: "true on CUDA, false on CPU",
    ("checkpoint", "dir"): lambda r: f"{r.checkpoint_dir}" if r else "<out_dir>/checkpoints",
    ("lm_eval", "tokenizer"): lambda r: "the tokenizer.model of the training data",
    ("logging", "peak_flops"): lambda r: "from the device name",
    ("distributed", "devices"): lambda r: "from SLURM / torchrun, else every GPU (1 on CPU)",
    ("distributed", "num_nodes"): lambda r: "from SLURM / torchrun, else 1",
    ("distributed", "timeout_seconds"): lambda r: "distributed.timeout_minutes",
}


def options_help(recipe: Optional[Recipe] = None) -> str:
    """Every ``--section.key`` with type, default (or the named config's value) and meaning; a null
    default says what it stands for."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"\n{section}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if recipe is not None:
                default = getattr(getattr(recipe, section), f.name)
            elif f.default is not dataclasses.MISSING:
                default = f.default
            else:
                default = f.default_factory()  # type: ignore[misc]
            null = _NULL_MEANS[(section, f.name)](recipe) if (section, f.name) in _NULL_MEANS else None
            lines += describe_option(f"--{section}.{f.name}", hints[f.name], default, f.metadata.get("help", ""),
                                     null, _CHOICES.get((section, f.name)))
    lines.append("\nmodel:")
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        default = getattr(recipe.model, f.name) if recipe is not None else f.default
        lines.append(describe_option(f"--model.{f.name}", hints[f.name], default, "")[0])
    lines.append("      (architecture keys: see gdn2/config.py; changing them makes a checkpoint incompatible)")
    return "\n".join(lines)
