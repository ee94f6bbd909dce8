"""Compare training runs: one table row per run and a picture of their validation losses.

    python -m gdn2 compare out/swa_gdn2_125M out/gdn2_125M out/transformer_125M --out study/

Reads what the trainer writes in each run folder (``config.yaml``, ``metrics.jsonl``, ``run.json``)
and, when present, the lm-eval results of ``gdn2 eval`` on the run's last scored checkpoint
(``<run>/eval/results-step-<N>.json``, the highest N) or of the trainer's own lm-eval hook
(``lm_eval`` records in ``metrics.jsonl``). Writes

- ``DIR/compare.md``: per run its config, seed, block parameters, tokens seen, training speed
  (median tokens/s per device over the logged intervals after the first, which holds compilation),
  MFU, peak memory, final training loss (mean over the last logged interval) and final validation
  loss at every evaluated length; where a config ran with several seeds, the mean and the spread
  (max - min) per config; then the lm-eval metrics.
- ``DIR/compare.json``: the same numbers.
- ``DIR/compare.png``: validation loss against tokens seen (at the training length) for every run,
  and final validation loss against evaluation length, which shows how each architecture does
  past the context it was trained on.

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

    @property
    def seed(self) -> int:
        return int(self.recipe.get("train", {}).get("seed", 0))

    @property
    def tokens_per_step(self) -> int:
        return int(self.recipe["train"]["global_batch_size"]) * int(self.model["block_size"])

    @property
    def tokens(self) -> int:
        return int(self.train[-1].get("tokens") or self.train[-1]["step"] * self.tokens_per_step)

    @property
    def final_train_loss(self) -> Optional[float]:
        return self.train[-1].get("loss")

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
        """Validation loss per evaluated length at the last validation."""
        if not self.val:
            return {}
        return _val_losses(self.val[-1])

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
    scored = sorted((folder / "eval").glob("results-step-*.json"))
    if scored:
        path = scored[-1]
        try:
            summary = json.loads(path.read_text()).get("summary") or {}
        except json.JSONDecodeError:
            raise CompareError(f"{path}: not JSON") from None
        return {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    hook = [r for r in records if r.get("kind") == "lm_eval"]
    if not hook:
        return {}
    return {k[len("lm_eval/"):]: float(v) for k, v in hook[-1].items()
            if k.startswith("lm_eval/") and isinstance(v, (int, float))}


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
    records = _read_jsonl(metrics_path)
    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("loss"), (int, float))]
    if not train:
        raise CompareError(f"{metrics_path}: holds no training metrics")
    val = [r for r in records if r.get("kind") == "val" and _val_losses(r)]
    info_path = folder / "run.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    model = recipe["model"]
    header = config_path.read_text().split("\n", 1)[0]
    config_name = model.get("name") or header
    return Run(folder=folder, name=folder.name, config_name=str(config_name), model=model, recipe=recipe, info=info,
               train=train, val=val, lm_eval=_lm_eval_scores(folder, records))


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
# output


def _num(value: Optional[float], digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _int(value: Optional[float]) -> str:
    return "-" if value is None else f"{int(round(value)):,}"


def _lengths(runs: Sequence[Run]) -> list[int]:
    return sorted({length for run in runs for length in run.final_val})


def summary_record(run: Run) -> dict[str, Any]:
    return {"run": run.name, "folder": str(run.folder), "config": run.config_name, "seed": run.seed,
            "block_parameters": run.block_parameters, "tokens": run.tokens, "steps": run.train[-1]["step"],
            "tokens_per_sec_per_device": run.tokens_per_sec, "mfu": run.mfu, "peak_memory_gib": run.peak_memory_gib,
            "device": run.info.get("device"), "final_train_loss": run.final_train_loss,
            "final_val_loss": {str(k): v for k, v in run.final_val.items()}, "lm_eval": run.lm_eval}


def by_config(runs: Sequence[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.config_name, []).append(run)
    return groups


def markdown(runs: Sequence[Run], title: str) -> str:
    lengths = _lengths(runs)
    head = ["run", "config", "seed", "block params", "tokens", "tokens/s", "MFU", "peak mem (GiB)", "train loss"]
    head += [f"val loss @ {length}" for length in lengths]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        mfu = run.mfu
        row = [run.name, f"`{run.config_name}`", str(run.seed), _int(run.block_parameters), _int(run.tokens),
               _int(run.tokens_per_sec), "-" if mfu is None else f"{mfu:.1%}", _num(run.peak_memory_gib, 1),
               _num(run.final_train_loss)]
        row += [_num(run.final_val.get(length)) for length in lengths]
        lines.append("| " + " | ".join(row) + " |")
    devices = sorted({str(run.info["device"]) for run in runs if run.info.get("device")})
    lines += ["", "Training loss: mean over the last logged interval. Validation loss: at the last validation, on "
              "the same held-out tokens at every length (nats per token). tokens/s: per device, median of the "
              "logged intervals after the first." + (f" Device: {', '.join(devices)}." if devices else "")]
    groups = {name: group for name, group in by_config(runs).items() if len(group) > 1}
    if groups:
        lines += ["", "## Across seeds", "", "| config | seeds | " +
                  " | ".join(f"val loss @ {length} (mean, spread)" for length in lengths) + " |",
                  "|" + "---|" * (2 + len(lengths))]
        for name, group in groups.items():
            cells = []
            for length in lengths:
                values = [r.final_val[length] for r in group if length in r.final_val]
                cells.append(f"{statistics.mean(values):.3f} ({max(values) - min(values):.3f})" if values else "-")
            lines.append(f"| `{name}` | {', '.join(str(r.seed) for r in group)} | " + " | ".join(cells) + " |")
        lines += ["", "Spread: largest minus smallest final validation loss over the seeds of a config; a "
                  "difference between configs smaller than it is not shown to be real."]
    metrics = sorted({key for run in runs for key in run.lm_eval})
    if metrics:
        lines += ["", "## lm-eval", "", "| run | " + " | ".join(metrics) + " |", "|" + "---|" * (1 + len(metrics))]
        for run in runs:
            lines.append(f"| {run.name} | " + " | ".join(_num(run.lm_eval.get(m), 4) for m in metrics) + " |")
    extra = paper_tables({run.name: run.lm_eval for run in runs})
    if extra:
        lines += ["", extra.rstrip("\n")]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, extrapolation) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {}
    for index, name in enumerate(by_config(runs)):
        styles[name] = f"C{index}"
    seen_labels: set[str] = set()
    for run in runs:
        block = int(run.model["block_size"])
        points = [(r["step"] * run.tokens_per_step / 1e6, _val_losses(r).get(block)) for r in run.val]
        points = [(x, y) for x, y in points if y is not None]
        label = run.config_name if run.config_name not in seen_labels else None
        seen_labels.add(run.config_name)
        dashes = (0, (4, 2)) if run is not by_config(runs)[run.config_name][0] else "solid"
        if points:
            curve.plot(*zip(*points), color=styles[run.config_name], linestyle=dashes, marker=".", label=label)
        final = sorted(run.final_val.items())
        if final:
            extrapolation.plot([length for length, _ in final], [loss for _, loss in final], color=styles[run.config_name],
                               linestyle=dashes, marker="o", label=f"{run.config_name} (seed {run.seed})")
            extrapolation.axvline(block, color="0.8", linewidth=0.8, zorder=0)
    curve.set_xlabel("training tokens (millions)")
    curve.set_ylabel("validation loss at the training length")
    curve.set_title("validation loss during training")
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8)
    extrapolation.set_xscale("log", base=2)
    extrapolation.set_xlabel("evaluation length (tokens); grey line: training length")
    extrapolation.set_ylabel("final validation loss")
    extrapolation.set_title("length extrapolation")
    extrapolation.grid(alpha=0.3)
    extrapolation.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
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
    (out / "compare.md").write_text(markdown(runs, title))
    (out / "compare.json").write_text(json.dumps([summary_record(run) for run in runs], indent=1) + "\n")
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
