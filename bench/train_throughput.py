"""Trainer throughput on one or several GPUs: the real CLI end to end, and the largest micro-batch.

    python bench/train_throughput.py --config swa_gdn2_1.3B --gpus 1 [--phase all|trainer|search]

Phase ``trainer`` runs ``pretrain/main.py`` (torchrun with ``--gpus`` processes: FSDP from two GPUs on)
on synthetic token shards for a few optimizer steps, then resumes it for two more and consolidates the
checkpoint: it reports tokens/s per GPU, MFU against the card's dense bf16 peak and peak memory from
the run's own metrics, and checks the sharded save / resume / consolidation paths on GPUs.

Phase ``search`` finds the largest micro-batch at ``--seq-len`` (default: the config's block size)
with and without activation checkpointing: one child process per trial (so an out-of-memory failure
on any rank ends only that trial), doubling the micro-batch until a trial fails, then bisecting. Each
trial runs the trainer's own optimizer step (``gdn2.train.loop.train_step``) on random tokens.

Phase ``profile`` runs one such trial (``--trainer-micro-batch``, default the config's) and profiles
one more optimizer step with torch.profiler: CUDA time per kernel, summed into GEMMs, the GDN-2
operator, attention, optimizer, communication and everything else (elementwise, norms, copies), so
that the time the step spends outside the kernels we own is visible; and one more with Python stacks,
for the copies and concatenations by the line of gdn2 that asked for them.

Phase ``sweep`` compares ``--config`` with ``--compare`` (e.g. ``transformer_1.3B``) at every length of
``--seq-len 4096,16384,32768``: one trial per (config, length) with ``--tokens-per-micro-batch`` tokens
per micro-batch (micro-batch 4 at 4096, 1 at 16384 and above), tokens/s, MFU and peak memory side by
side, the ratio of the two, and an out-of-memory recorded as such. ``--phase profile`` with
``--compare`` profiles both configs. ``--set key=value`` (repeatable) overrides a recipe value in every
trial and in the trainer phase, e.g. ``--set train.fused_loss=true``.

In the sweep and profile phases every measured trial follows an unrecorded one-step trial of the same
config and length (``--no-warm-trial`` skips it), so that it finds torch.compile's and Triton's caches
filled: on a fresh machine the first trial of a config could run several percent slower than the same
trial repeated, its warm-up steps notwithstanding (``bench/NOTES.md``).

Phase ``scaling`` runs the trainer phase at every count of ``--gpus 1,2,4,8`` with every
``--strategies`` entry (``fsdp``, ``fsdp2``, ``ddp``; ``-hybrid`` for a 2-D mesh of ``--replicas``
groups, the layout hybrid sharding uses across nodes), with ``--trainer-global-batch`` sequences per step
(128 x 4096 tokens is the real recipe's 0.5M): tokens/s per GPU, scaling efficiency against one GPU,
MFU, peak memory, checkpoint save and load seconds, and the first losses (equal across strategies).

Prints a table and writes ``train_throughput_<config>_<gpus>gpu.json`` to ``--out`` (default ``$OUT``
or ``bench_out``). Stops starting new trials once ``--time-budget`` seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------------------------------
# child: one trial under torchrun
# --------------------------------------------------------------------------------------------------

def run_trial(args: argparse.Namespace) -> None:
    import torch

    from gdn2.model import flops_per_token
    from gdn2.train.loop import train_step
    from gdn2.train.setup import build_fabric, build_model_and_optimizer
    from gdn2.train.metrics import model_flops_utilization, peak_bf16_flops
    from gdn2.train.recipe import load_recipe, make_plan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = {"train.micro_batch_size": str(args.micro_batch), "train.global_batch_size": str(args.micro_batch * world),
                 "train.activation_checkpointing": str(args.ac).lower(), "data.num_workers": "0"}
    if args.seq_len:
        overrides["model.block_size"] = str(args.seq_len[0])
    overrides.update(recipe_overrides(args.set))
    recipe = load_recipe(args.config, overrides, out_dir="/tmp/gdn2_bench_trial")
    fabric, _, precision = build_fabric(recipe)
    fabric.launch()
    plan = make_plan(recipe, fabric.world_size)
    result = {"micro_batch": args.micro_batch, "activation_checkpointing": args.ac, "seq_len": plan.block_size,
              "world_size": fabric.world_size, "precision": precision}
    try:
        model, optimizer, num_params = build_model_and_optimizer(fabric, recipe)
        vocab = recipe.model.vocab_size

        def batches():
            gen = torch.Generator().manual_seed(fabric.global_rank)
            while True:
                rows = torch.randint(0, vocab, (plan.micro_batch_size, plan.block_size + 1), generator=gen)
                yield {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

        it = batches()
        cuda = fabric.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(args.warmup_steps):  # Triton compilation and allocator warm-up
            train_step(fabric, model, optimizer, it, plan, 1e-4, 1.0, recipe.train.loss_chunk_tokens)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = train_step(fabric, model, optimizer, it, plan, 1e-4, 1.0, recipe.train.loss_chunk_tokens)
            sync()
            times.append(time.perf_counter() - t0)
        step_time = statistics.median(times)
        if args.profile:
            from profiling import copy_sites

            def step():
                train_step(fabric, model, optimizer, it, plan, 1e-4, 1.0, recipe.train.loss_chunk_tokens)

            result["profile"] = profile_step(step)
            result["profile"]["copy_sites"] = copy_sites(step)
        tps = plan.micro_batch_size * plan.block_size / step_time
        device_name = torch.cuda.get_device_name(fabric.device) if cuda else "cpu"
        mfu = model_flops_utilization(flops_per_token(recipe.model, plan.block_size), tps, peak_bf16_flops(device_name))
        memory = torch.tensor([torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30]
                              if cuda else [0.0, 0.0], device=fabric.device)
        memory = fabric.all_reduce(memory, reduce_op="max")
        result.update(ok=True, parameters=num_params, step_time_s=step_time, tokens_per_sec_per_gpu=tps, mfu=mfu,
                      peak_memory_gib=float(memory[0]), peak_reserved_gib=float(memory[1]), loss=out.loss,
                      device=device_name)
    except torch.OutOfMemoryError as e:
        result.update(ok=False, oom=True, error=str(e).splitlines()[0])
        Path(f"{args.result}.rank{fabric.global_rank}").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(3)  # other ranks may wait in a collective: torchrun tears the group down
    if fabric.global_rank == 0:
        Path(args.result).write_text(json.dumps(result))


# kernel-name fragments of each category (first match wins; lower case)
CATEGORIES = [
    ("GDN-2 operator", ("gdn2_", "l2norm")),
    ("attention", ("_swa_", "_bwd_delta", "attn", "fmha", "flash")),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("communication", ("nccl",)),
]


def kernel_category(name: str) -> str:
    low = name.lower()
    for cat, frags in CATEGORIES:
        if any(f in low for f in frags):
            return cat
    return "other (elementwise, norms, copies, loss)"


def profile_step(step) -> dict:
    """Time of one ``step()`` by kernel and by category (ms; see ``profiling.kernel_times``)."""
    from profiling import kernel_times

    rows = kernel_times(step, reps=1, warm=False)
    categories: dict[str, float] = {}
    for name, ms, _ in rows:
        cat = kernel_category(name)
        categories[cat] = categories.get(cat, 0.0) + ms
    return {"total_ms": sum(categories.values()),
            "categories_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:160], "ms": ms, "launches": int(c)} for n, ms, c in rows[:40]]}


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------

def torchrun(gpus: int, script: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
            str(script), *args]


def recipe_overrides(pairs: list[str]) -> dict[str, str]:
    """``["train.fused_loss=true", ...]`` as recipe overrides."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set takes key=value, got {pair!r}")
        out[key] = value
    return out


