"""Compare training runs: tables of their results, a learning-rate sweep, and a picture.

    python -m gdn2 compare out/study/*_seed* --out out/study/compare

Reads what the trainer writes in each run folder (``config.yaml``, ``metrics.jsonl``, ``run.json``)
and, when present, lm-eval results: the trainer's own lm-eval hook (``lm_eval`` records in
``metrics.jsonl``) and ``gdn2 eval`` on the run's last scored checkpoint
(``<run>/eval/results-step-<N>.json``, the highest N), the latter winning where both scored a task.
The learning rate is the run's ``optimizer.lr`` in ``config.yaml``: runs of one config at several
rates are a sweep, runs of one config and rate at several seeds a seed group. Writes

- ``DIR/compare.md``: per config, its best rate (the lowest final validation loss at the training
  length; see :func:`best_rates`) with the steps, tokens per step, tokens and epochs over the training
  data, and the validation loss at every evaluated length (mean over seeds and spread, max - min);
  the sweep (config x rate -> final validation loss) when a config ran at several rates; per run its
  config, rate, seed, block parameters, steps, tokens, epochs, training speed (median tokens/s per
  device over the logged intervals after the first, which holds compilation), MFU, peak memory, final
  training loss (mean over the last logged interval) and final validation loss at every length; then
  the lm-eval metrics and the paper's NIAH and recall tables.
- ``DIR/compare.json``: the same numbers, one record per run.
- ``DIR/compare.png``: validation loss against tokens seen (at the training length) and final
  validation loss against evaluation length, for the runs at each config's best rate; and, when a
  config ran at several rates, final validation loss against learning rate, one line per config.

A run stopped by the trainer for non-finite losses (more than ``train.max_consecutive_nonfinite``
skipped steps in a row) counts as diverged: no final loss, last choice for the best rate.

Runs must share a tokenizer (their losses are otherwise not comparable): the tokenizer recorded in
``run.json`` (from the data's ``manifest.json``) and the vocabulary size must agree.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from gdn2.commandline import option, parse_options
from gdn2.eval.paper_tables import paper_tables


class CompareError(ValueError):
    """A run folder that cannot be compared; the message names it."""


def rate_label(lr: float) -> str:
    """A learning rate as it names run folders and table columns: 3e-4, 1e-3, 1.5e-3."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclass
