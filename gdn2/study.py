"""The quality study: several model configs trained on the same tokens in the same order with one recipe,
a learning-rate sweep per config, extra seeds at each config's best rate, the needle-in-a-haystack suite
on request, then ``gdn2 compare`` over the run folders.

    python -m gdn2 study DATA OUT [--models "A B ..."] [--lrs "3e-4 1e-3 3e-3"] [--seeds "3407 1234"]
        [--steps 1000 | --tokens N] [--batch 16] [--niah "1024 2048"] [-- --section.key value ...]

1. The sweep: every config at every rate of ``--lrs`` with the first seed of ``--seeds``.
2. The seeds: once a config's sweep is done, its best rate (the lowest final validation loss at the
   training length, :func:`gdn2.eval.compare.best_rates`) is trained again with each further seed.
3. NIAH (``--niah``): ``gdn2 eval --tasks gdn2_niah`` on the final checkpoint of every best-rate run.
4. ``gdn2 compare`` writes ``OUT/compare/compare.md``, ``.json`` and ``.png`` from the finished runs.

Each run has its folder ``OUT/<config>_lr<rate>_seed<seed>`` and its own trainer process
(``python -m gdn2 pretrain``), so that every run starts from a clean device. A run whose final
checkpoint is there is not trained again, nor one the trainer stopped for non-finite losses (a rate too
high diverges: the sweep records it); an interrupted one continues from its newest checkpoint; NIAH
results already in a run's ``eval/`` are not computed again. So the same command, run again, completes
a study that a time limit (``--wall_time``, a lent machine) or Ctrl-C cut short.

The recipe (AdamW, 10% warmup then cosine to 10%, weight decay 0.1, validation at 1x, 2x and 4x the
context on the whole held-out set, lm-eval tasks at the end) is set here as trainer overrides; any
``--section.key value`` after ``--`` is handed to the trainer and wins over the study's own setting of
that key, except the keys the study's options set (``optimizer.lr`` is ``--lrs``, ...).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from gdn2.checkpoint.format import list_checkpoints
from gdn2.commandline import list_items, option, parse_numbers, parse_options
from gdn2.eval.compare import CompareError, best_rates, compare, load_run, rate_label
from gdn2.eval.paper_tables import NIAH_TASKS

DEFAULT_STEPS = 1000
WARMUP_FRACTION = 0.1
# A run is not started with less time than this left of --wall_time: it would stop before doing anything.
MIN_RUN_SECONDS = 120.0

# Recipe keys an override after -- may not change, and why: the study's options set them (the runs are
# named and found by them), or a finished run is recognised by its final checkpoint in its own folder.
OWN_KEYS = {
    **{key: f"the study sets it from {flag}" for key, flag in (
        ("optimizer.lr", "--lrs"), ("train.seed", "--seeds"), ("train.max_steps", "--steps"),
        ("train.max_tokens", "--tokens"), ("train.global_batch_size", "--batch"),
        ("train.micro_batch_size", "--micro_batch"), ("train.max_wall_time", "--wall_time"))},
    "checkpoint.dir": "each run keeps its checkpoints in its own folder, OUT/<run>/checkpoints",
    "checkpoint.at_end": "the final checkpoint marks a finished run",
}


@dataclass(kw_only=True)
class StudyOptions:
    data: str = option(help="a folder of shards from gdn2 prepare (train_*.bin, val_*.bin) with its "
                            "tokenizer.model", positional=True)
    out: str = option(help="the study folder: one run folder per config, rate and seed, and compare/",
                      positional=True)
    size: str = option("125M", "the configs swa_gdn2_SIZE, gdn2_SIZE and transformer_SIZE")
    models: Optional[str] = option(None, "named configs or YAML paths, separated by spaces or commas",
                                   meaning_of_null="the three of --size")
    lrs: str = option("3e-4 1e-3 3e-3", "peak learning rates, each config trained at every one (the sweep)")
    seeds: str = option("3407 1234", "the first seed runs the sweep; each further one trains every config "
                                     "again at its best rate")
    steps: Optional[int] = option(None, "optimizer steps per run", meaning_of_null=f"{DEFAULT_STEPS}, or from --tokens")
    tokens: Optional[int] = option(None, "training tokens per run, rounded up to whole steps of each config's "
                                         "context (instead of --steps)")
    batch: int = option(16, "sequences per optimizer step")
    micro_batch: int = option(16, "sequences per forward pass (gradient accumulation follows)")
    evals: int = option(10, "validations during training (and one at the end)")
    tasks: str = option("gdn2_local", "lm-eval tasks on each final model, comma-separated ('' skips lm-eval)")
    niah: str = option("", "needle-in-a-haystack lengths scored on each best-rate final model, e.g. "
                           "'1024 2048 4096' ('' skips it)")
    niah_samples: int = option(100, "NIAH samples per task and length")
    niah_haystack: Optional[str] = option(None, "NIAH essay haystack: a text or JSON-lines file or glob",
                                          meaning_of_null="the data's one held-out input file (manifest.json), "
                                                          "else Paul Graham's essays")
    wall_time: Optional[str] = option(None, "stop the study after this long (seconds or HH:MM:SS): the run in "
                                            "progress saves and stops; the same command continues it",
                                      meaning_of_null="no limit")
    dry_run: bool = option(False, "list the runs and what is left to do; train nothing")


DESCRIPTION = """Train each config at each learning rate (the sweep), then the extra seeds at each
config's best rate, score NIAH on request, and compare the runs (OUT/compare/compare.md and .png).
Finished runs are not trained again: the same command continues an unfinished study. After --,
trainer overrides (--section.key value, see gdn2 pretrain --help) win over the study's own settings."""


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the study."""

    config: str  # as given to --models (a name or a YAML path)
    name: str  # the config's name (model.name in the run's config.yaml, as gdn2 compare groups runs)
    lr: float
    seed: int
    steps: int
    block_size: int
    folder: Path

    @property
    def label(self) -> str:
        return self.folder.name

    @property
    def final_checkpoint(self) -> Path:
        return self.folder / "checkpoints" / f"step-{self.steps:09d}"


# --------------------------------------------------------------------------------------------------
# options


def trainer_overrides(argv: Sequence[str]) -> dict[str, str]:
    """The ``--section.key value`` overrides after ``--``; ValueError for anything else there and for a key
    one of the study's options sets."""
    from gdn2.train.cli import split_overrides

    rest, overrides = split_overrides(list(argv))
    if rest:
        raise ValueError(f"after --, only trainer overrides (--section.key value) are accepted; got {rest[0]!r}")
    for key in overrides:
        if key in OWN_KEYS:
            raise ValueError(f"--{key} after --: {OWN_KEYS[key]}")
    return overrides


