"""Text generation: one packed prefill, then one token per step from the model's InferenceCache.

    python -m gdn2.generate --checkpoint out/run/final.pt --prompt "Once upon a time" \\
        [--max-new-tokens 64] [--temperature 0.8 --top-k 50 --top-p 0.95 --seed 0] [--stop "\\n\\n"]

Prompts of different lengths: the prompts are packed into one row and prefilled as separate
documents (``GPT.prefill``), so each sees exactly what it would alone and nothing is padded; the GDN-2
states and conv tails go to the prompt's cache row, and attention keys go to columns that right-align
the prompts. Decoding then writes one shared column per step; a row whose prompt was shorter masks the
columns before its start, and RoPE uses each row's own positions.

On CUDA the decode step is captured once per batch-size bucket in a CUDA graph (every cache update is
in place, the column counter lives on the device), so a token costs one graph launch plus sampling.
While the host inspects token t for EOS and stop strings, the GPU already computes token t+1.

The decode step runs on a fused copy of the weights (``GPT.prepare_decoding``: one GEMM for all input
projections of a GDN-2 layer, one for the MLP's w1 | w2), refreshed at the start of every
``generate`` call if the parameters changed since. On CUDA it is also compiled with
``torch.compile`` by default: the first call at each batch-size bucket compiles (about 8-13 s for
``swa_gdn2_1.3B`` on an H200; once per process, shared by all Generators), later calls reuse it.
``compile=False`` / ``--no-compile`` skip the compiler; ``fused=False`` / ``--no-fused`` run the
parameters as they are (no extra memory for the copies).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from gdn2.config import Config
from gdn2.model import GPT, DecodeWeights, InferenceCache, compiled_block_step
from gdn2.tokenizer import TOKENIZER_FILE, Tokenizer

__all__ = ["SamplingParams", "Completion", "Generator", "generate", "sample_tokens", "filter_logits",
           "load_model", "read_checkpoint", "LoadedModel", "FoundCheckpoint", "parse_dtype"]


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy decoding; otherwise logits / temperature, then top-k (0 = off)
    and nucleus top-p (1.0 = off) filtering, then a draw from ``torch.Generator`` seeded with ``seed``
    (None: the global generator). A row stops at EOS (``stop_at_eos``), when its text contains one of
    ``stop`` (the text is cut before it), or after ``max_new_tokens``.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    stop_at_eos: bool = True
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top ``top_k`` and outside the smallest set whose probability
    reaches ``top_p`` (the most likely token always stays). logits: float [B, V] -> [B, V]."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token per row: logits [B, V] (any float dtype) -> int64 [B]."""
    if params.greedy:
        return logits.argmax(-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class Completion:
    """What one prompt produced: the new token ids (EOS excluded), their text (cut before a stop
    string; None without a tokenizer) and why it ended: 'eos', 'stop' or 'length'."""

    tokens: list[int]
    text: Optional[str]
    finish_reason: str


# --------------------------------------------------------------------------------------------------
# Decode step: eager or CUDA graph
# --------------------------------------------------------------------------------------------------

class CapturedDecodeStep:
    """``GPT.decode_step`` for one cache, captured in a CUDA graph: static token input, static logits.

    ``block_step`` and ``weights`` are passed on to ``GPT.decode_step``; the graph reads ``weights``'
    tensors where they are, so an in-place ``weights.refresh()`` reaches it, a reallocation does not.
    The cache is scribbled on while warming up; it must be reset before use (Generator does).
    """

    def __init__(self, model: GPT, cache: InferenceCache, pool: Optional[Any] = None,
                 block_step: Optional[Callable[..., torch.Tensor]] = None,
                 weights: Optional[DecodeWeights] = None) -> None:
        device = cache.column.device
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # compilation, autotuning and lazy initialisation stay out of the capture
                model.decode_step(self.tokens, cache, block_step, weights)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
            self.logits = model.decode_step(self.tokens, cache, block_step, weights)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


class Generator:
    """Batched generation with a reusable cache (and, on CUDA, captured decode steps).

    ``max_batch_size`` rows are allocated once; a call with more prompts runs in slices. On CUDA a
    batch of n prompts runs in the smallest power-of-two bucket >= n (extra rows hold a one-token
    dummy prompt), each bucket with its own graph over a view of the shared cache. ``max_length``
    bounds prompt + generated tokens only where a layer attends to everything (full attention);
    sliding-window and GDN-2 layers keep a bounded state. ``vocab_limit`` masks logits of ids the
    tokenizer does not know (models whose embedding is padded past the tokenizer's vocabulary).

    ``fused`` (default True): decode on :meth:`GPT.prepare_decoding`'s fused weight copies (the same
    logits, far fewer kernels per layer; 0.55x the weight bytes more memory for ``swa_gdn2_1.3B``,
    freed by :meth:`release`). They are refreshed at the start of every ``generate`` call when the parameters
    changed (optimizer step, ``load_state_dict``, in-place edits; see :class:`gdn2.model.DecodeWeights`;
    writes through ``p.data`` need ``generator.refresh_weights(force=True)``).
    ``compile`` (default: True on CUDA, False elsewhere): run the decode step's pieces through
    ``torch.compile`` (:func:`gdn2.model.compiled_block_step`). The cost is paid on the first call of
    each batch-size bucket, about 8-13 s for ``swa_gdn2_1.3B`` on an H200, once per process; on the
    H200 it took the CUDA-graph decode step of that model from 3.27 to 1.94 ms per token at batch 1.
    """

    def __init__(self, model: GPT, tokenizer: Optional[Tokenizer] = None, max_batch_size: int = 8,
                 max_length: Optional[int] = None, cuda_graph: Optional[bool] = None,
                 vocab_limit: Optional[int] = None, compile: Optional[bool] = None, fused: bool = True) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_length = max_length or model.config.block_size
        self.device = model.lm_head.weight.device
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph=True needs the model on a CUDA device")
        if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, the model only "
                             f"{model.config.vocab_size}")
        limit = vocab_limit if vocab_limit is not None else (tokenizer.vocab_size if tokenizer else None)
        self.vocab_limit = limit if limit is not None and limit < model.config.vocab_size else None
        self.compile = (self.device.type == "cuda") if compile is None else bool(compile)
        self.fused = bool(fused)
        # the compiled pieces are shared process-wide: each (layer kind, batch size) compiles once
        self._block_step = compiled_block_step() if self.compile else None
        self._weights: Optional[DecodeWeights] = None
        self._cache: Optional[InferenceCache] = None
        self._steps: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._pool = None

    # ---- resources --------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        if not self.cuda_graph:
            return n
        b = 1
        while b < n:
            b *= 2
        return min(b, self.max_batch_size)

    def _cache_rows(self, n: int) -> InferenceCache:
        if self._cache is None:
            dtype = self.model.lm_head.weight.dtype
            self._cache = InferenceCache(self.model, self.max_batch_size, device=self.device, dtype=dtype,
                                         max_length=self.max_length)
        return self._cache.rows(n)

    def refresh_weights(self, force: bool = False) -> Optional[DecodeWeights]:
        """Make the fused weight copies match the parameters (built on first use; see
        :meth:`DecodeWeights.refresh`). Captured graphs are dropped if a copy had to be reallocated.
        Returns the weights (None when ``fused=False``)."""
        if not self.fused:
            return None
        if self._weights is None:
            self._weights = self.model.prepare_decoding()
        elif self._weights.refresh(force=force):
            # a dtype or device change: the captured graphs read the old tensors, the cache is stale too
            self._steps, self._cache = {}, None
        return self._weights

    def _step_fn(self, cache: InferenceCache) -> Callable[[torch.Tensor], torch.Tensor]:
        weights = self._weights if self.fused else None
        if not self.cuda_graph:
            return lambda tokens: self.model.decode_step(tokens, cache, self._block_step, weights)
        B = cache.batch_size
        if B not in self._steps:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._steps[B] = CapturedDecodeStep(self.model, cache, self._pool, self._block_step, weights)
        return self._steps[B]

    def release(self) -> None:
        """Free the cache, the captured graphs and the fused weight copies (e.g. before training
        resumes). The compiled code stays (it is shared by the process)."""
        self._cache, self._steps, self._pool, self._weights = None, {}, None, None

    # ---- generation -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 params: Optional[SamplingParams] = None, **kwargs: Any) -> list[Completion]:
        """Continue each prompt (a str, encoded without BOS, or a list of token ids).

        ``params`` or keyword arguments of :class:`SamplingParams`. Returns one Completion per prompt,
        in order.
        """
        params = params or SamplingParams(**kwargs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        encoded = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids instead")
                p = self.tokenizer.encode(p)
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. EOS as a document start)")
            encoded.append(p)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        self.refresh_weights()
        out: list[Completion] = []
        for s in range(0, len(encoded), self.max_batch_size):
            out += self._generate_batch(encoded[s: s + self.max_batch_size], params, generator)
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        generator: Optional[torch.Generator]) -> list[Completion]:
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        B = self._bucket(n)
        cache = self._cache_rows(B)
        if cache.full_attention() and longest + params.max_new_tokens - 1 > self.max_length:
            raise ValueError(f"prompt of {longest} tokens + {params.max_new_tokens} new tokens exceeds "
                             f"max_length {self.max_length} of the full-attention cache")
        step = self._step_fn(cache)  # capture first: warming up scribbles on the cache
        cache.reset()
        dummy = [self.tokenizer.eos_id if self.tokenizer is not None and self.tokenizer.eos_id >= 0 else 0]
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts + [dummy] * (B - n)]
        logits = self.model.prefill(rows, cache)

        eos = self.tokenizer.eos_id if self.tokenizer is not None else -1
        tokens: list[list[int]] = [[] for _ in range(n)]
        texts: list[Optional[str]] = [None] * n
        reasons: list[Optional[str]] = [None] * n
        on_cuda = self.device.type == "cuda"
        host = torch.empty(B, dtype=torch.long, pin_memory=on_cuda)
        copied = torch.cuda.Event() if on_cuda else None
        for t in range(params.max_new_tokens):
            if self.vocab_limit is not None:
                logits[:, self.vocab_limit:] = float("-inf")
            next_tokens = sample_tokens(logits, params, generator)
            host.copy_(next_tokens, non_blocking=on_cuda)
            if copied is not None:
                copied.record()
            if t + 1 < params.max_new_tokens:
                logits = step(next_tokens)  # queued: the GPU works on t+1 while the host checks t
            if copied is not None:
                copied.synchronize()
            for r, tok in enumerate(host[:n].tolist()):
                if reasons[r] is not None:
                    continue
                if params.stop_at_eos and tok == eos:
                    reasons[r] = "eos"
                    continue
                tokens[r].append(tok)
                if params.stop:
                    text = self.tokenizer.decode(tokens[r])
                    cut = _first_stop(text, params.stop)
                    if cut is not None:
                        texts[r], reasons[r] = text[:cut], "stop"
            if all(reason is not None for reason in reasons):
                break
        if on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        result = []
        for r in range(n):
            text = texts[r]
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(tokens[r])
            result.append(Completion(tokens[r], text, reasons[r] or "length"))
        return result