class Run:
    folder: Path
    name: str
    config_name: str
    model: dict[str, Any]
    recipe: dict[str, Any]
    info: dict[str, Any]
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    lm_eval: dict[str, float] = field(default_factory=dict)
    trailing_skips: int = 0  # skipped steps after the last logged record of any other kind
    last_step: int = 0  # the last step any record names (a skipped step included)

    @property
    def seed(self) -> int:
        return int(self.recipe.get("train", {}).get("seed", 0))

    @property
    def lr(self) -> float:
        """The peak learning rate, ``optimizer.lr`` of the run's config.yaml."""
        return float((self.recipe.get("optimizer") or {}).get("lr", math.nan))

    @property
    def block_size(self) -> int:
        return int(self.model["block_size"])

    @property
    def tokens_per_step(self) -> int:
        return int(self.recipe["train"]["global_batch_size"]) * self.block_size

    @property
    def steps(self) -> int:
        """Optimizer steps done (the last logged step, a skipped one included)."""
        return max([self.last_step] + [int(r["step"]) for r in self.train + self.val])

    @property
    def tokens(self) -> int:
        if not self.train:  # diverged before its first logged step
            return self.steps * self.tokens_per_step
        return int(self.train[-1].get("tokens") or self.train[-1]["step"] * self.tokens_per_step)

    @property
    def training_tokens(self) -> Optional[int]:
        """Tokens of the training data (its manifests, as run.json records them), or None when unknown."""
        sources = (self.info.get("data") or {}).get("train") or []
        counts = [(s.get("tokens") or {}).get("train") for s in sources]
        if not counts or not all(isinstance(c, int) and c > 0 for c in counts):
            return None
        return sum(counts)

    @property
    def epochs(self) -> Optional[float]:
        """Passes over the training data: tokens seen / tokens of the training data."""
        available = self.training_tokens
        return self.tokens / available if available else None

    @property
    def diverged(self) -> bool:
        """Stopped by the trainer for non-finite losses: more skipped steps in a row at the end of its log
        than ``train.max_consecutive_nonfinite`` allows."""
        allowed = int((self.recipe["train"] or {}).get("max_consecutive_nonfinite", 5))
        return self.trailing_skips > allowed

    @property
    def final_train_loss(self) -> Optional[float]:
        return self.train[-1].get("loss") if self.train else None

    def _steady(self, key: str) -> list[float]:
        values = [r[key] for r in self.train if isinstance(r.get(key), (int, float))]
        return values[1:] if len(values) > 1 else values

    @property
    def tokens_per_sec(self) -> Optional[float]:
        values = self._steady("tokens_per_sec_per_device")
        return statistics.median(values) if values else None

    @property
    def mfu(self) -> Optional[float]:
        values = self._steady("mfu")
        return statistics.median(values) if values else None

    @property
    def peak_memory_gib(self) -> Optional[float]:
        values = [r["peak_memory_gib"] for r in self.train if isinstance(r.get("peak_memory_gib"), (int, float))]
        return max(values) if values else None

    @property
    def final_val(self) -> dict[int, float]:
        """Validation loss per evaluated length at the last validation; empty for a diverged run."""
        if not self.val or self.diverged:
            return {}
        return _val_losses(self.val[-1])

    @property
    def final_loss(self) -> float:
        """Final validation loss at the training length; inf when the run diverged, NaN when it has none."""
        if self.diverged:
            return math.inf
        return self.final_val.get(self.block_size, math.nan)

    @property
    def block_parameters(self) -> int:
        if self.info.get("block_parameters"):
            return int(self.info["block_parameters"])
        import torch

        from gdn2.config import Config
        from gdn2.model import GPT

        with torch.device("meta"):
            return GPT(Config.from_dict(dict(self.model))).num_parameters(blocks_only=True)

    @property
    def tokenizer(self) -> tuple[Optional[str], int]:
        """(sha256 of the tokenizer as recorded from the data manifest, or None; vocabulary size)."""
        data = self.info.get("data") or {}
        shas = {d.get("tokenizer_sha256") for d in (data.get("train") or []) + [data.get("val") or {}]}
        shas.discard(None)
        if len(shas) > 1:
            raise CompareError(f"{self.folder}: its training and validation data were made with different "
                               "tokenizers (run.json)")
        return (shas.pop() if shas else None), int(self.model["vocab_size"])


def _val_losses(record: dict[str, Any]) -> dict[int, float]:
    out = {}
    for key, value in record.items():
        if key.startswith("val/loss_") and isinstance(value, (int, float)):
            out[int(key[len("val/loss_"):])] = float(value)
    return dict(sorted(out.items()))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise CompareError(f"{path}: line {number} is not JSON") from None
    return records


