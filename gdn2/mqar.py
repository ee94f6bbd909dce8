"""MQAR, multi-query associative recall (the synthetic recall task of the Zoology study), on two-layer
models whose token mixers are GDN-2 layers, sliding-window attention or full causal attention.

    python -m gdn2 mqar --preset cpu     # the wiring check: width 64, 600 x 16 sequences of 64 tokens, CPU, minutes
    python -m gdn2 mqar --preset full    # widths 64 / 128 / 256, learning rates 1e-4 .. 1e-2, for a GPU

A sequence of ``length`` tokens opens with ``pairs`` key-value pairs (k1 v1 k2 v2 ...); then every key
is asked once, as the pair ``k v`` again, at a slot after the pairs drawn by a power law (gap g, in
two-token slots, with probability proportional to a * g^(a - 1), a = 0.01: short gaps are likely,
long ones possible); the other tokens are random filler. The model must predict the value at the query
key's position; loss and accuracy count those positions only. Each model trains on a mix of shapes
and is tested on longer ones with more pairs; the best learning rate per mixer and width (by mean test
accuracy) is reported against the size of the state the mixer keeps while reading a sequence.

Everything goes to ``--out`` (default ``out/mqar``): ``mqar.json`` (every finished run, and the
summary of the current settings), ``mqar.md`` (accuracy table and learning-rate sweep) and
``mqar.png`` (accuracy against state size). A run recorded there with the same settings is not
trained again, so a grid can be completed over several invocations.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gdn2.commandline import list_items, option, parse_numbers, parse_options
from gdn2.config import MAX_HEAD_DIM, Config
from gdn2.layers.attention import CausalSelfAttention
from gdn2.layers.gdn2 import GatedDeltaNet2
from gdn2.layout import TokenLayout
from gdn2.modules import Embedding, RMSNorm
from gdn2.train.schedule import cosine_with_warmup

__all__ = ["MIXERS", "Mixer", "MQARModel", "Settings", "Shape", "main", "make_batch", "model_config",
           "resolve_settings", "run_sweep", "sample_gaps", "state_floats", "train_run"]

IGNORE = -100  # label of every position that is not an answer (cross_entropy's ignore_index)
FORMAT = 1  # version of mqar.json


# ------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True, order=True)
class Shape:
    """One (sequence length, number of key-value pairs) of the task."""

    length: int
    pairs: int

    @property
    def slots(self) -> int:
        """Two-token query slots after the pairs: where the ``pairs`` queries may go."""
        return (self.length - 2 * self.pairs) // 2

    @property
    def name(self) -> str:
        return f"{self.length}:{self.pairs}"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        length, sep, pairs = text.partition(":")
        if not sep:
            raise ValueError(f"expected LENGTH:PAIRS, got {text!r}")
        return cls(int(length), int(pairs))


def _seed(*parts: Any) -> int:
    """A 63-bit seed from any parts (stable across processes and Python versions, unlike hash())."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def gap_log_weights(slots: int, power_a: float) -> torch.Tensor:
    """log(a * g^(a - 1)) for gaps g = 1 .. ``slots``: fp64 [slots] (unnormalised log-probabilities)."""
    gap = torch.arange(1, slots + 1, dtype=torch.float64)
    return math.log(power_a) + (power_a - 1.0) * gap.log()