def _first_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def generate(model: GPT, tokenizer: Optional[Tokenizer], prompts: Sequence[Union[str, Sequence[int]]],
             max_batch_size: int = 8, cuda_graph: Optional[bool] = None, compile: Optional[bool] = None,
             fused: bool = True, **kwargs: Any) -> list[Completion]:
    """One-shot helper: ``Generator(model, tokenizer, ...).generate(prompts, **sampling_kwargs)``."""
    return Generator(model, tokenizer, max_batch_size=max_batch_size, cuda_graph=cuda_graph, compile=compile,
                     fused=fused).generate(prompts, **kwargs)


# --------------------------------------------------------------------------------------------------
# Loading a checkpoint for inference
# --------------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def parse_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """``None``/'auto': bf16 on CUDA, fp32 elsewhere; else a dtype or one of :data:`DTYPES`' names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[name]


@dataclass
class FoundCheckpoint:
    """A checkpoint's weights with the config and tokenizer that belong to it."""

    path: Path
    state_dict: dict[str, torch.Tensor]
    config: Config
    tokenizer: Path
    extra: dict = field(default_factory=dict)


# Where a consolidated file keeps its parts (checked in this order).
STATE_KEYS = ("model", "state_dict", "model_state_dict")
CONFIG_KEYS = ("config", "model_config")
# Wrapper prefixes that compiled / distributed modules add to parameter names.
WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.")
CONSOLIDATED_NAMES = ("model.pt", "consolidated.pt", "lit_model.pth", "model.pth")
RUN_CONFIG_NAMES = ("config.yaml", "hparams.yaml", "run_config.yaml")