def _lm_eval_scores(folder: Path, records: list[dict[str, Any]]) -> dict[str, float]:
    """The trainer hook's last lm-eval scores, updated with those of ``gdn2 eval`` on the run's last scored
    checkpoint (a NIAH suite scored after training sits beside the hook's local tasks)."""
    hook = [r for r in records if r.get("kind") == "lm_eval"]
    scores = {k[len("lm_eval/"):]: float(v) for k, v in (hook[-1].items() if hook else ())
              if k.startswith("lm_eval/") and isinstance(v, (int, float))}
    scored = sorted((folder / "eval").glob("results-step-*.json"))
    if scored:
        path = scored[-1]
        try:
            summary = json.loads(path.read_text()).get("summary") or {}
        except json.JSONDecodeError:
            raise CompareError(f"{path}: not JSON") from None
        scores.update({k: float(v) for k, v in summary.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return scores


def load_run(folder: Path) -> Run:
    """Read one run folder; CompareError naming the file for anything missing or malformed."""
    if not folder.is_dir():
        raise CompareError(f"{folder}: not a folder")
    config_path, metrics_path = folder / "config.yaml", folder / "metrics.jsonl"
    for path in (config_path, metrics_path):
        if not path.is_file():
            raise CompareError(f"{path}: missing (not a run folder written by the trainer?)")
    try:
        recipe = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as error:
        raise CompareError(f"{config_path}: not YAML ({error})".replace("\n", " ")) from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("model"), dict) or "train" not in recipe:
        raise CompareError(f"{config_path}: no model and train sections (not a resolved run config)")
    if not isinstance((recipe.get("optimizer") or {}).get("lr"), (int, float)):
        raise CompareError(f"{config_path}: no optimizer.lr (the learning rate of the run)")
    records = _read_jsonl(metrics_path)
    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("loss"), (int, float))]
    val = [r for r in records if r.get("kind") == "val" and _val_losses(r)]
    last_step = max((int(r.get("step") or 0) for r in records), default=0)
    trailing_skips = 0
    for record in reversed(records):
        if record.get("kind") != "skip":
            break
        trailing_skips += 1
    allowed = int((recipe["train"] or {}).get("max_consecutive_nonfinite", 5))
    if not train and trailing_skips <= allowed:  # a run that diverged at once has only its skipped steps
        raise CompareError(f"{metrics_path}: holds no training metrics")
    info_path = folder / "run.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    model = recipe["model"]
    header = config_path.read_text().split("\n", 1)[0]
    config_name = model.get("name") or header
    return Run(folder=folder, name=folder.name, config_name=str(config_name), model=model, recipe=recipe, info=info,
               train=train, val=val, lm_eval=_lm_eval_scores(folder, records), trailing_skips=trailing_skips,
               last_step=last_step)


def check_comparable(runs: Sequence[Run]) -> None:
    """Runs of different tokenizers (recorded hash or vocabulary size) cannot be compared."""
    first = runs[0]
    sha0, vocab0 = first.tokenizer
    for run in runs[1:]:
        sha, vocab = run.tokenizer
        if vocab != vocab0 or (sha and sha0 and sha != sha0):
            what = f"vocabulary {vocab} vs {vocab0}" if vocab != vocab0 else f"tokenizer {sha[:12]} vs {sha0[:12]}"
            raise CompareError(f"{run.folder}: trained with another tokenizer than {first.folder} ({what}); "
                               "losses of different tokenizers are not comparable")
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise CompareError(f"two run folders share the name {next(n for n in names if names.count(n) > 1)!r}; "
                           "give runs distinct folder names")


# ------------------------------------------------------------------------------------------------
# groups: configs, their rates, their seeds