def trial(cfg: argparse.Namespace, mb: int, ac: bool, workdir: Path, profile: bool = False,
          config: Optional[str] = None, seq_len: Optional[int] = None) -> dict:
    config = config or cfg.config
    seq_len = seq_len or (cfg.seq_len[0] if cfg.seq_len else None)
    tag = f"{Path(config).stem}_T{seq_len or 'cfg'}_mb{mb}_ac{int(ac)}"
    result = workdir / f"trial_{tag}.json"
    result.unlink(missing_ok=True)
    cmd = torchrun(cfg.gpus, Path(__file__), ["--trial", "--config", config, "--micro-batch", str(mb),
                                             "--ac", str(ac), "--steps", str(cfg.trial_steps),
                                             "--warmup-steps", str(cfg.warmup_steps), "--result", str(result)]
                   + (["--seq-len", str(seq_len)] if seq_len else [])
                   + [a for pair in cfg.set for a in ("--set", pair)]
                   + (["--profile"] if profile else []))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.trial_timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = -1, f"timed out after {cfg.trial_timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    data: dict = {"config": config, "seq_len": seq_len, "micro_batch": mb, "activation_checkpointing": ac}
    if result.exists():
        data = dict(json.loads(result.read_text()), config=config)
    else:
        ranks = sorted(workdir.glob(result.name + ".rank*"))
        if ranks:
            data = dict(json.loads(ranks[0].read_text()), config=config)
            for r in ranks:
                r.unlink()
        else:
            oom = "out of memory" in output.lower() or "OutOfMemoryError" in output
            data.update(ok=False, oom=oom, error=output.strip().splitlines()[-1][:300] if output.strip() else f"rc {rc}")
            if not oom:
                (workdir / f"trial_{tag}.log").write_text(output[-20000:])
    if "recompile_limit" in output:  # torch.compile gave up on some stage: those calls ran eagerly
        data["recompile_limit_hit"] = True
        (workdir / f"trial_{tag}.log").write_text(output[-20000:])
        print(f"  note: {tag}: torch.compile hit its recompile limit (some stages ran eagerly); "
              f"its output is in {workdir / f'trial_{tag}.log'}", flush=True)
    data["wall_s"] = round(time.time() - t0, 1)
    return data