def _strip_prefixes(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        out[key] = value
    return out


def _search_dirs(path: Path) -> list[Path]:
    """The checkpoint's folder and up to two parents (a run folder holds its checkpoints in a subfolder)."""
    start = path if path.is_dir() else path.parent
    return [start, *list(start.parents)[:2]]


def _config_from_saved(data: Any, where: str) -> Optional[Config]:
    """A Config from a saved dict: either the model fields or a whole run config with a 'model' section."""
    if isinstance(data, Config):
        return data
    if isinstance(data, dict):
        model = data.get("model", data) if isinstance(data.get("model"), dict) else data
        return Config.from_dict(dict(model), where=f"{where}: model")
    return None


def _data_folders(run: dict) -> list[str]:
    """Folders of the data sources a saved run config names (``data.train`` / ``data.val``)."""
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    sources = list(data.get("train") or []) if isinstance(data.get("train"), list) else [data.get("train")]
    sources.append(data.get("val"))
    folders = []
    for src in sources:
        src = src.get("path") if isinstance(src, dict) else src
        if isinstance(src, str) and src:
            # a glob or a shard file names its folder; a folder names itself
            folders.append(src if not any(c in src for c in "*?[") and not src.endswith(".bin")
                           else os.path.dirname(src))
    return folders


def find_run_tokenizer(run: dict, bases: Sequence[Path]) -> Optional[Path]:
    """The tokenizer a saved run config leads to: ``data.tokenizer`` / ``tokenizer`` when recorded,
    else ``tokenizer.model`` in, or the ``manifest.json`` of, each data folder it trained on. Relative
    paths are tried against each of ``bases``."""
    import json

    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    named = [v for v in (data.get("tokenizer"), run.get("tokenizer")) if isinstance(v, str) and v]
    candidates: list[Path] = [Path(v) for v in named]
    for folder in _data_folders(run):
        candidates.append(Path(folder) / TOKENIZER_FILE)
        for base in [Path(folder)] + [b / folder for b in bases]:
            manifest = base / "manifest.json"
            if manifest.is_file():
                try:
                    recorded = json.loads(manifest.read_text()).get("tokenizer", {})
                except ValueError:
                    continue
                if isinstance(recorded, dict) and recorded.get("path"):
                    candidates.append(Path(recorded["path"]))
    for c in candidates:
        for p in ([c] if c.is_absolute() else [b / c for b in bases]):
            p = p / TOKENIZER_FILE if p.is_dir() else p
            if p.is_file():
                return p
    return None


def read_checkpoint(checkpoint: Union[str, os.PathLike], config: Optional[Union[str, Config]] = None,
                    tokenizer: Optional[Union[str, os.PathLike]] = None) -> FoundCheckpoint:
    """Find and read a checkpoint, its config and its tokenizer.

    ``checkpoint``: a consolidated file (``pretrain/consolidate.py``: ``{"model": state_dict,
    "config": model config dict, "step", "tokens", "recipe"}``; a bare state dict works when the
    config is found elsewhere), a training checkpoint folder ``step-<N>`` (its ``model.pt`` when
    consolidated, else its shards are read through the trainer's ``consolidate_checkpoint``), or a
    folder of those (the newest complete one). The config comes from ``config`` (a name, YAML path or
    Config), else the file, else a run config (``config.yaml``) beside the checkpoint or up to two
    folders above it. The tokenizer comes from ``tokenizer``, else ``tokenizer.model`` in those
    folders, else the data folders the saved run trained on (their ``tokenizer.model`` or the
    tokenizer their ``manifest.json`` records).
    """
    import yaml

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    extra: dict = {}
    saved_config = None
    if path.is_dir() and not any((path / n).is_file() for n in CONSOLIDATED_NAMES):
        path = _newest_step_folder(path)
    if path.is_dir():
        files = [path / n for n in CONSOLIDATED_NAMES if (path / n).is_file()]
        if files:
            path = files[0]
    if path.is_dir():
        state, saved_config, extra = _read_sharded(path)
    else:
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(f"checkpoint {str(path)!r} could not be read as a torch file: {e}") from e
        if not isinstance(blob, dict):
            raise ValueError(f"checkpoint {str(path)!r}: expected a dict, got {type(blob).__name__}")
        state = next((blob[k] for k in STATE_KEYS if isinstance(blob.get(k), dict)), None)
        if state is None:
            if all(isinstance(v, torch.Tensor) for v in blob.values()):
                state = blob
            else:
                raise ValueError(f"checkpoint {str(path)!r}: no model state dict under {', '.join(STATE_KEYS)}")
        saved_config = next((blob[k] for k in CONFIG_KEYS if k in blob), None)
        extra = {k: v for k, v in blob.items() if k not in STATE_KEYS + CONFIG_KEYS}
    state = _strip_prefixes(state)

    runs: list[tuple[Path, dict]] = []
    if isinstance(extra.get("recipe"), dict):
        runs.append((path, extra["recipe"]))
    for d in _search_dirs(path):
        for name in RUN_CONFIG_NAMES:
            f = d / name
            if f.is_file():
                with open(f) as fh:
                    data = yaml.safe_load(fh)
                if isinstance(data, dict):
                    runs.append((f, data))

    if isinstance(config, Config):
        cfg = config
    elif config is not None:
        cfg = Config.from_name(str(config))
    elif saved_config is not None:
        cfg = _config_from_saved(saved_config, str(path))
    else:
        cfg = next((_config_from_saved(data, str(f)) for f, data in runs if isinstance(data.get("model"), dict)),
                   None)
    if cfg is None:
        looked = ", ".join(str(d / n) for d in _search_dirs(path) for n in RUN_CONFIG_NAMES)
        raise ValueError(f"checkpoint {str(path)!r}: model config missing: none saved in the checkpoint, none of "
                         f"{looked} exists; pass config=<name or YAML path>")

    if tokenizer is not None:
        tok = Path(tokenizer)
        tok = tok / TOKENIZER_FILE if tok.is_dir() else tok
        if not tok.is_file():
            raise FileNotFoundError(f"tokenizer {str(tok)!r} does not exist")
    else:
        candidates = [d / TOKENIZER_FILE for d in _search_dirs(path)]
        tok = next((c for c in candidates if c.is_file()), None)
        if tok is None:
            # relative data paths in a run config are relative to where the run was started
            bases = [Path.cwd(), *_search_dirs(path), Path(__file__).resolve().parent.parent]
            tok = next((t for _, data in runs if (t := find_run_tokenizer(data, bases)) is not None), None)
        if tok is None:
            raise FileNotFoundError(
                f"checkpoint {str(path)!r}: tokenizer missing: none of {', '.join(map(str, candidates))} exists and "
                "no saved run config leads to one; pass tokenizer=<path to tokenizer.model>")
    return FoundCheckpoint(path, state, cfg, tok, extra)


def _newest_step_folder(path: Path) -> Path:
    """``path`` itself when it is a checkpoint folder, else its newest complete ``step-<N>`` child."""
    try:
        from gdn2.train import checkpoint as train_checkpoint
    except ImportError:
        return path
    if train_checkpoint.is_complete(path):
        return path
    found = train_checkpoint.list_checkpoints(path)
    return found[-1][1] if found else path


def _read_sharded(path: Path) -> tuple[dict[str, torch.Tensor], Optional[Any], dict]:
    """Model weights of a training checkpoint folder, through the trainer's own consolidation."""
    try:
        from gdn2.train import checkpoint as train_checkpoint
    except ImportError as e:
        raise ValueError(f"checkpoint {str(path)!r} is a folder without a consolidated model file "
                         f"({', '.join(CONSOLIDATED_NAMES)}) and the trainer's checkpoint reader is "
                         f"unavailable: {e}") from e
    if not train_checkpoint.is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r}: neither a consolidated model file "
                         f"({', '.join(CONSOLIDATED_NAMES)}) nor a complete training checkpoint (step-<N> with "
                         f"its {train_checkpoint.MARKER} marker) nor a folder of those")
    blob = train_checkpoint.consolidate_checkpoint(path)
    return blob["model"], blob["config"], {k: v for k, v in blob.items() if k not in ("model", "config")}


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Tokenizer
    config: Config
    checkpoint: Path
    extra: dict = field(default_factory=dict)


