"""Evaluate a checkpoint with the lm-eval harness; write results as JSON and as a Markdown table.

    python -m gdn2 eval --checkpoint out/run/final/model.pt \\
        --tasks wikitext,lambada_openai,piqa,hellaswag,winogrande,arc_easy,arc_challenge,openbookqa,social_iqa,boolq \\
        [--limit N] [--include_path my_tasks/] [--batch_size 32] [--output DIR]

    python -m gdn2 eval --checkpoint out/run/checkpoints --tasks gdn2_local     # offline local tasks
    python -m gdn2 eval --print_include_path   # gdn2's task folder, for lm-eval's own --include_path

Writes ``DIR/results-step-<N>.json`` (the checkpoint and the step it holds, summary, lm-eval's
per-task results and configuration) and ``DIR/results-step-<N>.md`` (the paper's row, then every
metric), ``N`` being the training step of the checkpoint scored, so runs on other checkpoints never
overwrite each other; tasks scored again on the same step replace their earlier results, other tasks
are kept. The average is the paper's: LAMBADA acc and eight reasoning accuracies (acc_norm for
HellaSwag, ARC-Challenge and OpenBookQA), reported only when all nine tasks ran. ``--limit`` results
are not comparable with the paper's.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from gdn2.commandline import option, parse_options
from gdn2.eval.paper_tables import niah_metadata, niah_window, paper_tables
from gdn2.eval.results import REFERENCE_AVERAGE, summarize

# Columns of the paper's table: (header, task/metric key, scale).
PAPER_COLUMNS = [
    ("Wiki ppl", "wikitext/word_perplexity", 1.0),
    ("LMB ppl", "lambada_openai/perplexity", 1.0),
    ("LMB acc", "lambada_openai/acc", 100.0),
    ("PIQA acc", "piqa/acc", 100.0),
    ("Hella acc_n", "hellaswag/acc_norm", 100.0),
    ("Wino acc", "winogrande/acc", 100.0),
    ("ARC-e acc", "arc_easy/acc", 100.0),
    ("ARC-c acc_n", "arc_challenge/acc_norm", 100.0),
    ("OBQA acc_n", "openbookqa/acc_norm", 100.0),
    ("SIQA acc", "social_iqa/acc", 100.0),
    ("BoolQ acc", "boolq/acc", 100.0),
    ("Avg", "avg", 100.0),
]


def _fmt(value: Optional[float], scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return f"{value * scale:.2f}"


def markdown_table(summary: dict[str, float], title: str) -> str:
    """The paper-style row (when any of its tasks ran) followed by every task's metrics."""
    lines = [f"# {title}", ""]
    if any(key in summary for _, key, _ in PAPER_COLUMNS):
        lines += ["| " + " | ".join(h for h, _, _ in PAPER_COLUMNS) + " |",
                  "|" + "---|" * len(PAPER_COLUMNS),
                  "| " + " | ".join(_fmt(summary.get(k), s) for _, k, s in PAPER_COLUMNS) + " |", ""]
        missing = [t for t in REFERENCE_AVERAGE if not any(k.startswith(t + "/") for k in summary)]
        if missing:
            lines += [f"Avg needs all nine tasks; missing: {', '.join(missing)}.", ""]
    lines += ["| task | metric | value |", "|---|---|---|"]
    for key in sorted(k for k in summary if "/" in k):
        task, metric = key.split("/", 1)
        lines.append(f"| {task} | {metric} | {summary[key]:.4f} |")
    if "avg" in summary:
        lines.append(f"| avg (the paper's nine tasks) | acc | {summary['avg']:.4f} |")
    return "\n".join(lines) + "\n"


def _jsonable(obj: Any) -> Any:
    """lm-eval results hold numpy scalars, dtypes and callables: keep what JSON can say."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    return str(obj)


def parse_limit(value: Optional[float]) -> Optional[float]:
    """``--limit``: a count (an integer >= 1) or a fraction below 1."""
    if value is None:
        return None
    number = float(value)
    if number <= 0 or (number >= 1 and number != int(number)):
        raise ValueError(f"--limit: must be a count or a fraction below 1, got {value}")
    return int(number) if number >= 1 else number


def default_output(checkpoint: Path) -> Path:
    """``<run>/eval`` for a checkpoint of a run folder (``<run>/checkpoints/step-<N>``, or
    ``<run>/final/model.pt``); else an ``eval`` folder beside the checkpoint."""
    folder = checkpoint.parent if checkpoint.is_file() else checkpoint
    if re.fullmatch(r"step-\d+", folder.name):
        folder = folder.parent
    if folder.name in ("checkpoints", "final"):
        folder = folder.parent
    return folder / "eval"


def results_name(step: Optional[int], checkpoint: Path) -> str:
    return f"results-step-{step:09d}" if step is not None else f"results-{checkpoint.stem}"


def merge_earlier(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Earlier results of the same checkpoint in ``path``: tasks not scored now are kept."""
    if not path.is_file():
        return record
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError:
        return record
    if earlier.get("checkpoint") != record["checkpoint"]:
        return record
    for key in ("results", "groups", "n-samples", "versions"):
        record[key] = {**(earlier.get(key) or {}), **record[key]}
    record["tasks"] = list(dict.fromkeys(list(earlier.get("tasks") or []) + record["tasks"]))
    record["summary"] = summarize({"results": record["results"], "groups": record["groups"]})
    return record