def warmed_trial(cfg: argparse.Namespace, mb: int, workdir: Path, config: str, seq_len: Optional[int] = None,
                 profile: bool = False) -> dict:
    """:func:`trial`, after an unrecorded one-step trial of the same config and length that fills the
    compile caches (unless ``--no-warm-trial``); the warm-up's wall time and tokens/s go in ``warm_up``."""
    warm = None
    if cfg.warm_trial:
        short = argparse.Namespace(**{**vars(cfg), "trial_steps": 1, "warmup_steps": 1})
        w = trial(short, mb, cfg.trainer_ac, workdir, config=config, seq_len=seq_len)
        warm = {"wall_s": w["wall_s"], "ok": bool(w.get("ok")), "tokens_per_sec_per_gpu": w.get("tokens_per_sec_per_gpu")}
    r = trial(cfg, mb, cfg.trainer_ac, workdir, profile=profile, config=config, seq_len=seq_len)
    if warm is not None:
        r["warm_up"] = warm
    return r


def search(cfg: argparse.Namespace, workdir: Path, deadline: float) -> list[dict]:
    """Largest micro-batch that fits, without and with activation checkpointing."""
    trials = []
    for ac in (False, True):
        ok, bad = 0, None
        mb = cfg.start_micro_batch
        while mb <= cfg.max_micro_batch and time.time() < deadline:
            r = trial(cfg, mb, ac, workdir)
            trials.append(r)
            print(f"  ac={ac!s:5} mb={mb:3d}: " + (f"{r['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, "
                  f"{r['peak_memory_gib']:.1f} GiB" if r.get("ok") else f"failed ({'OOM' if r.get('oom') else r.get('error')})"),
                  flush=True)
            if not r.get("ok"):
                bad = mb
                break
            ok = mb
            mb *= 2
        while bad is not None and bad - ok > 1 and time.time() < deadline and ok > 0:  # bisect
            mid = (ok + bad) // 2
            r = trial(cfg, mid, ac, workdir)
            trials.append(r)
            print(f"  ac={ac!s:5} mb={mid:3d}: " + ("ok" if r.get("ok") else "failed"), flush=True)
            if r.get("ok"):
                ok = mid
            else:
                bad = mid
    return trials


def write_shards(folder: Path, vocab: int, train_tokens: int, val_tokens: int) -> None:
    import numpy as np

    from gdn2.data.shards import write_shard

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(folder / "train_0000000000.bin", rng.integers(3, vocab, train_tokens).astype(np.uint16))
    write_shard(folder / "val_0000000000.bin", rng.integers(3, vocab, val_tokens).astype(np.uint16))