def by_config(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by config, in the order the configs first appear."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.config_name, []).append(run)
    return groups


def by_rate(runs: Sequence[Run]) -> dict[float, list[Run]]:
    """Runs (of one config) grouped by learning rate, lowest rate first."""
    groups: dict[float, list[Run]] = {}
    for run in sorted(runs, key=lambda r: r.lr):
        groups.setdefault(run.lr, []).append(run)
    return groups


def _ranking_loss(value: float) -> float:
    return math.inf if math.isnan(value) else value


def sweep_losses(runs: Sequence[Run]) -> dict[float, float]:
    """Learning rate -> the loss that ranks it, for the runs of one config: the final validation loss at
    the training length, mean over the seeds that every rate ran with (the sweep's seeds; all of a
    rate's seeds when no seed is common to every rate). Extra seeds trained at one rate after the sweep
    therefore leave the ranking as the sweep made it. inf: diverged, or no final validation."""
    rates = by_rate(runs)
    shared = set.intersection(*({run.seed for run in group} for group in rates.values()))
    losses = {}
    for rate, group in rates.items():
        chosen = [run for run in group if run.seed in shared] or group
        losses[rate] = _ranking_loss(statistics.mean(_ranking_loss(run.final_loss) for run in chosen))
    return losses


def best_rates(runs: Sequence[Run]) -> dict[str, float]:
    """Config -> its best learning rate: the lowest :func:`sweep_losses` (ties: the lower rate). A
    config none of whose runs has a final validation loss has none."""
    best = {}
    for config, group in by_config(runs).items():
        losses = sweep_losses(group)
        rate = min(losses, key=lambda r: (losses[r], r))
        if math.isfinite(losses[rate]):
            best[config] = rate
    return best


# ------------------------------------------------------------------------------------------------
# output


def _num(value: Optional[float], digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _int(value: Optional[float]) -> str:
    return "-" if value is None else f"{int(round(value)):,}"


def _lengths(runs: Sequence[Run]) -> list[int]:
    return sorted({length for run in runs for length in run.final_val})


def summary_record(run: Run, best: Optional[float] = None) -> dict[str, Any]:
    """One run's numbers (compare.json); ``best``: its config's best rate, if known."""
    return {"run": run.name, "folder": str(run.folder), "config": run.config_name, "lr": run.lr, "seed": run.seed,
            "best_rate": best is not None and run.lr == best, "block_parameters": run.block_parameters,
            "steps": run.steps, "tokens_per_step": run.tokens_per_step, "tokens": run.tokens,
            "training_tokens": run.training_tokens, "epochs": run.epochs, "diverged": run.diverged,
            "tokens_per_sec_per_device": run.tokens_per_sec, "mfu": run.mfu, "peak_memory_gib": run.peak_memory_gib,
            "device": run.info.get("device"), "final_train_loss": run.final_train_loss,
            "final_val_loss": {str(k): v for k, v in run.final_val.items()}, "lm_eval": run.lm_eval}


def _mean_spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({max(values) - min(values):.3f})"


def _config_table(runs: Sequence[Run], best: dict[str, float], lengths: list[int]) -> list[str]:
    """Per config, at its best rate: recipe facts and the validation loss over its seeds."""
    head = ["config", "rate", "seeds", "steps", "tokens/step", "tokens", "epochs"]
    head += [f"val loss @ {length}" for length in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    edge = False
    for config, group in by_config(runs).items():
        rates = by_rate(group)
        rate = best.get(config, min(rates))
        chosen = rates[rate]
        label = f"`{rate_label(rate)}`"
        if len(rates) > 1 and config not in best:
            label = f"none of {len(rates)}"
        elif len(rates) > 1:
            label += f" (best of {len(rates)})"
            if rate in (min(rates), max(rates)):
                label += " *"
                edge = True
        first = chosen[0]
        epochs = first.epochs
        row = [f"`{config}`", label, ", ".join(str(r.seed) for r in chosen), _int(first.steps),
               _int(first.tokens_per_step), _int(first.tokens), "-" if epochs is None else f"{epochs:.2f}"]
        row += [_mean_spread([r.final_val[length] for r in chosen if length in r.final_val]) for length in lengths]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Validation loss: final, on the same held-out tokens at every length (nats per token); with "
              "several seeds the mean and, in brackets, the spread (largest minus smallest): a difference between "
              "configs smaller than it is not shown to be real. Epochs: tokens seen / tokens of the training data."]
    if any(len(by_rate(group)) > 1 for group in by_config(runs).values()):
        lines += ["Rate: the peak learning rate with the lowest final validation loss at the training length in "
                  "the sweep below" + ("; * marks one at the edge of the sweep, where a rate beyond it may do "
                                       "better." if edge else ".")]
    return lines


def _sweep_table(runs: Sequence[Run], best: dict[str, float]) -> list[str]:
    """Config x learning rate -> the loss that ranked the rate (:func:`sweep_losses`); the best in bold."""
    groups = by_config(runs)
    rates = sorted({run.lr for run in runs})
    lines = ["| config | " + " | ".join(f"lr {rate_label(rate)}" for rate in rates) + " |",
             "|---|" + "---|" * len(rates)]
    seeds: set[int] = set()
    for config, group in groups.items():
        losses = sweep_losses(group)
        present = by_rate(group)
        shared = set.intersection(*({run.seed for run in g} for g in present.values()))
        seeds |= shared
        cells = []
        for rate in rates:
            if rate not in losses:
                cells.append("")
            elif any(run.diverged for run in present[rate]) and math.isinf(losses[rate]):
                cells.append(f"diverged (step {max(run.steps for run in present[rate])})")
            else:
                cell = _num(losses[rate] if math.isfinite(losses[rate]) else None)
                cells.append(f"**{cell}**" if best.get(config) == rate else cell)
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    which = f"seed {', '.join(map(str, sorted(seeds)))}" if seeds else "each rate's seeds"
    lines += ["", f"Final validation loss at the training length ({which}; in bold the best rate of each config)."
              + (" Diverged: stopped by the trainer for non-finite losses." if any(r.diverged for r in runs) else "")]
    return lines


def markdown(runs: Sequence[Run], title: str) -> str:
    lengths = _lengths(runs)
    best = best_rates(runs)
    lines = [f"# {title}", "", "## Per config", ""] + _config_table(runs, best, lengths)
    if any(len(by_rate(group)) > 1 for group in by_config(runs).values()):
        lines += ["", "## Learning-rate sweep", ""] + _sweep_table(runs, best)
    head = ["run", "config", "lr", "seed", "block params", "steps", "tokens", "epochs", "tokens/s", "MFU",
            "peak mem (GiB)", "train loss"]
    head += [f"val loss @ {length}" for length in lengths]
    lines += ["", "## Runs", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        mfu, epochs = run.mfu, run.epochs
        row = [run.name, f"`{run.config_name}`", rate_label(run.lr), str(run.seed), _int(run.block_parameters),
               _int(run.steps), _int(run.tokens), "-" if epochs is None else f"{epochs:.2f}",
               _int(run.tokens_per_sec), "-" if mfu is None else f"{mfu:.1%}", _num(run.peak_memory_gib, 1),
               _num(run.final_train_loss)]
        row += ["diverged" if run.diverged else _num(run.final_val.get(length)) for length in lengths]
        lines.append("| " + " | ".join(row) + " |")
    devices = sorted({str(run.info["device"]) for run in runs if run.info.get("device")})
    lines += ["", "Training loss: mean over the last logged interval. tokens/s: per device, median of the logged "
              "intervals after the first." + (f" Device: {', '.join(devices)}." if devices else "")]
    metrics = sorted({key for run in runs for key in run.lm_eval})
    if metrics:
        lines += ["", "## lm-eval", "", "| run | " + " | ".join(metrics) + " |", "|" + "---|" * (1 + len(metrics))]
        for run in runs:
            if run.lm_eval:
                lines.append(f"| {run.name} | " + " | ".join(_num(run.lm_eval.get(m), 4) for m in metrics) + " |")
    extra = paper_tables({run.name: run.lm_eval for run in runs})
    if extra:
        lines += ["", extra.rstrip("\n")]
    return "\n".join(lines) + "\n"


def figure(runs: Sequence[Run], title: str):
    """The picture of :func:`plot` as a matplotlib Figure: validation loss against training tokens and
    final validation loss against evaluation length (log2 axis; a dotted grey line marks each training
    length, half an octave inside the axis at least), both at each config's best rate, and with a sweep
    the final validation loss against the learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_config(runs)
    best = best_rates(runs)
    swept = any(len(by_rate(group)) > 1 for group in groups.values())
    fig, axes = plt.subplots(1, 3 if swept else 2, figsize=(16.5 if swept else 11, 4.2))
    curve, extrapolation = axes[0], axes[1]
    colors = {name: f"C{index}" for index, name in enumerate(groups)}
    plotted: list[Run] = []
    for config, group in groups.items():
        shown = by_rate(group).get(best.get(config, min(r.lr for r in group)), [])
        plotted += shown
        for index, run in enumerate(shown):
            dashes = "solid" if index == 0 else (0, (4, 2))
            points = [(r["step"] * run.tokens_per_step / 1e6, _val_losses(r).get(run.block_size)) for r in run.val]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                curve.plot(*zip(*points), color=colors[config], linestyle=dashes, marker=".",
                           label=f"{config} (lr {rate_label(run.lr)})" if index == 0 else None)
            final = sorted(run.final_val.items())
            if final:
                extrapolation.plot([length for length, _ in final], [loss for _, loss in final], color=colors[config],
                                   linestyle=dashes, marker="o", label=f"{config} (seed {run.seed})")
    curve.set_xlabel("training tokens (millions)")
    curve.set_ylabel("validation loss at the training length")
    curve.set_title("validation loss during training" + (" (best rate)" if swept else ""))
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8)
    # the shortest evaluation length is the training length: without room on the left its line would
    # lie on the axis's edge, unseen
    blocks = sorted({run.block_size for run in plotted})
    lengths = blocks + [length for run in plotted for length in run.final_val]
    extrapolation.set_xscale("log", base=2)
    if lengths:
        extrapolation.set_xlim(min(lengths) / 2 ** 0.5, max(lengths) * 2 ** 0.5)
    for block in blocks:
        extrapolation.axvline(block, color="0.4", linestyle=":", linewidth=1.5, zorder=0,
                              label=f"training length ({block} tokens)")
    extrapolation.set_xlabel("evaluation length (tokens)")
    extrapolation.set_ylabel("final validation loss")
    extrapolation.set_title("length extrapolation" + (" (best rate)" if swept else ""))
    extrapolation.grid(alpha=0.3)
    extrapolation.legend(fontsize=7)
    if swept:
        sweep = axes[2]
        for config, group in groups.items():
            losses = sweep_losses(group)
            finite = [(rate, loss) for rate, loss in sorted(losses.items()) if math.isfinite(loss)]
            if finite:
                sweep.plot(*zip(*finite), color=colors[config], marker="o", label=config)
            if config in best:
                sweep.plot([best[config]], [losses[best[config]]], color=colors[config], marker="*", markersize=14)
            for rate in (rate for rate, loss in losses.items() if not math.isfinite(loss)):
                sweep.axvline(rate, color=colors[config], linestyle=":", linewidth=1)
        sweep.set_xscale("log")
        sweep.set_xlabel("peak learning rate (star: best; dotted: diverged)")
        sweep.set_ylabel("final validation loss at the training length")
        sweep.set_title("learning-rate sweep")
        sweep.grid(alpha=0.3)
        sweep.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot(runs: Sequence[Run], path: Path, title: str) -> None:
    """Write :func:`figure` as a PNG."""
    fig = figure(runs, title)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=90)
    plt.close(fig)


def compare(folders: Sequence[str | Path], out: str | Path, title: str = "Training runs compared") -> list[Run]:
    """Read the run folders, check they are comparable, write compare.md / .json / .png into ``out``."""
    if not folders:
        raise CompareError("give at least one run folder")
    runs = [load_run(Path(f)) for f in folders]
    check_comparable(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    best = best_rates(runs)
    (out / "compare.md").write_text(markdown(runs, title))
    (out / "compare.json").write_text(json.dumps([summary_record(run, best.get(run.config_name)) for run in runs],
                                                 indent=1) + "\n")
    plot(runs, out / "compare.png", title)
    return runs


@dataclass(kw_only=True)
class CompareOptions:
    runs: list[str] = option(help="run folders written by the trainer (out/<run>)", positional=True)
    out: str = option(help="folder for compare.md, compare.json and compare.png")
    title: str = option("Training runs compared", "heading of the table and the picture")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_options(CompareOptions, list(argv or []), "gdn2 compare", __doc__.split("\n\n")[0])
    if args is None:
        return 0
    try:
        compare(args.runs, args.out, args.title)
    except CompareError as error:
        print(f"gdn2 compare: error: {error}", file=sys.stderr)
        return 2
    print((Path(args.out) / "compare.md").read_text())
    print(f"wrote {Path(args.out) / 'compare.md'}, compare.json and compare.png")
    return 0


if __name__ == "__main__":  # in a checkout: python eval/compare.py ... = python -m gdn2 compare ...
    from gdn2.__main__ import run_script

    run_script("compare")
