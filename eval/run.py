"""Evaluate a checkpoint with the lm-eval harness; write results as JSON and as a Markdown table.

    python eval/run.py --checkpoint out/run/final.pt \\
        --tasks wikitext,lambada_openai,piqa,hellaswag,winogrande,arc_easy,arc_challenge,openbookqa,social_iqa,boolq \\
        [--limit N] [--include_path eval/tasks] [--batch_size 32] [--output DIR]

    python eval/run.py --checkpoint out/run/final.pt --tasks gdn2_local     # offline smoke run

Writes ``DIR/results.json`` (summary, lm-eval's per-task results and configuration) and
``DIR/results.md`` (the paper-style row of REFERENCE.md section 4, then every metric). The average is
that of the paper: LAMBADA acc and eight reasoning accuracies (acc_norm for HellaSwag, ARC-Challenge
and OpenBookQA); it is reported only when all nine tasks ran. ``--limit`` results are not comparable
with the paper's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from gdn2.evaluation import LOCAL_TASKS, REFERENCE_AVERAGE, GDN2LM, make_task_manager, summarize  # noqa: E402

# Columns of the paper's table (REFERENCE.md section 4): (header, task/metric key, scale).
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
        lines.append(f"| avg (REFERENCE.md section 4) | acc | {summary['avg']:.4f} |")
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


def parse_limit(value: Optional[str]) -> Optional[float]:
    if value is None:
        return None
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"--limit must be positive, got {value}")
    return int(number) if number >= 1 and number == int(number) else number


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="consolidated .pt file or training checkpoint folder")
    parser.add_argument("--config", help="config name or YAML path (default: saved with the checkpoint)")
    parser.add_argument("--tokenizer", help="tokenizer.model (default: found beside the checkpoint)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    parser.add_argument("--limit", type=parse_limit, help="examples per task (int) or fraction (< 1)")
    parser.add_argument("--include_path", default=str(LOCAL_TASKS), help="folder of extra task YAMLs ('' = none)")
    parser.add_argument("--batch_size", default="auto", help="int, or 'auto' (32 on CUDA, 4 on CPU)")
    parser.add_argument("--device", help="e.g. cuda:0 or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, ...")
    parser.add_argument("--max_length", type=int, help="longest scored window (default: the config's block_size)")
    parser.add_argument("--num_fewshot", type=int, help="few-shot examples (default: each task's own, 0 here)")
    parser.add_argument("--bootstrap_iters", type=int, default=1000,
                        help="bootstrap samples for the standard errors that need them (0 = skip)")
    parser.add_argument("--output", help="output folder (default: <checkpoint folder>/eval)")
    parser.add_argument("--log_samples", action="store_true", help="also write per-example outputs")
    args = parser.parse_args(argv)

    import lm_eval

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        parser.error("--tasks is empty")
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        parser.error(f"--checkpoint {checkpoint} does not exist")
    output = Path(args.output) if args.output else (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "eval"
    include = args.include_path or None

    start = time.time()
    lm = GDN2LM(checkpoint=str(checkpoint), config=args.config, tokenizer=args.tokenizer,
                batch_size=args.batch_size, device=args.device, dtype=args.dtype, max_length=args.max_length)
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                                      task_manager=make_task_manager(tasks, include),
                                      bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples)
    if results is None:  # not rank 0
        return 0
    summary = summarize(results)
    output.mkdir(parents=True, exist_ok=True)
    record = {
        "checkpoint": str(checkpoint.resolve()),
        "config": lm.config.to_dict(),
        "tokenizer": str(lm.tokenizer.path),
        "tasks": tasks,
        "limit": args.limit,
        "max_length": lm.max_length,
        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
        "seconds": round(time.time() - start, 1),
        "summary": summary,
        "results": _jsonable(results.get("results", {})),
        "groups": _jsonable(results.get("groups", {})),
        "n-samples": _jsonable(results.get("n-samples", {})),
        "versions": _jsonable(results.get("versions", {})),
    }
    (output / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    if args.log_samples:
        (output / "samples.json").write_text(json.dumps(_jsonable(results.get("samples", {})), indent=1) + "\n")
    title = f"{checkpoint.name} ({lm.config.name})" + (f", limit {args.limit}" if args.limit else "")
    table = markdown_table(summary, title)
    (output / "results.md").write_text(table)
    print(table)
    print(f"wrote {output / 'results.json'} and {output / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