def trainer_phase(cfg: argparse.Namespace, workdir: Path) -> dict:
    """The CLI itself: train, resume, consolidate; metrics from its metrics.jsonl."""
    from gdn2.train.metrics import read_jsonl
    from gdn2.train.recipe import load_recipe

    recipe = load_recipe(cfg.config)
    block = cfg.seq_len[0] if cfg.seq_len else recipe.model.block_size
    mb = cfg.trainer_micro_batch or recipe.train.micro_batch_size
    accum = cfg.trainer_accum
    if cfg.trainer_global_batch:
        if cfg.trainer_global_batch % (mb * cfg.gpus):
            raise SystemExit(f"--trainer-global-batch {cfg.trainer_global_batch} is not a multiple of "
                             f"micro-batch {mb} x {cfg.gpus} GPUs")
        accum = cfg.trainer_global_batch // (mb * cfg.gpus)
    gbs = mb * cfg.gpus * accum
    data = workdir / "data"
    need = (cfg.trainer_steps + 3) * gbs * (block + 1)
    write_shards(data, recipe.model.vocab_size, need, 4 * block * cfg.gpus * 2 + 1)
    run_dir = workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    common = ["--config", cfg.config, "--out_dir", str(run_dir), "--data.train", str(data), "--data.val", str(data),
              "--data.num_workers", "2", "--train.micro_batch_size", str(mb), "--train.global_batch_size", str(gbs),
              "--train.warmup_steps", "1", "--eval.interval", "0", "--eval.num_batches", "1",
              "--eval.length_multipliers", "[1, 4]", "--checkpoint.interval", "0", "--checkpoint.keep_last", "1",
              "--logging.interval", "1", "--logging.progress_bar", "false",
              "--train.activation_checkpointing", str(cfg.trainer_ac).lower()]
    if cfg.seq_len:
        common += ["--model.block_size", str(block)]
    for key, value in recipe_overrides(cfg.set).items():
        common += [f"--{key}", value]
    report: dict = {"micro_batch": mb, "global_batch": gbs, "grad_accum": accum, "seq_len": block,
                    "activation_checkpointing": cfg.trainer_ac}
    t0 = time.time()
    first = subprocess.run(torchrun(cfg.gpus, ROOT / "pretrain" / "main.py",
                                    common + ["--train.max_steps", str(cfg.trainer_steps + 2),
                                              "--train.stop_at_step", str(cfg.trainer_steps)]),
                           cwd=ROOT, capture_output=True, text=True, timeout=cfg.trial_timeout * 3)
    report["train_wall_s"] = round(time.time() - t0, 1)
    (workdir / "trainer_first.log").write_text((first.stdout + first.stderr)[-200000:])
    report["train_rc"] = first.returncode
    if first.returncode != 0:
        report["error"] = (first.stdout + first.stderr).strip().splitlines()[-5:]
        return report
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steady = records[2:] or records  # the first steps include Triton compilation
    report["tokens_per_sec_per_gpu"] = statistics.median(r["tokens_per_sec_per_device"] for r in steady)
    report["mfu"] = statistics.median(r["mfu"] for r in steady) if "mfu" in steady[-1] else None
    report["peak_memory_gib"] = max(r.get("peak_memory_gib", 0.0) for r in records)
    report["losses"] = [round(r["loss"], 4) for r in records]
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    report["checkpoint"] = ckpts[-1].name if ckpts else None
    report["checkpoint_format"] = ("sharded" if ckpts and (ckpts[-1] / "state").is_dir() else "single file")
    saves = re.findall(r"saved checkpoint \S+ in ([0-9.]+) s", first.stdout + first.stderr)
    report["checkpoint_save_s"] = float(saves[-1]) if saves else None
    if cfg.trainer_no_resume:
        return report

    t0 = time.time()
    second = subprocess.run(torchrun(cfg.gpus, ROOT / "pretrain" / "main.py",
                                     common + ["--train.max_steps", str(cfg.trainer_steps + 2), "--resume", "auto"]),
                            cwd=ROOT, capture_output=True, text=True, timeout=cfg.trial_timeout * 3)
    (workdir / "trainer_resume.log").write_text((second.stdout + second.stderr)[-200000:])
    report["resume_wall_s"] = round(time.time() - t0, 1)
    report["resume_rc"] = second.returncode
    loads = re.findall(r"loaded in ([0-9.]+) s", second.stdout + second.stderr)
    report["checkpoint_load_s"] = float(loads[-1]) if loads else None
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    report["resume_ok"] = second.returncode == 0 and steps == list(range(1, cfg.trainer_steps + 3))
    val = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "val"]
    report["val"] = val[-1] if val else None

    t0 = time.time()
    cons = subprocess.run([sys.executable, "-m", "gdn2", "consolidate", str(run_dir / "checkpoints"),
                           "--out", str(workdir / "final")], cwd=ROOT, capture_output=True, text=True,
                          timeout=cfg.trial_timeout * 2)
    report["consolidate_rc"] = cons.returncode
    report["consolidate_wall_s"] = round(time.time() - t0, 1)
    report["consolidate_output"] = (cons.stdout + cons.stderr).strip().splitlines()[-1:] if (cons.stdout + cons.stderr).strip() else []
    shutil.rmtree(workdir / "final", ignore_errors=True)
    return report