def sample_gaps(batch: int, slots: int, count: int, power_a: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct gaps per row from 1 .. ``slots``, drawn one after the other with probability
    proportional to a * g^(a - 1) among those left: int64 [batch, count].

    The Gumbel top-k draw (the ``count`` largest of log-weight + Gumbel noise) is that sequential draw
    without replacement, for a whole batch at once."""
    u = torch.rand(batch, slots, generator=generator, dtype=torch.float64).clamp_(1e-300, 1.0)
    scores = gap_log_weights(slots, power_a) - torch.log(-torch.log(u))
    return scores.topk(count, dim=-1).indices + 1


def _distinct(batch: int, count: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct integers per row, uniform from [low, high), in random order: int64 [batch, count]."""
    # the positions of the largest of (high - low) uniform draws: a uniform subset (top-k, not a full sort)
    return torch.rand(batch, high - low, generator=generator).topk(count, dim=-1).indices + low


def make_batch(shape: Shape, batch: int, seed: int, vocab_size: int = 8192, power_a: float = 0.01
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` MQAR sequences of ``shape``, a function of ``seed`` alone: (inputs, labels), int64
    [batch, length] on the CPU.

    Keys are drawn from [0, vocab_size / 2), values from [vocab_size / 2, vocab_size), each without
    replacement within a sequence. Positions 0 .. 2 pairs - 1 hold k1 v1 k2 v2 ...; slot s (s = 1 ..
    ``shape.slots``) is the two positions 2 pairs + 2 (s - 1) and the one after. Every key is asked
    once, in a random order, as ``k v`` in a slot drawn by :func:`sample_gaps`; the label at the query
    key's position is its value, every other label is -100. The remaining positions are filler,
    uniform over the vocabulary without this sequence's keys, so a key appears only in its pair and
    its query.
    """
    B, T, N, half = batch, shape.length, shape.pairs, vocab_size // 2
    if N < 1 or shape.slots < N or N > half:
        raise ValueError(f"shape {shape.name}: needs 1 <= pairs <= {half} and length >= 4 x pairs")
    g = torch.Generator().manual_seed(seed)
    keys = _distinct(B, N, 0, half, g)
    values = _distinct(B, N, half, vocab_size, g)
    # filler: the r-th token that is not one of the keys (keys - arange counts the non-keys below each)
    r = torch.randint(0, vocab_size - N, (B, T), generator=g)
    below = keys.sort(dim=-1).values - torch.arange(N)
    seq = r + torch.searchsorted(below, r, right=True)
    seq[:, 0:2 * N:2] = keys
    seq[:, 1:2 * N:2] = values
    order = torch.rand(B, N, generator=g).argsort(dim=-1)  # which key each drawn slot asks
    where = 2 * N + 2 * (sample_gaps(B, shape.slots, N, power_a, g) - 1)
    asked, answers = keys.gather(1, order), values.gather(1, order)
    seq.scatter_(1, where, asked)
    seq.scatter_(1, where + 1, answers)
    labels = torch.full_like(seq, IGNORE)
    labels.scatter_(1, where, answers)
    return seq, labels


# ------------------------------------------------------------------------------------------------
# mixers and models

WINDOW = "<window>"  # stands for --window in a mixer's overrides


@dataclass(frozen=True)
class Mixer:
    """A token mixer: ``Config`` keys over the base of :func:`model_config` (the value :data:`WINDOW`
    stands for ``--window``)."""

    description: str
    overrides: dict[str, Any]


# One row per model variant: the gate keys (gdn2_decay, gdn2_erase, gdn2_write: channel | head;
# gdn2_tied_gates) give KDA, Gated DeltaNet and the gate ablations from the same GDN-2 layer.
MIXERS: dict[str, Mixer] = {
    "gdn2": Mixer("GDN-2: decay per key channel, erase gate per key channel, write gate per value channel",
                  {"gdn2_per_layer": 1}),
    "swa": Mixer("sliding-window causal attention (--window keys), RoPE", {"gdn2_per_layer": 0, "sliding_window": WINDOW}),
    "attention": Mixer("full causal attention, RoPE", {"gdn2_per_layer": 0, "sliding_window": None}),
    "kda": Mixer("KDA: decay per key channel, one tied erase/write gate per head",
                 {"gdn2_per_layer": 1, "gdn2_decay": "channel", "gdn2_erase": "head", "gdn2_write": "head",
                  "gdn2_tied_gates": True}),
    "gdn": Mixer("Gated DeltaNet: decay per head, one tied erase/write gate per head",
                 {"gdn2_per_layer": 1, "gdn2_decay": "head", "gdn2_erase": "head", "gdn2_write": "head",
                  "gdn2_tied_gates": True}),
    "gdn2_scalar_erase": Mixer("GDN-2 with the erase gate per head (write gate per value channel)",
                               {"gdn2_per_layer": 1, "gdn2_decay": "channel", "gdn2_erase": "head",
                                "gdn2_write": "channel", "gdn2_tied_gates": False}),
    "gdn2_scalar_write": Mixer("GDN-2 with the write gate per head (erase gate per key channel)",
                               {"gdn2_per_layer": 1, "gdn2_decay": "channel", "gdn2_erase": "channel",
                                "gdn2_write": "head", "gdn2_tied_gates": False}),
}


def model_config(mixer: str, width: int, vocab_size: int, max_length: int, window: int) -> Config:
    """The two-layer model of ``mixer`` at ``width`` (d_model).

    Every mixer has two heads of width / 2: GDN-2 heads of key and value dimension width / 2 (a state
    of width^2 / 2 floats per layer), attention heads of width / 2 (2 x width floats of KV cache per
    position and layer). The GDN-2 gates' low-rank projections have rank max(16, width / 8).
    ``intermediate_size`` is unused (the blocks have no MLP)."""
    base: dict[str, Any] = dict(
        name=f"mqar_{mixer}_{width}", block_size=max_length, vocab_size=vocab_size, n_layer=2, n_embd=width,
        n_head=2, head_size=width // 2, intermediate_size=width, gdn2_num_heads=2, gdn2_head_dim=width // 2,
        gdn2_gate_rank=max(16, width // 8), sliding_window=None)
    base.update({k: window if v == WINDOW else v for k, v in MIXERS[mixer].overrides.items()})
    return Config.from_dict(base, where=f"mqar mixer {mixer}")


def state_floats(config: Config, length: int) -> int:
    """Floats a model keeps to continue a sequence after ``length`` tokens, summed over its layers.

    GDN-2 layer: the recurrent state (value heads x key dim x value dim) and the short-convolution
    tails ((conv_size - 1) x (2 key_dim + value_dim)), whatever the length. Attention layer: the keys
    and values of the positions it can still see (KV heads x head size x 2 per position): all
    ``length`` of them for full attention, at most the window for sliding-window attention."""
    total = 0
    for i in range(config.n_layer):
        if config.is_gdn2_layer(i):
            total += config.gdn2_num_v_heads * config.gdn2_head_dim * config.gdn2_head_v_dim
            total += (config.gdn2_conv_size - 1) * (2 * config.gdn2_key_dim + config.gdn2_value_dim)
        else:
            seen = length if config.sliding_window is None else min(config.sliding_window, length)
            total += 2 * seen * config.n_query_groups * config.head_size
    return total


class MQARModel(nn.Module):
    """Embedding (plus one learned vector), ``n_layer`` pre-norm residual blocks ``x + mixer(norm(x))``
    without MLP, final norm and output head tied to the embedding. Layer ``i`` is a GDN-2 layer or
    (sliding-window) attention as in ``config``."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        d = config.n_embd
        self.embed = Embedding(config.vocab_size, d, std=0.02)
        # one vector added to every token's embedding: attention has no biases, and RoPE can attend to
        # "the previous token" only through a direction all tokens share, which each embedding would
        # otherwise learn alone (attention at (64, 4) after 400 x 32 sequences: 0.006 without, 0.08 with)
        self.embed_bias = nn.Parameter(torch.zeros(d))
        self.norms = nn.ModuleList(RMSNorm(d, eps=config.norm_eps) for _ in range(config.n_layer))
        self.mixers = nn.ModuleList(GatedDeltaNet2(config, i) if config.is_gdn2_layer(i) else CausalSelfAttention(config, i)
                                    for i in range(config.n_layer))
        self.norm_f = RMSNorm(d, eps=config.norm_eps)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx int64 [B, T] -> final-norm hidden states [B, T, d] (autocast's dtype where it is on)."""
        x = self.embed(idx) + self.embed_bias
        layout = TokenLayout(torch.arange(idx.shape[1], device=idx.device))
        for norm, mixer in zip(self.norms, self.mixers):
            h = norm(x)
            x = x + mixer(h, layout)
        return self.norm_f(x)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """idx, labels int64 [B, T] (-100: not scored) -> (mean cross-entropy over the scored positions,
        fp32 scalar; correct argmax predictions, int64 scalar; scored positions, int64 scalar).

        The head runs on the scored positions only (one in about four tokens is an answer at most)."""
        scored = labels != IGNORE
        h = self.hidden(idx)[scored]
        target = labels[scored]
        # the head is the embedding (tied): a recalled value's embedding is its own logit direction
        logits = F.linear(h, self.embed.weight.to(h.dtype)).float()
        loss = F.cross_entropy(logits, target)
        return loss, (logits.argmax(-1) == target).sum(), target.new_tensor(target.numel())


# ------------------------------------------------------------------------------------------------
# settings

TRAIN_SHAPES = (Shape(64, 4), Shape(128, 8), Shape(256, 16), Shape(256, 32), Shape(256, 64))
TEST_SHAPES = TRAIN_SHAPES + (Shape(512, 64), Shape(512, 128), Shape(1024, 256))

# Sizes per preset; every one can be set by its flag. ``cpu``: the check that data, masking and scoring
# are wired, minutes on 2 CPU cores. ``full``: the study, on a GPU.
PRESETS: dict[str, dict[str, Any]] = {
    # the CPU preset checks the wiring with one recurrent mixer and the attention ones: the GDN-2 family's
    # CPU path is slow (each such run takes about two minutes on 2 cores), so the others are asked by name
    "cpu": dict(mixers=("gdn2", "swa", "attention"), widths=(64,), lrs=(3e-3, 1e-2), steps=600, batch_size=16,
                train_shapes=(Shape(64, 4),),
                test_shapes=(Shape(64, 4), Shape(128, 8), Shape(256, 16)), test_examples=128, device="cpu"),
    "full": dict(mixers=tuple(MIXERS), widths=(64, 128, 256), lrs=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2), steps=8000, batch_size=64,
                 train_shapes=TRAIN_SHAPES, test_shapes=TEST_SHAPES, test_examples=1000, device="auto"),
}


@dataclass(frozen=True)
class Settings:
    """One invocation: the grid (mixers x widths x learning rates) and what every run of it shares."""

    mixers: tuple[str, ...]
    widths: tuple[int, ...]
    lrs: tuple[float, ...]
    steps: int
    batch_size: int
    train_shapes: tuple[Shape, ...]
    test_shapes: tuple[Shape, ...]
    test_examples: int
    seed: int = 0
    vocab_size: int = 8192
    window: int = 64
    power_a: float = 0.01
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    device: str = "cpu"
    out: str = "out/mqar"

    @property
    def precision(self) -> str:
        """bf16 autocast on CUDA, fp32 elsewhere."""
        return "bf16-autocast" if self.device.startswith("cuda") else "fp32"

    @property
    def max_length(self) -> int:
        return max(s.length for s in self.train_shapes + self.test_shapes)

    def shared(self) -> dict[str, Any]:
        """What a run's result depends on besides its mixer, width and rate (JSON types): a recorded
        run is reused only where all of it agrees."""
        return {"steps": self.steps, "batch_size": self.batch_size, "seed": self.seed, "vocab_size": self.vocab_size,
                "window": self.window, "power_a": self.power_a, "warmup_fraction": self.warmup_fraction,
                "weight_decay": self.weight_decay, "betas": list(self.betas), "grad_clip": self.grad_clip,
                "train_shapes": [s.name for s in self.train_shapes], "test_shapes": [s.name for s in self.test_shapes],
                "test_examples": self.test_examples, "precision": self.precision}


def _at_least(flag: str, value: int, least: int = 1) -> int:
    if value < least:
        raise ValueError(f"{flag}: expected an integer >= {least}, got {value}")
    return value


def _shapes(flag: str, text: str) -> tuple[Shape, ...]:
    shapes = []
    for item in list_items(text):
        try:
            shape = Shape.parse(item)
        except ValueError:
            raise ValueError(f"{flag}: expected LENGTH:PAIRS items such as 64:4, got {item!r}") from None
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"{flag}: give at least one LENGTH:PAIRS")
    return tuple(dict.fromkeys(shapes))


def _check_shapes(flag: str, shapes: tuple[Shape, ...], vocab_size: int) -> tuple[Shape, ...]:
    """The shapes, if the task can be posed in each of them (else ValueError naming ``flag``)."""
    for s in shapes:
        if s.pairs < 1:
            raise ValueError(f"{flag}: {s.name} needs at least one pair")
        if s.pairs > vocab_size // 2:
            raise ValueError(f"{flag}: {s.name} has more pairs than the {vocab_size // 2} keys of the vocabulary")
        if s.length < 4 * s.pairs:
            raise ValueError(f"{flag}: length {s.length} is too short for {s.pairs} pairs (the pairs and one query "
                             f"slot per pair need 4 x pairs = {4 * s.pairs} tokens)")
    return shapes


def _device(text: str) -> str:
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {text} asked for, but CUDA is not available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device: {text} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return str(device)


def resolve_settings(args: "MqarOptions") -> Settings:
    """Settings from the preset and the flags given; ValueError naming the flag for a bad value."""
    preset = PRESETS[args.preset]
    vocab_size = _at_least("--vocab_size", args.vocab_size, least=4) if args.vocab_size is not None else 8192
    names = tuple(dict.fromkeys(list_items(args.mixers))) if args.mixers else preset["mixers"]
    unknown = [m for m in names if m not in MIXERS]
    if unknown or not names:
        raise ValueError(f"--mixers: unknown mixer {', '.join(unknown) or '(none given)'}; "
                         f"the table has {', '.join(MIXERS)}")
    mixers = list(names)
    widths = parse_numbers(args.widths, "--widths", int) if args.widths else preset["widths"]
    for w in widths:
        if w % 32 or w // 2 > MAX_HEAD_DIM:
            raise ValueError(f"--widths: {w} is not a multiple of 32 up to {2 * MAX_HEAD_DIM} (two heads of width / 2, "
                             "a multiple of 16 that the kernels take)")
    window = _at_least("--window", args.window) if args.window is not None else 64
    train = _check_shapes("--train_shapes", _shapes("--train_shapes", args.train_shapes) if args.train_shapes
                          else preset["train_shapes"], vocab_size)
    test = _check_shapes("--test_shapes", _shapes("--test_shapes", args.test_shapes) if args.test_shapes
                         else preset["test_shapes"], vocab_size)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out: {args.out} exists and is not a folder")
    device = _device(args.device or preset["device"])
    return Settings(
        mixers=tuple(mixers), widths=tuple(widths),
        lrs=tuple(parse_numbers(args.lrs, "--lrs") if args.lrs else preset["lrs"]),
        steps=_at_least("--steps", args.steps) if args.steps is not None else preset["steps"],
        batch_size=_at_least("--batch_size", args.batch_size) if args.batch_size is not None else preset["batch_size"],
        train_shapes=train, test_shapes=test,
        test_examples=(_at_least("--test_examples", args.test_examples) if args.test_examples is not None
                       else preset["test_examples"]),
        seed=_at_least("--seed", args.seed, least=0) if args.seed is not None else 0, vocab_size=vocab_size,
        window=window, device=device, out=args.out)


# ------------------------------------------------------------------------------------------------
# training and testing


def _autocast(device: torch.device):
    """bf16 autocast on CUDA (the Triton operators' training dtype); fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _operators_for(device: torch.device) -> Iterator[None]:
    """On a CPU the operators' torch oracles (Triton's interpreter would take hours, whatever
    GDN2_BACKEND says); on CUDA the operators' own choice (Triton)."""
    if device.type == "cuda":
        yield
        return
    from gdn2.ops.backend import override

    with override(backend="torch"):
        yield


def _optimizer(model: nn.Module, lr: float, s: Settings, device: torch.device) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norm weights, biases) and on the GDN-2 decay parameters."""
    decay, exempt = [], []
    for p in model.parameters():
        (exempt if p.ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=s.betas, fused=device.type == "cuda" or None)


@torch.no_grad()
def evaluate(model: MQARModel, s: Settings, device: torch.device) -> dict[str, float]:
    """Accuracy (correct answers / answers) on each test shape's ``test_examples`` sequences, the same
    sequences for every model (they depend on the seed alone)."""
    model.eval()
    out = {}
    for shape in s.test_shapes:
        inputs, labels = make_batch(shape, s.test_examples, _seed(s.seed, "test", shape.length, shape.pairs),
                                    s.vocab_size, s.power_a)
        # test batches of about as many tokens as a training batch of the longest training shape
        rows = max(1, s.batch_size * max(t.length for t in s.train_shapes) // shape.length)
        correct = total = 0
        for start in range(0, s.test_examples, rows):
            with _autocast(device):
                _, c, n = model(inputs[start:start + rows].to(device), labels[start:start + rows].to(device))
            correct, total = correct + int(c), total + int(n)
        out[shape.name] = correct / total
    model.train()
    return out


def train_run(mixer: str, width: int, lr: float, s: Settings) -> dict[str, Any]:
    """Train one model (``s.steps`` steps, one batch of one training shape per step, the shapes in
    turn), test it and return its record (JSON types)."""
    device = torch.device(s.device)
    config = model_config(mixer, width, s.vocab_size, s.max_length, s.window)
    torch.manual_seed(s.seed)  # the same initialisation for every rate of a mixer and width
    started = time.perf_counter()
    with _operators_for(device):
        model = MQARModel(config).to(device)
        optimizer = _optimizer(model, lr, s, device)
        warmup = max(1, round(s.warmup_fraction * s.steps))
        log_every = max(1, s.steps // 50)
        curve: list[list[float]] = []
        running, diverged = torch.zeros((), device=device), False
        for step in range(s.steps):
            for group in optimizer.param_groups:
                group["lr"] = cosine_with_warmup(step, lr, warmup, s.steps, 0.0)
            shape = s.train_shapes[step % len(s.train_shapes)]
            inputs, labels = make_batch(shape, s.batch_size, _seed(s.seed, "train", step), s.vocab_size, s.power_a)
            with _autocast(device):
                loss, _, _ = model(inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            running += loss.detach()
            if (step + 1) % log_every == 0 or step + 1 == s.steps:
                n = (step % log_every) + 1
                mean = float(running) / n  # one host synchronisation per logged interval
                running.zero_()
                curve.append([step + 1, mean])
                if not math.isfinite(mean):
                    diverged = True  # nothing more to learn: the weights are not finite
                    break
        accuracy = ({t.name: 0.0 for t in s.test_shapes} if diverged else evaluate(model, s, device))
    tail = [loss for _, loss in curve[-max(1, len(curve) // 10):]]
    return {
        "mixer": mixer, "width": width, "lr": lr, "settings": s.shared(), "config": config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "state_floats": {t.name: state_floats(config, t.length) for t in s.test_shapes},
        "accuracy": accuracy, "mean_accuracy": sum(accuracy.values()) / len(accuracy),
        "final_loss": sum(tail) / len(tail), "diverged": diverged, "loss_curve": curve,
        "steps_done": int(curve[-1][0]) if curve else 0, "seconds": round(time.perf_counter() - started, 2),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


# ------------------------------------------------------------------------------------------------
# the sweep and its record


def _matches(record: dict[str, Any], mixer: str, width: int, lr: float, s: Settings) -> bool:
    """Whether ``record`` is the run of (mixer, width, lr) under these settings and this version's
    model config of the mixer."""
    if (record.get("mixer"), record.get("width"), record.get("lr")) != (mixer, width, lr):
        return False
    if record.get("settings") != s.shared():
        return False
    return record.get("config") == model_config(mixer, width, s.vocab_size, s.max_length, s.window).to_dict()


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"format": FORMAT, "runs": []}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path}: not JSON (move it away to start a new record)") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an mqar record of format {FORMAT} (move it away to start a new record)")
    return data


def _write(path: Path, text: str) -> None:
    """Whole or not at all: an interrupted write leaves the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_sweep(s: Settings, log=print) -> dict[str, Any]:
    """Train and test every run of the grid not yet recorded in ``s.out/mqar.json`` (saved after each),
    then write the report of all recorded runs under these settings. Returns the JSON written."""
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mqar.json"
    data = _load(path)
    grid = [(m, w, lr) for m in s.mixers for w in s.widths for lr in s.lrs]
    for index, (mixer, width, lr) in enumerate(grid, start=1):
        where = f"[{index}/{len(grid)}] {mixer} width {width} lr {lr:g}"
        if any(_matches(r, mixer, width, lr, s) for r in data["runs"]):
            log(f"mqar: {where}: recorded, skipped")
            continue
        record = train_run(mixer, width, lr, s)
        data["runs"] = [r for r in data["runs"] if not _matches(r, mixer, width, lr, s)] + [record]
        _write(path, json.dumps(data, indent=1) + "\n")
        accuracies = ", ".join(f"{k} {v:.3f}" for k, v in record["accuracy"].items())
        log(f"mqar: {where}: {record['steps_done']} steps in {record['seconds']:.1f} s, loss {record['final_loss']:.3f}"
            f"{' (diverged)' if record['diverged'] else ''}, accuracy {accuracies}")
    runs = [r for r in data["runs"] if r.get("settings") == s.shared()]
    data["summary"] = summarise(runs, s)
    _write(path, json.dumps(data, indent=1) + "\n")
    (out / "mqar.md").write_text(markdown(data["summary"], len(data["runs"]) - len(runs)))
    try:
        plot(data["summary"], out / "mqar.png")
    except ImportError:  # matplotlib comes with the dev and eval extras, not with the package itself
        log("mqar: matplotlib is not installed: no mqar.png (pip install matplotlib)")
    return data


def _mixer_order(name: str) -> int:
    return list(MIXERS).index(name) if name in MIXERS else len(MIXERS)


def summarise(runs: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Per (mixer, width): its run at the best rate (highest mean test accuracy; the lower rate on a
    tie) and the mean accuracy of every rate tried."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["mixer"], r["width"]), []).append(r)
    best, sweep = [], []
    for (mixer, width), group in sorted(groups.items(), key=lambda kv: (_mixer_order(kv[0][0]), kv[0][1])):
        group.sort(key=lambda r: r["lr"])
        top = max(group, key=lambda r: (r["mean_accuracy"], -r["lr"]))
        best.append({k: top[k] for k in ("mixer", "width", "lr", "parameters", "state_floats", "accuracy",
                                          "mean_accuracy", "final_loss", "seconds", "device")})
        sweep.append({"mixer": mixer, "width": width, "best_lr": top["lr"],
                      "mean_accuracy": {f"{r['lr']:g}": r["mean_accuracy"] for r in group},
                      "diverged": [f"{r['lr']:g}" for r in group if r["diverged"]]})
    return {"settings": s.shared(), "test_shapes": [t.name for t in s.test_shapes], "best": best, "sweep": sweep}


def _floats_text(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def markdown(summary: dict[str, Any], other_runs: int = 0) -> str:
    """The report: accuracy per test shape at each model's best rate, then the rate sweep."""
    tests, st = summary["test_shapes"], summary["settings"]
    head = ["mixer", "width", "best lr", "params", "state (floats)"] + tests + ["mean"]
    lines = ["# MQAR", "", "Accuracy on the answers of each test (length:pairs), at the best learning rate of each "
             "mixer and width (highest mean test accuracy).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in summary["best"]:
        states = [b["state_floats"][t] for t in tests]
        state = _floats_text(states[0]) if min(states) == max(states) else \
            f"{_floats_text(min(states))} - {_floats_text(max(states))}"
        row = [b["mixer"], str(b["width"]), f"{b['lr']:g}", f"{b['parameters']:,}", state]
        row += [f"{b['accuracy'][t]:.3f}" for t in tests] + [f"{b['mean_accuracy']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    rates = sorted({float(lr) for sw in summary["sweep"] for lr in sw["mean_accuracy"]})
    lines += ["", "## Learning-rate sweep", "", "Mean test accuracy per learning rate; the best in bold, "
              "`div.` where the loss stopped being finite.", "",
              "| mixer | width | " + " | ".join(f"{lr:g}" for lr in rates) + " |", "|" + "---|" * (2 + len(rates))]
    for sw in summary["sweep"]:
        cells = []
        for lr in rates:
            value = sw["mean_accuracy"].get(f"{lr:g}")
            text = "-" if value is None else "div." if f"{lr:g}" in sw["diverged"] else f"{value:.3f}"
            cells.append(f"**{text}**" if value is not None and lr == sw["best_lr"] else text)
        lines.append(f"| {sw['mixer']} | {sw['width']} | " + " | ".join(cells) + " |")
    devices = sorted({b["device"] for b in summary["best"]})
    trained = st["train_shapes"][0] if len(st["train_shapes"]) == 1 else f"{', '.join(st['train_shapes'])} in turn"
    lines += ["", f"Settings: {st['steps']} steps of {st['batch_size']} sequences of {trained}, "
              f"{st['test_examples']} test sequences per shape, vocabulary "
              f"{st['vocab_size']}, seed {st['seed']}, sliding window {st['window']}, {st['precision']}"
              + (f", on {', '.join(devices)}" if devices else "") + ". State: floats kept to continue a sequence "
              "(GDN-2: recurrent state and short-convolution tails; attention: keys and values at the test length, "
              "at most the window); where it depends on the length, from the shortest test to the longest."]
    if other_runs:
        lines += ["", f"{other_runs} recorded run(s) with other settings are in mqar.json and not shown."]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Accuracy against state size, one panel per test shape, one line per mixer through its widths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tests = summary["test_shapes"]
    cols = min(4, len(tests))
    rows = math.ceil(len(tests) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows), squeeze=False)
    mixers = sorted({b["mixer"] for b in summary["best"]}, key=_mixer_order)
    states = [v for b in summary["best"] for v in b["state_floats"].values()] or [1]
    markers = "osD^vP*X"
    for ax, test in zip(axes.flat, tests):
        for i, mixer in enumerate(mixers):
            points = sorted((b["state_floats"][test], b["accuracy"][test], b["width"])
                            for b in summary["best"] if b["mixer"] == mixer)
            # open markers of different shapes: mixers that land on one point (swa and attention when the
            # window covers the test) stay visible
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=markers[i % len(markers)],
                    markerfacecolor="none", color=f"C{i}", label=mixer)
            for x, y, width in points:
                ax.annotate(str(width), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=f"C{i}")
        ax.set_xscale("log")
        ax.set_xlim(min(states) / 2, max(states) * 2)  # one scale for every panel
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"length {test.replace(':', ', pairs ')}", fontsize=9)
        ax.set_xlabel("state (floats)", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tests):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("MQAR: accuracy at the best learning rate against state size (labels: width)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# command line


@dataclass(kw_only=True)
class MqarOptions:
    """The flags of ``python -m gdn2 mqar``, checked by :func:`resolve_settings` (a list flag's items are
    separated by commas or spaces)."""

    preset: str = option("cpu", "cpu: width 64, rates 3e-3 and 1e-2, 600 steps of 16 sequences of 64:4 on the CPU "
                                "(about 4 minutes on 2 cores); full: widths 64,128,256, rates 1e-4..1e-2, 8000 steps of "
                                "64 sequences of every shape, the GPU when present", choices=sorted(PRESETS))
    mixers: Optional[str] = option(None, f"comma-separated rows of the mixer table: {', '.join(MIXERS)}",
                                   meaning_of_null="the preset's: gdn2, swa, attention for cpu; all for full")
    widths: Optional[str] = option(None, "comma-separated model widths (d_model), multiples of 32",
                                   meaning_of_null="the preset's")
    lrs: Optional[str] = option(None, "comma-separated peak learning rates (the sweep)", meaning_of_null="the preset's")
    steps: Optional[int] = option(None, "optimizer steps per run", meaning_of_null="the preset's")
    batch_size: Optional[int] = option(None, "sequences per step", meaning_of_null="the preset's")
    train_shapes: Optional[str] = option(None, "comma-separated LENGTH:PAIRS trained on in turn (full: 64:4,128:8,"
                                               "256:16,256:32,256:64)", meaning_of_null="the preset's")
    test_shapes: Optional[str] = option(None, "comma-separated LENGTH:PAIRS tested (full: the training shapes and "
                                              "512:64,512:128,1024:256)", meaning_of_null="the preset's")
    test_examples: Optional[int] = option(None, "test sequences per shape", meaning_of_null="the preset's")
    window: Optional[int] = option(None, "keys a sliding-window attention query sees", meaning_of_null="64")
    vocab_size: Optional[int] = option(None, "vocabulary: keys from the lower half, values from the upper",
                                       meaning_of_null="8192")
    seed: Optional[int] = option(None, "seed of the data (training and test) and of the initialisation",
                                 meaning_of_null="0")
    device: Optional[str] = option(None, "auto (CUDA when present), cpu, cuda or cuda:N",
                                   meaning_of_null="the preset's: cpu for cpu, auto for full")
    out: str = option("out/mqar", "folder of mqar.json, mqar.md and mqar.png")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_options(MqarOptions, list(argv or []), "gdn2 mqar", __doc__.split("\n\n")[0])
    if args is None:
        return 0
    settings = resolve_settings(args)
    started = time.perf_counter()
    run_sweep(settings, log=lambda line: print(line, flush=True))
    out = Path(settings.out)
    print((out / "mqar.md").read_text())
    written = ", ".join(name for name in ("mqar.json", "mqar.png") if (out / name).is_file())
    print(f"mqar: wrote {out / 'mqar.md'}, {written} ({time.perf_counter() - started:.0f} s)")
    return 0