@dataclass(kw_only=True)
class EvalOptions:
    checkpoint: Optional[str] = option(None, "consolidated model.pt, a training checkpoint folder, or a folder of "
                                             "them (the newest)", meaning_of_null="required, unless --print_include_path")
    tasks: Optional[str] = option(None, "comma-separated lm-eval task or group names",
                                  meaning_of_null="required, unless --print_include_path")
    print_include_path: bool = option(False, "print the folder of gdn2's task files (lm-eval's --include_path for "
                                             "them) and exit")
    config: Optional[str] = option(None, "config name or YAML path", meaning_of_null="saved with the checkpoint")
    tokenizer: Optional[str] = option(None, "tokenizer.model", meaning_of_null="the run's own, found beside the "
                                                                              "checkpoint or its data")
    allow_tokenizer_mismatch: bool = option(False, "score with --tokenizer even when it is not the tokenizer the "
                                                   "checkpoint's run recorded (its sha256 differs)")
    limit: Optional[float] = option(None, "examples per task: a count, or a fraction below 1", meaning_of_null="all")
    include_path: Optional[str] = option(None, "folder of extra task YAMLs (gdn2's own tasks are always available)")
    batch_size: str = option("auto", "an integer, or auto (32 on CUDA, 4 on CPU)")
    device: Optional[str] = option(None, "e.g. cuda:0 or cpu", meaning_of_null="cuda when available")
    dtype: str = option("auto", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, ...")
    max_length: Optional[int] = option(None, "longest scored window", meaning_of_null="the config's block_size")
    num_fewshot: Optional[int] = option(None, "few-shot examples", meaning_of_null="each task's own")
    bootstrap_iters: int = option(1000, "bootstrap samples for the standard errors that need them (0 = skip)")
    output: Optional[str] = option(None, "output folder", meaning_of_null="<run>/eval for a run's checkpoint")
    log_samples: bool = option(False, "also write per-example outputs")
    max_seq_lengths: Optional[str] = option(None, "gdn2_niah lengths, e.g. 1024,2048,4096,8192",
                                            meaning_of_null="1024,2048,4096,8192")
    metadata: Optional[str] = option(None, "JSON object of task settings, e.g. gdn2_niah's "
                                           '\'{"num_samples": 100, "seed": 1, "haystack": "held_out/*.jsonl.zst"}\'')
    context_prefix: str = option("eos", "token before every context (none: as lm-eval's hf model on an exported "
                                        "folder)", choices=("eos", "bos", "none"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_options(EvalOptions, list(argv or []), "gdn2 eval", __doc__.split("\n\n")[0])
    if args is None:
        return 0
    if args.print_include_path:
        from gdn2.eval import LOCAL_TASKS

        print(LOCAL_TASKS)
        return 0
    for flag in ("checkpoint", "tasks"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag} is required (gdn2 eval --help lists the options)")
    args.limit = parse_limit(args.limit)

    import lm_eval

    from gdn2.eval.harness import make_task_manager, quiet_local_tasks
    from gdn2.eval.lm import GDN2LM

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty")
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"--checkpoint {checkpoint} does not exist")

    start = time.time()
    metadata = niah_metadata(args.max_seq_lengths, args.metadata)
    lm = GDN2LM(checkpoint=str(checkpoint), config=args.config, tokenizer=args.tokenizer,
                batch_size=args.batch_size, device=args.device, dtype=args.dtype, max_length=args.max_length,
                context_prefix=args.context_prefix, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)
    window = niah_window(tasks, metadata)
    if args.max_length is None and window and window > lm.max_length:
        lm.max_length = window  # NIAH prompts are never cut (the other tasks then see this window too)
    metadata = {"tokenizer": str(lm.tokenizer.path), **metadata}  # the NIAH prompts are sized with it
    manager = make_task_manager(tasks, args.include_path, metadata=metadata)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)} (neither lm-eval's nor gdn2's local tasks"
                         f"{' nor ' + args.include_path if args.include_path else ''})")
    with quiet_local_tasks():
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                                          task_manager=manager, bootstrap_iters=args.bootstrap_iters,
                                          log_samples=args.log_samples)
    if results is None:  # not rank 0
        return 0
    scored = Path(lm.checkpoint_path).resolve()
    output = Path(args.output) if args.output else default_output(scored)
    output.mkdir(parents=True, exist_ok=True)
    name = results_name(lm.checkpoint_step, scored)
    record = {
        "checkpoint": str(scored),
        "step": lm.checkpoint_step,
        "config": lm.config.to_dict(),
        "tokenizer": str(lm.tokenizer.path),
        "tasks": tasks,
        "limit": args.limit,
        "max_length": lm.max_length,
        "metadata": metadata,
        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
        "seconds": round(time.time() - start, 1),
        "summary": summarize(results),
        "results": _jsonable(results.get("results", {})),
        "groups": _jsonable(results.get("groups", {})),
        "n-samples": _jsonable(results.get("n-samples", {})),
        "versions": _jsonable(results.get("versions", {})),
    }
    record = merge_earlier(output / f"{name}.json", record)
    (output / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    if args.log_samples:
        (output / f"{name}-samples.json").write_text(json.dumps(_jsonable(results.get("samples", {})), indent=1) + "\n")
    step = f"step {lm.checkpoint_step}" if lm.checkpoint_step is not None else "step unknown"
    title = f"{scored} ({lm.config.name}, {step})" + (f", limit {args.limit}" if args.limit else "")
    table = markdown_table(record["summary"], title)
    extra = paper_tables({f"{lm.config.name} ({step})": record["summary"]})
    table += "\n" + extra if extra else ""
    (output / f"{name}.md").write_text(table)
    print(table)
    print(f"wrote {output / name}.json and .md")
    return 0


if __name__ == "__main__":  # in a checkout: python eval/run.py ... = python -m gdn2 eval ...
    from gdn2.__main__ import run_script

    run_script("eval")