def scaling(cfg: argparse.Namespace, workdir: Path, deadline: float) -> list[dict]:
    """The trainer phase at every ``--gpus`` count with every ``--strategies`` entry (one GPU once)."""
    rows = []
    for gpus in cfg.gpus_list:
        for strategy in (["single"] if gpus == 1 else cfg.strategies):
            if time.time() > deadline:
                rows.append({"gpus": gpus, "strategy": strategy, "error": "time budget spent"})
                continue
            run = argparse.Namespace(**vars(cfg))
            run.gpus = gpus
            name, _, sharding = strategy.partition("-")
            if gpus > 1:
                run.set = cfg.set + [f"distributed.strategy={name}"]
                if sharding == "hybrid":
                    run.set += ["distributed.sharding=hybrid", f"distributed.replicas={cfg.replicas}"]
            print(f"[scaling] {cfg.config} on {gpus} GPU(s), {strategy}", flush=True)
            r = trainer_phase(run, workdir / f"scaling_{gpus}_{strategy}")
            r.update(gpus=gpus, strategy=strategy)
            rows.append(r)
            print(json.dumps({k: r.get(k) for k in ("tokens_per_sec_per_gpu", "mfu", "peak_memory_gib",
                                                     "checkpoint_save_s", "checkpoint_load_s", "losses")}),
                  flush=True)
    return rows