def load_model(checkpoint: Union[str, os.PathLike], config: Optional[Union[str, Config]] = None,
               tokenizer: Optional[Union[str, os.PathLike]] = None, device: Union[str, torch.device, None] = None,
               dtype: Union[str, torch.dtype, None] = None) -> LoadedModel:
    """Model (eval mode), tokenizer and config from a checkpoint (see :func:`read_checkpoint`).

    ``dtype``: see :func:`parse_dtype`; the GDN-2 decay parameters ``A_log`` / ``dt_bias`` stay fp32
    as in training. Raises FileNotFoundError / ValueError naming what is missing: the checkpoint, its
    config or its tokenizer.
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(dtype, device)
    found = read_checkpoint(checkpoint, config=config, tokenizer=tokenizer)
    tok = Tokenizer(found.tokenizer)
    with torch.device("meta"):
        model = GPT(found.config)
    model = model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(found.state_dict, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"checkpoint {str(found.path)!r} does not match config {found.config.name!r}: {e}") from e
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(found.path)!r} does not match config {found.config.name!r}: "
                         f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    keep_fp32 = {id(p) for block in model.transformer.h if block.kind == "gdn2"
                 for p in (block.mixer.A_log, block.mixer.dt_bias)}
    for p in model.parameters():
        if id(p) not in keep_fp32 or dtype == torch.float64:
            p.data = p.data.to(dtype)
        else:
            p.data = p.data.float()
    model.eval()
    return LoadedModel(model, tok, found.config, found.path, found.extra)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Generate text from a gdn2 checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="consolidated .pt file or training checkpoint directory")
    parser.add_argument("--config", help="config name or YAML path (default: the one saved with the checkpoint)")
    parser.add_argument("--tokenizer", help=f"{TOKENIZER_FILE} path (default: found beside the checkpoint)")
    parser.add_argument("--prompt", action="append", required=True, help="repeatable: prompts run as one batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="repeatable stop string")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the decode step (default: on CUDA; the first call compiles, ~10 s)")
    parser.add_argument("--no-fused", action="store_true",
                        help="decode on the parameters as they are, without the fused weight copies")
    args = parser.parse_args(argv)
    loaded = load_model(args.checkpoint, config=args.config, tokenizer=args.tokenizer, device=args.device,
                        dtype=args.dtype)
    gen = Generator(loaded.model, loaded.tokenizer, max_batch_size=len(args.prompt),
                    cuda_graph=False if args.no_cuda_graph else None, compile=args.compile,
                    fused=not args.no_fused)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop=tuple(s.encode().decode("unicode_escape") for s in args.stop),
                            seed=args.seed)
    for prompt, completion in zip(args.prompt, gen.generate(args.prompt, params)):
        print(f"{prompt}{completion.text}")
        print(f"[{len(completion.tokens)} tokens, {completion.finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
