"""Speed of the NIAH suite (``gdn2_niah``) through gdn2's lm-eval model: samples/s per task and length.

The requests of one task and length go through ``GDN2LM.generate_until`` together, as lm-eval hands
them over: sorted longest first, prefilled in batches of ``--batch_size`` as packed documents (nothing
padded), then decoded with the cache, 128 greedy tokens (``--tokens_to_generate``) unless EOS comes
first. Generating the samples (the tokenizer search for the largest haystack that fits) is timed
apart. Scores are printed too: a random model scores about 0.

    PYTHONPATH=. python bench/niah.py --checkpoint out/run/final/model.pt            # the paper's lengths
    PYTHONPATH=. python bench/niah.py --config swa_gdn2_tiny --max_seq_lengths 512,1024 --num_samples 8

Without ``--checkpoint`` the named ``--config`` is freshly initialised (seed 0) and ``--tokenizer``
(default ``data/default/tokenizer.model``, made by ``python -m gdn2 corpus --output data/default``)
sizes the prompts; on a CPU the tiny configs run the same code path as a GPU. Prints a table and
writes JSON to ``$OUT/niah_bench.json`` (``./bench_out`` when OUT is unset).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gdn2.eval.lm import GDN2LM  # noqa: E402
from gdn2.eval.tasks.gdn2_niah import niah  # noqa: E402


def build_lm(args: argparse.Namespace, window: int) -> GDN2LM:
    """The lm-eval model over ``--checkpoint``, or over a fresh ``--config`` with ``--tokenizer``."""
    common = dict(batch_size=args.batch_size, device=args.device, max_length=window)
    if args.checkpoint:
        return GDN2LM(checkpoint=args.checkpoint, dtype=args.dtype, **common)
    from gdn2.checkpoint.load import parse_dtype
    from gdn2.config import Config
    from gdn2.model import GPT
    from gdn2.tokenizer import Tokenizer

    tokenizer_path = Path(args.tokenizer)
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"--tokenizer {tokenizer_path} does not exist (python -m gdn2 corpus --output "
                                "data/default makes the default one)")
    tokenizer = Tokenizer(tokenizer_path)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    config = Config.from_name(args.config, vocab_size=max(tokenizer.vocab_size, Config.from_name(args.config).vocab_size))
    model = GPT(config).to(device=device, dtype=parse_dtype(args.dtype, device)).eval()
    return GDN2LM(model=model, tokenizer=tokenizer, **common)


def run_cell(lm: GDN2LM, docs: list[dict], generated: int) -> dict:
    """Generate for the docs of one task and length; time, throughput and score."""
    kwargs = {"do_sample": False, "temperature": 0.0, "max_gen_toks": generated, "until": []}
    requests = [SimpleNamespace(args=(doc["input"], kwargs)) for doc in docs]
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    start = time.perf_counter()
    answers = lm.generate_until(requests, disable_tqdm=True)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(doc["prompt_tokens"] + 1 for doc in docs)  # +1: the EOS gdn2 puts first
    scores = [100.0 * niah.string_match_all(answer, doc["outputs"]) for answer, doc in zip(answers, docs)]
    return {"samples": len(docs), "seconds": round(seconds, 3), "samples_per_s": round(len(docs) / seconds, 3),
            "prompt_tokens_per_s": round(prompt_tokens / seconds, 1),
            "mean_prompt_tokens": round(prompt_tokens / len(docs), 1), "score": round(sum(scores) / len(scores), 2)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a gdn2 checkpoint (default: a fresh --config)")
    parser.add_argument("--config", default="swa_gdn2_tiny", help="named config initialised when no checkpoint")
    parser.add_argument("--tokenizer", default=str(ROOT / "data" / "default" / "tokenizer.model"),
                        help="tokenizer.model for a fresh --config")
    parser.add_argument("--tasks", default=",".join(niah.TASKS), help="comma-separated NIAH tasks")
    parser.add_argument("--max_seq_lengths", default="1024,2048,4096,8192")
    parser.add_argument("--num_samples", type=int, default=500)
    parser.add_argument("--tokens_to_generate", type=int, default=niah.DEFAULT_GENERATED)
    parser.add_argument("--seed", type=int, default=niah.DEFAULT_SEED)
    parser.add_argument("--haystack", help="text file or glob for the essay haystack (default: the essays)")
    parser.add_argument("--batch_size", type=int, default=None, help="default: 32 on CUDA, 4 on CPU")
    parser.add_argument("--device", help="default: cuda when available")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, ...")
    args = parser.parse_args(argv)

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in niah.TASKS]
    if unknown:
        raise SystemExit(f"--tasks: unknown {', '.join(unknown)} (one of {', '.join(niah.TASKS)})")
    metadata = {"max_seq_lengths": args.max_seq_lengths, "num_samples": args.num_samples, "seed": args.seed,
                "tokens_to_generate": args.tokens_to_generate, **({"haystack": args.haystack} if args.haystack else {})}
    settings = niah.settings_from(metadata)
    lm = build_lm(args, window=max(settings.lengths) + 1)
    metadata["tokenizer"] = lm.tokenizer
    report: dict = {"checkpoint": args.checkpoint, "config": lm.config.name, "device": str(lm.device),
                    "gpu": torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else None,
                    "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
                    "batch_size": lm.batch_size, "torch_threads": torch.get_num_threads(),
                    "settings": {k: v for k, v in metadata.items() if k != "tokenizer"}, "cells": [], "data_seconds": {}}
    print(f"{lm.config.name} on {lm.device} ({report['dtype']}), batch {lm.batch_size}, "
          f"{settings.num_samples} samples per task and length, {settings.tokens_to_generate} tokens generated")
    header = f"{'task':<22} {'length':>7} {'prompt tok':>10} {'samples/s':>10} {'prompt tok/s':>13} {'score':>6}"
    print(header + "\n" + "-" * len(header))
    for task in tasks:
        start = time.perf_counter()
        docs = niah.build_docs(task, metadata)
        report["data_seconds"][task] = round(time.perf_counter() - start, 2)
        for length in settings.lengths:
            cell = {"task": task, "length": length,
                    **run_cell(lm, [d for d in docs if d["max_length"] == length], settings.tokens_to_generate)}
            report["cells"].append(cell)
            print(f"{task:<22} {length:>7} {cell['mean_prompt_tokens']:>10.0f} {cell['samples_per_s']:>10.2f} "
                  f"{cell['prompt_tokens_per_s']:>13.0f} {cell['score']:>6.1f}", flush=True)
    total = sum(c["seconds"] for c in report["cells"])
    report["total_generation_seconds"] = round(total, 2)
    print(f"generation {total:.1f} s; sample generation (tokenizer search) "
          f"{sum(report['data_seconds'].values()):.1f} s")
    out = Path(os.environ.get("OUT") or ROOT / "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "niah_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'niah_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