def print_scaling(rows: list[dict]) -> None:
    base = next((r["tokens_per_sec_per_gpu"] for r in rows if r["gpus"] == 1 and "tokens_per_sec_per_gpu" in r), None)
    print("\n| GPUs | strategy | micro-batch x accumulation | tokens/s per GPU | scaling efficiency | MFU | peak GiB "
          "| save s | load s | losses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tokens_per_sec_per_gpu" not in r:
            print(f"| {r['gpus']} | {r['strategy']} | - | failed: {str(r.get('error'))[:80]} | - | - | - | - | - | - |")
            continue
        eff = f"{r['tokens_per_sec_per_gpu'] / base:.1%}" if base else "-"
        fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        print(f"| {r['gpus']} | {r['strategy']} | {r['micro_batch']} x {r['grad_accum']} | "
              f"{r['tokens_per_sec_per_gpu']:,.0f} | {eff} | {_pct(r.get('mfu'))} | {r['peak_memory_gib']:.1f} | "
              f"{fmt(r.get('checkpoint_save_s'))} | {fmt(r.get('checkpoint_load_s'))} | "
              f"{' '.join(f'{x:.4f}' for x in r['losses'][:4])} |")


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def sweep(cfg: argparse.Namespace, workdir: Path, deadline: float) -> list[dict]:
    """``--config`` and ``--compare`` at every ``--seq-len``, the same tokens per micro-batch."""
    configs = [cfg.config] + ([cfg.compare] if cfg.compare else [])
    rows = []
    for seq_len in cfg.seq_len or [None]:
        if seq_len is None:
            from gdn2.train.recipe import load_recipe

            seq_len = load_recipe(cfg.config).model.block_size
        mb = max(1, cfg.tokens_per_micro_batch // seq_len)
        row: dict = {"seq_len": seq_len, "micro_batch": mb}
        for config in configs:
            if time.time() > deadline:
                row[config] = {"ok": False, "error": "time budget spent"}
                continue
            r = row[config] = warmed_trial(cfg, mb, workdir, config, seq_len)
            print(f"  {config} T={seq_len} mb={mb}: " + (f"{r['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, "
                  f"{_pct(r.get('mfu'))} MFU, {r['peak_memory_gib']:.1f} GiB" if r.get("ok")
                  else f"failed ({'OOM' if r.get('oom') else r.get('error')})"), flush=True)
        rows.append(row)
    return rows


def print_sweep(rows: list[dict], configs: list[str]) -> None:
    head = " | ".join(f"{c} tokens/s/GPU | MFU | peak GiB" for c in configs)
    print(f"\n| context | micro-batch | {head} |" + (" ratio |" if len(configs) == 2 else ""))
    print("|---|---|" + "---|---|---|" * len(configs) + ("---|" if len(configs) == 2 else ""))
    for row in rows:
        cells = []
        for c in configs:
            r = row.get(c, {})
            if r.get("ok"):
                cells.append(f"{r['tokens_per_sec_per_gpu']:,.0f} | {_pct(r.get('mfu'))} | {r['peak_memory_gib']:.1f}")
            else:
                cells.append(("OOM" if r.get("oom") else "failed") + " | - | -")
        ratio = ""
        if len(configs) == 2:
            a, b = row.get(configs[0], {}), row.get(configs[1], {})
            ratio = (f" {a['tokens_per_sec_per_gpu'] / b['tokens_per_sec_per_gpu']:.2f}x |"
                     if a.get("ok") and b.get("ok") else " - |")
        print(f"| {row['seq_len']} | {row['micro_batch']} | " + " | ".join(cells) + " |" + ratio)


def print_profile(config: str, r: dict) -> None:
    if not r.get("ok"):
        print(f"profile trial of {config} failed: {r.get('error')}")
        return
    prof = r["profile"]
    print(f"\n{config}: kernel time of one step: {prof['total_ms']:.1f} ms (wall {r['step_time_s'] * 1e3:.1f} ms)")
    print("| category | ms | share |\n|---|---|---|")
    for cat, ms in prof["categories_ms"].items():
        print(f"| {cat} | {ms:.1f} | {ms / max(prof['total_ms'], 1e-9):.1%} |")
    print("\ntop kernels (ms per step, launches):")
    for k in prof["top_kernels"][:30]:
        print(f"  {k['ms']:8.2f} {k['launches']:5d}  [{kernel_category(k['name'])[:9]}] {k['name'][:110]}")
    print("\ncopies and concatenations by the place in gdn2 that asked for them (ms, calls; one more step):")
    for c in prof.get("copy_sites", [])[:20]:
        print(f"  {c['ms']:8.2f} {c['calls']:5d}  {c['op']:12s} {c['site'][:70]:70s} {c['shapes'][:60]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="swa_gdn2_1.3B")
    p.add_argument("--gpus", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="GPUs on this machine to use (default: all); --phase scaling: a list, e.g. 1,2,4,8")
    p.add_argument("--phase", choices=("all", "trainer", "search", "profile", "sweep", "scaling"), default="all",
                   help="all = trainer + search; profile: one trial's step split by kernel category; sweep: "
                        "--config against --compare at every --seq-len; scaling: the trainer phase at every "
                        "--gpus count with every --strategies entry")
    p.add_argument("--strategies", type=lambda v: v.split(","), default=["fsdp", "fsdp2"],
                   help="scaling: fsdp | fsdp2 | ddp, each optionally -hybrid (2-D mesh of --replicas groups)")
    p.add_argument("--replicas", type=int, default=2, help="scaling: replica groups of the -hybrid strategies")
    p.add_argument("--trainer-global-batch", type=int, default=None,
                   help="sequences per optimizer step (accumulation follows; the real recipe: 128)")
    p.add_argument("--seq-len", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="context length(s), comma-separated (default: the config's block size)")
    p.add_argument("--compare", default=None, help="a second config for --phase sweep / profile")
    p.add_argument("--tokens-per-micro-batch", type=int, default=16384,
                   help="sweep: micro-batch = this // context length (at least 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for every trial and the trainer phase (repeatable)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; no new trial starts after that")
    p.add_argument("--trainer-steps", type=int, default=8)
    p.add_argument("--trainer-accum", type=int, default=4)
    p.add_argument("--trainer-micro-batch", type=int, default=None)
    p.add_argument("--trainer-ac", action="store_true", help="activation checkpointing in the trainer phase")
    p.add_argument("--trainer-no-resume", action="store_true",
                   help="trainer phase: train only (no resume, no consolidation), e.g. as a loss reference")
    p.add_argument("--start-micro-batch", type=int, default=1)
    p.add_argument("--max-micro-batch", type=int, default=32)
    p.add_argument("--trial-steps", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--trial-timeout", type=float, default=300.0)
    p.add_argument("--no-warm-trial", dest="warm_trial", action="store_false",
                   help="sweep / profile: measure without the unrecorded one-step trial before each measured one")
    p.add_argument("--workdir", default="/tmp/gdn2_train_bench")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test of this script
    # child mode
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ac", type=lambda s: s.lower() == "true", default=False, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trial:
        run_trial(args)
        return

    import torch

    started = time.time()
    deadline = started + args.time_budget
    args.gpus_list = args.gpus or [torch.cuda.device_count() or (1 if args.allow_cpu else 0)]
    args.gpus = max(args.gpus_list)
    if args.gpus < 1:
        raise SystemExit("no CUDA device: this benchmark needs GPUs")
    if args.phase != "scaling" and len(args.gpus_list) > 1:
        raise SystemExit("--gpus takes a list only with --phase scaling")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report: dict = {"config": args.config, "compare": args.compare, "overrides": args.set, "gpus": args.gpus,
                    "device": device,
                    "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.phase in ("all", "trainer"):
        print(f"[trainer] {args.config} on {args.gpus} GPU(s): pretrain/main.py, resume, gdn2 consolidate", flush=True)
        report["trainer"] = trainer_phase(args, workdir)
        print(json.dumps(report["trainer"], indent=1), flush=True)
    if args.phase in ("all", "search"):
        print(f"[search] largest micro-batch of {args.config} on {args.gpus} GPU(s)", flush=True)
        trials = search(args, workdir, deadline)
        report["trials"] = trials
        report["largest_micro_batch"] = {
            ("with" if ac else "without") + "_activation_checkpointing":
                max((t["micro_batch"] for t in trials if t.get("ok") and t["activation_checkpointing"] == ac), default=None)
            for ac in (False, True)}
    if args.phase == "profile":
        mb = args.trainer_micro_batch or 0
        if not mb:
            from gdn2.train.recipe import load_recipe
            mb = load_recipe(args.config, {}, out_dir=str(workdir)).train.micro_batch_size
        report["profile_trials"] = {}
        for config in [args.config] + ([args.compare] if args.compare else []):
            print(f"[profile] one optimizer step of {config}, micro-batch {mb}, AC {args.trainer_ac}", flush=True)
            report["profile_trials"][config] = r = warmed_trial(args, mb, workdir, config, profile=True)
            print_profile(config, r)
    if args.phase == "sweep":
        print(f"[sweep] {args.config}" + (f" against {args.compare}" if args.compare else "")
              + f" at context {args.seq_len or 'of the config'}", flush=True)
        report["sweep"] = sweep(args, workdir, deadline)
        print_sweep(report["sweep"], [args.config] + ([args.compare] if args.compare else []))
    if args.phase == "scaling":
        report["scaling"] = scaling(args, workdir, deadline)
        print_scaling(report["scaling"])
    report["wall_s"] = round(time.time() - started, 1)

    print(f"\n{args.config}, {args.gpus} x {report['device']}")
    print("| phase | AC | micro-batch | tokens/s/GPU | MFU | peak memory GiB |")
    print("|---|---|---|---|---|---|")
    t = report.get("trainer")
    if t and "tokens_per_sec_per_gpu" in t:
        mfu = _pct(t.get("mfu"))
        print(f"| trainer (main.py) | {t['activation_checkpointing']} | {t['micro_batch']} x {t['grad_accum']} accum | "
              f"{t['tokens_per_sec_per_gpu']:,.0f} | {mfu} | {t['peak_memory_gib']:.1f} |")
    for r in report.get("trials", []):
        if r.get("ok"):
            mfu = _pct(r.get("mfu"))
            print(f"| trial | {r['activation_checkpointing']} | {r['micro_batch']} | {r['tokens_per_sec_per_gpu']:,.0f} | "
                  f"{mfu} | {r['peak_memory_gib']:.1f} |")
        else:
            print(f"| trial | {r['activation_checkpointing']} | {r['micro_batch']} | {'OOM' if r.get('oom') else 'failed'} | - | - |")
    if "largest_micro_batch" in report:
        print(f"largest micro-batch: {report['largest_micro_batch']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.config).stem if args.config.endswith((".yaml", ".yml")) else Path(args.config).name
    path = out / f"train_throughput_{name}_{'-'.join(map(str, args.gpus_list))}gpu.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