def check_data(folder: Path, need_tokenizer: bool) -> None:
    if not folder.is_dir():
        raise FileNotFoundError(f"DATA {folder} is not a folder")
    for split in ("train", "val"):
        if not any(folder.glob(f"{split}_*.bin")):
            raise FileNotFoundError(f"DATA {folder} holds no {split}_*.bin shards (python -m gdn2 prepare makes them)")
    if need_tokenizer and not (folder / "tokenizer.model").is_file():
        raise FileNotFoundError(f"{folder / 'tokenizer.model'} is missing (lm-eval and NIAH need it; --tasks '' and "
                                "--niah '' skip them)")


def default_haystack(data: Path) -> Optional[str]:
    """The data's held-out input file (``prepare --val_input``), when its manifest names exactly one that
    still exists: text the models never trained on, in the corpus's own language."""
    manifest = data / "manifest.json"
    if not manifest.is_file():
        return None
    inputs = json.loads(manifest.read_text()).get("inputs") or []
    held_out = [i["path"] for i in inputs if i.get("split") == "val" and Path(i.get("path", "")).is_file()]
    return held_out[0] if len(held_out) == 1 else None


# --------------------------------------------------------------------------------------------------
# the study


class Study:
    """The runs of one study folder, and how to make each (see the module doc)."""

    def __init__(self, options: StudyOptions, overrides: dict[str, str]):
        from gdn2.train.recipe import load_recipe
        from gdn2.train.slurm import parse_duration

        self.options = options
        self.overrides = overrides
        self.data = Path(options.data).resolve()
        self.out = Path(options.out).resolve()
        self.tasks = [t.strip() for t in options.tasks.split(",") if t.strip()]
        self.niah_lengths = parse_numbers(options.niah, "--niah", int) if list_items(options.niah) else []
        check_data(self.data, need_tokenizer=bool(self.tasks or self.niah_lengths))
        if options.steps is not None and options.tokens is not None:
            raise ValueError("give --steps or --tokens, not both")
        for flag, value in (("--steps", options.steps), ("--tokens", options.tokens), ("--batch", options.batch),
                            ("--micro_batch", options.micro_batch), ("--evals", options.evals),
                            ("--niah_samples", options.niah_samples)):
            if value is not None and value < 1:
                raise ValueError(f"{flag}: must be positive, got {value}")
        self.models = list_items(options.models) if options.models is not None else [
            f"{kind}_{options.size}" for kind in ("swa_gdn2", "gdn2", "transformer")]
        if not self.models:
            raise ValueError("--models: give at least one config")
        self.lrs = parse_numbers(options.lrs, "--lrs")
        self.seeds = parse_numbers(options.seeds, "--seeds", int, least=0)
        self.deadline = time.time() + parse_duration(options.wall_time) if options.wall_time else None
        haystack = options.niah_haystack or default_haystack(self.data)
        self.niah_metadata = {"num_samples": options.niah_samples, **({"haystack": haystack} if haystack else {})}
        # every config with the study's settings and the overrides, read and checked before any training
        self.names: dict[str, str] = {}
        self.blocks: dict[str, int] = {}
        for model in self.models:
            block = load_recipe(model, self.overrides).model.block_size
            recipe = load_recipe(model, self.settings(model, self.lrs[0], self.seeds[0], block))
            self.names[model], self.blocks[model] = recipe.model.name, block
        names = list(self.names.values())
        if len(set(names)) != len(names):
            raise ValueError(f"--models: two configs share the name {next(n for n in names if names.count(n) > 1)!r}")

    # ---- the plan

    def steps(self, block: int) -> int:
        if self.options.tokens is not None:
            return max(1, math.ceil(self.options.tokens / (self.options.batch * block)))
        return self.options.steps if self.options.steps is not None else DEFAULT_STEPS

    def planned(self, model: str, lr: float, seed: int) -> PlannedRun:
        name, block = self.names[model], self.blocks[model]
        folder = self.out / f"{name}_lr{rate_label(lr)}_seed{seed}"
        return PlannedRun(config=model, name=name, lr=lr, seed=seed, steps=self.steps(block), block_size=block,
                          folder=folder)

    def settings(self, model: str, lr: float, seed: int, block: int) -> dict[str, str]:
        """The trainer's ``--section.key`` values for one run: the study's recipe, then the overrides."""
        o, steps = self.options, self.steps(block)
        interval = max(1, steps // o.evals)
        own = {
            "data.train": str(self.data), "data.val": str(self.data), "data.prepare_default": "false",
            "train.seed": str(seed), "train.max_steps": str(steps),
            # as a fraction, so that an override of either warmup key after -- takes effect
            "train.warmup_fraction": str(WARMUP_FRACTION), "train.warmup_steps": "null", "train.min_lr_ratio": "0.1",
            "train.global_batch_size": str(o.batch), "train.micro_batch_size": str(o.micro_batch),
            "optimizer.lr": repr(lr), "optimizer.weight_decay": "0.1",
            "eval.interval": str(interval), "eval.length_multipliers": "[1, 2, 4]",
            "eval.num_batches": "100000",  # the whole held-out set: every run is scored on the same tokens
            "eval.micro_batch_size": "16", "eval.at_end": "true",
            "lm_eval.interval": "0", "lm_eval.at_end": "true" if self.tasks else "false",
            # an interrupted run loses at most one validation interval
            "checkpoint.interval": str(interval), "checkpoint.keep_last": "1", "checkpoint.at_end": "true",
            "logging.interval": str(max(1, steps // 100)),
        }
        if self.tasks:
            own["lm_eval.tasks"] = "[" + ", ".join(self.tasks) + "]"
            own["lm_eval.tokenizer"] = str(self.data / "tokenizer.model")
        return {**own, **self.overrides}

    # ---- the state of a run

    def state(self, run: PlannedRun) -> str:
        """'finished', 'diverged', 'partial' (checkpoints to continue from) or 'new'; ValueError when the
        folder holds a run of another length or batch."""
        config = run.folder / "config.yaml"
        if config.is_file():
            import yaml

            train = (yaml.safe_load(config.read_text()) or {}).get("train") or {}
            planned = {"max_steps": run.steps, "global_batch_size": self.options.batch}
            for key, value in planned.items():
                if train.get(key) not in (None, value):
                    raise ValueError(f"{run.folder} holds a run with train.{key} {train.get(key)}, this study plans "
                                     f"{value}: give the study another OUT folder")
        done = [step for step, _ in list_checkpoints(run.folder / "checkpoints")]
        if run.steps in done:
            return "finished"
        if self._diverged(run):
            return "diverged"
        return "partial" if done else "new"

    @staticmethod
    def _diverged(run: PlannedRun) -> bool:
        try:
            return load_run(run.folder).diverged
        except CompareError:
            return False

    # ---- doing

    def time_left(self) -> Optional[float]:
        return None if self.deadline is None else self.deadline - time.time()

    def train(self, run: PlannedRun) -> bool:
        """Make sure ``run`` is done (finished or diverged); False when it stopped before (the wall-time
        budget, a signal): the study stops there."""
        state = self.state(run)
        if state in ("finished", "diverged"):
            print(f"== {run.label}: {state} earlier, not trained again", flush=True)
            return True
        left = self.time_left()
        if left is not None and left < MIN_RUN_SECONDS:
            print(f"== {run.label}: not started, --wall_time is spent", flush=True)
            return False
        settings = self.settings(run.config, run.lr, run.seed, run.block_size)
        if left is not None:
            settings["train.max_wall_time"] = str(int(left))
        command = [sys.executable, "-m", "gdn2", "pretrain", "--config", run.config, "--out_dir", str(run.folder)]
        if state == "partial":
            command += ["--resume", "auto"]
        for key, value in settings.items():
            command += [f"--{key}", value]
        how = "continuing from its newest checkpoint" if state == "partial" else "training"
        print(f"== {run.label}: {how}: {run.steps} steps of {self.options.batch} x {run.block_size} tokens, "
              f"lr {rate_label(run.lr)}, seed {run.seed}", flush=True)
        started = time.time()
        status = _call(command)
        minutes = (time.time() - started) / 60
        state = self.state(run)
        if state == "diverged":
            print(f"== {run.label}: diverged (the trainer stopped on non-finite losses); the sweep records it",
                  flush=True)
            return True
        if status != 0:
            raise ValueError(f"{run.folder}: the trainer stopped with exit status {status} (its output above says "
                             "why); the same command continues the study once that is fixed")
        if state != "finished":
            print(f"== {run.label}: stopped before its last step after {minutes:.1f} min; the same command "
                  "continues it", flush=True)
            return False
        print(f"== {run.label}: finished in {minutes:.1f} min", flush=True)
        return True

    def niah_done(self, run: PlannedRun) -> bool:
        path = run.folder / "eval" / f"results-step-{run.steps:09d}.json"
        if not path.is_file():
            return False
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            return False
        summary, metadata = record.get("summary") or {}, record.get("metadata") or {}
        same = all(metadata.get(key) == value for key, value in self.niah_metadata.items())
        return same and all(f"{task}/{length}" in summary for _, task in NIAH_TASKS for length in self.niah_lengths)

    def score_niah(self, run: PlannedRun) -> None:
        if self.niah_done(run):
            print(f"== {run.label}: NIAH scored earlier, not again", flush=True)
            return
        haystack = self.niah_metadata.get("haystack", "Paul Graham's essays")
        print(f"== {run.label}: NIAH at {', '.join(map(str, self.niah_lengths))} tokens, "
              f"{self.options.niah_samples} samples per task and length, haystack {haystack}", flush=True)
        command = [sys.executable, "-m", "gdn2", "eval", "--checkpoint", str(run.final_checkpoint),
                   "--tasks", "gdn2_niah", "--max_seq_lengths", ",".join(map(str, self.niah_lengths)),
                   "--metadata", json.dumps(self.niah_metadata), "--tokenizer", str(self.data / "tokenizer.model")]
        status = _call(command)
        if status != 0:
            raise ValueError(f"{run.folder}: gdn2 eval (NIAH) stopped with exit status {status} (its output above says "
                             "why)")

    def best_rate(self, model: str, sweep: list[PlannedRun]) -> Optional[float]:
        """The config's best rate once every run of its sweep is done, else None."""
        runs = [run for run in sweep if run.config == model]
        if any(self.state(run) not in ("finished", "diverged") for run in runs):
            return None
        return best_rates([load_run(run.folder) for run in runs]).get(self.names[model])

    def run(self) -> int:
        first, extra = self.seeds[0], self.seeds[1:]
        sweep = [self.planned(model, lr, first) for model in self.models for lr in self.lrs]
        if self.options.dry_run:
            return self.show(sweep)
        self.out.mkdir(parents=True, exist_ok=True)
        going = all(self.train(run) for run in sweep)  # all() stops at the first run that stopped early
        seeded: list[PlannedRun] = []
        without_best = 0  # configs whose every rate diverged: they get no extra seeds
        for model in self.models if going else []:
            best = self.best_rate(model, sweep)
            if best is None:
                print(f"== {self.names[model]}: every rate diverged; no extra seeds", flush=True)
                without_best += 1
                continue
            if len(self.lrs) > 1:
                print(f"== {self.names[model]}: best rate {rate_label(best)}", flush=True)
            seeded += [self.planned(model, best, seed) for seed in extra]
        going = going and all(self.train(run) for run in seeded)
        done = [run for run in sweep + seeded if self.state(run) in ("finished", "diverged")]
        best = best_rates([load_run(run.folder) for run in done]) if done else {}
        for run in done if self.niah_lengths and going else []:
            left = self.time_left()
            if left is not None and left <= 0:
                print("== NIAH not scored: --wall_time is spent", flush=True)
                going = False
                break
            if best.get(run.name) == run.lr and self.state(run) == "finished":
                self.score_niah(run)
        if done:
            order = {model: index for index, model in enumerate(self.models)}
            done.sort(key=lambda r: (order[r.config], r.lr, self.seeds.index(r.seed)))
            compare([run.folder for run in done], self.out / "compare", self.title())
            print(f"== compared {len(done)} runs: {self.out / 'compare' / 'compare.md'} and compare.png", flush=True)
        planned = len(sweep) + len(extra) * (len(self.models) - without_best)
        if going and len(done) == planned:
            print(f"== the study is complete: {planned} runs", flush=True)
        else:
            print(f"== {len(done)} of {planned} runs done; the same command continues the study", flush=True)
        return 0

    def show(self, sweep: list[PlannedRun]) -> int:
        """--dry_run: every run with its state; the extra seeds once their config's best rate is known."""
        for run in sweep:
            print(f"{run.label}: {self.state(run)}")
        for model in self.models:
            best = self.best_rate(model, sweep)
            for seed in self.seeds[1:]:
                if best is None:
                    print(f"{self.names[model]}, seed {seed}: after the sweep of {self.names[model]}, at its best rate")
                else:
                    run = self.planned(model, best, seed)
                    print(f"{run.label}: {self.state(run)}")
        return 0

    def title(self) -> str:
        o = self.options
        length = (f"{o.tokens:,} tokens" if o.tokens is not None
                  else f"{o.steps or DEFAULT_STEPS} steps of {o.batch} x context")
        rates = ", ".join(map(rate_label, self.lrs))
        return f"{self.data.name}: {length} per run; lr {rates}; seeds {', '.join(map(str, self.seeds))}"


def _call(command: list[str]) -> int:
    """Run a gdn2 command as a child process and wait for it. Ctrl-C reaches the child too, which saves and
    stops; this process waits for that instead of killing it, then stops as well."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen(command, env=env)
    interrupted = False
    while True:
        try:
            status = child.wait()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv or [])
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    options = parse_options(StudyOptions, own, "gdn2 study", DESCRIPTION)
    if options is None:
        return 0
    return Study(options, trainer_overrides(extra)).run()
