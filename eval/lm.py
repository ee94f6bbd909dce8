"""The lm-eval harness adapter: a gdn2 GPT as lm-eval's model ``gdn2``.

    import gdn2.eval.lm  # registers the model name "gdn2" with lm-eval
    from gdn2.eval.harness import make_task_manager
    lm_eval.simple_evaluate(model="gdn2", model_args="checkpoint=out/run/final/model.pt", tasks=["piqa"],
                            task_manager=make_task_manager(["piqa"]))

or from a training loop, with the live model: ``gdn2.eval.harness.evaluate_model(model, tokenizer, tasks)``.

Scoring conventions:
- Training documents are tokenised without BOS and follow the previous document's EOS, so every
  context is prefixed with EOS (``context_prefix="eos"``; 'bos' or 'none' are available) and EOS is
  the conditioning token for empty contexts and for the first rolling window.
- ``loglikelihood``: requests sorted by length (longest first), right-padded into batches (the model
  is causal, so padding after a sequence never changes it); each continuation token is scored from the
  logits of the position before it, in fp32.
- ``loglikelihood_rolling``: lm-eval's rolling windows of ``max_length`` tokens made disjoint, so
  every token is predicted exactly once; all windows of all documents are batched together.
- ``generate_until``: :class:`gdn2.generation.Generator` (packed prefill, cached decoding, CUDA graphs);
  the answer is the new tokens decoded on their own and cut at the first ``until`` string, as
  lm-eval's ``hf`` model answers (so a leading word-boundary space is not part of it, and an export
  scored by ``hf`` gives the same answers).
- Data parallel: under torchrun (or an initialised process group) each rank takes every
  ``world_size``-th request, as lm-eval's other backends do.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from gdn2.checkpoint.load import load_model, parse_dtype
from gdn2.generation import Generator, SamplingParams
from gdn2.model import GPT
from gdn2.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["GDN2LM"]


def _as_int(value: Any, name: str, allow_none: bool = True) -> Optional[int]:
    if value is None or value == "" or (isinstance(value, str) and value.lower() == "none"):
        if allow_none:
            return None
        raise ValueError(f"{name} is required")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _as_bool(value: Any, name: str) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    s = str(value).lower()
    if s in ("1", "true", "yes"):
        return True
    if s in ("0", "false", "no"):
        return False
    if s in ("auto", "none", ""):
        return None
    raise ValueError(f"{name} must be true/false/auto, got {value!r}")


@register_model("gdn2")
class GDN2LM(TemplateLM):
    """A gdn2 GPT as an lm-eval language model.

    From a checkpoint: ``checkpoint=`` (consolidated file or training checkpoint folder), optional
    ``config=`` (name or YAML path) and ``tokenizer=`` (overriding what is saved with the
    checkpoint). In process: ``model=`` (a GPT) and ``tokenizer=`` (a Tokenizer or path).
    ``batch_size`` (int, or 'auto' = 32 on CUDA, 4 on CPU), ``device``, ``dtype`` ('auto' = bf16 on
    CUDA, fp32 on CPU), ``max_length`` (longest scored window; default the config's block_size),
    ``max_gen_toks`` (default generation budget), ``context_prefix`` ('eos' | 'bos' | 'none'),
    ``cuda_graph`` (decode with CUDA graphs; default on CUDA), ``compile`` (torch.compile the decode
    step for generate_until; default false), ``allow_tokenizer_mismatch`` (score with a ``tokenizer=``
    other than the one the checkpoint's run recorded; default false: refused).
    """

    def __init__(self, checkpoint: Optional[str] = None, config: Optional[str] = None,
                 tokenizer: Union[str, Tokenizer, None] = None, batch_size: Union[int, str, None] = 1,
                 max_batch_size: Optional[int] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, context_prefix: str = "eos",
                 cuda_graph: Union[bool, str, None] = None, compile: Union[bool, str] = False,
                 model: Optional[GPT] = None, allow_tokenizer_mismatch: Union[bool, str] = False,
                 **unused: Any) -> None:
        super().__init__()
        if unused:
            log.warning("gdn2: ignoring unknown model arguments %s", sorted(unused))
        self._rank, self._world_size = _distributed_rank_world()
        if device is None or device == "auto" or device == "":
            if torch.cuda.is_available():
                local = int(os.environ.get("LOCAL_RANK", "0")) if self._world_size > 1 else torch.cuda.current_device()
                device = f"cuda:{local}"
            else:
                device = "cpu"
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is not None:
            torch.cuda.set_device(self._device)
        if model is not None:
            if checkpoint is not None:
                raise ValueError("give either model= or checkpoint=, not both")
            if tokenizer is None:
                raise ValueError("model= needs tokenizer= (a Tokenizer or the path of tokenizer.model)")
            self.model = model
            self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
            self.checkpoint_path, self.checkpoint_step = None, None
            self._device = next(model.parameters()).device
        else:
            if checkpoint is None:
                raise ValueError("gdn2 model needs checkpoint=<consolidated file or checkpoint folder>")
            loaded = load_model(checkpoint, config=config, tokenizer=tokenizer, device=self._device,
                                dtype=parse_dtype(dtype, self._device),
                                allow_tokenizer_mismatch=bool(_as_bool(allow_tokenizer_mismatch,
                                                                       "allow_tokenizer_mismatch")))
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
            self.checkpoint_path, self.checkpoint_step = loaded.checkpoint, loaded.extra.get("step")
        self.config = self.model.config
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ValueError(f"tokenizer {self.tokenizer.path} has {self.tokenizer.vocab_size} tokens but the model "
                             f"only {self.config.vocab_size}: they do not belong together")
        if batch_size is None or str(batch_size).startswith("auto"):
            batch_size = 32 if self._device.type == "cuda" else 4
        self.batch_size = _as_int(batch_size, "batch_size", allow_none=False)
        if max_batch_size is not None:
            self.batch_size = min(self.batch_size, _as_int(max_batch_size, "max_batch_size"))
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self._max_length = _as_int(max_length, "max_length") or self.config.block_size
        if self._max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self._max_length}")
        self.max_gen_toks = _as_int(max_gen_toks, "max_gen_toks", allow_none=False)
        if context_prefix not in ("eos", "bos", "none"):
            raise ValueError(f"context_prefix must be 'eos', 'bos' or 'none', got {context_prefix!r}")
        self.context_prefix = context_prefix
        self.cuda_graph = _as_bool(cuda_graph, "cuda_graph")
        self.compile = bool(_as_bool(compile, "compile"))
        self._generator: Optional[Generator] = None

    # ---- lm-eval plumbing -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.context_prefix == "bos" else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @max_length.setter
    def max_length(self, length: int) -> None:
        """A longer (or shorter) window to score and generate in; a generator made for the old one goes."""
        if length < 2:
            raise ValueError(f"max_length must be >= 2, got {length}")
        self.release()
        self._max_length = int(length)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.path)

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``, behind the context prefix unless ``add_special_tokens`` is False."""
        ids = self.tokenizer.encode(string)
        if add_special_tokens is not False and self.context_prefix != "none":
            ids = [self.prefix_token_id] + ids
        return ids

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ---- distributed ------------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list]:
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ---- scoring ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, cache_key: Optional[str] = "loglikelihood"
                              ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids) -> (log p, is greedy).

        The input is ``(context + continuation)[-(max_length + 1):][:-1]``: the last ``max_length``
        tokens before the final one, so every continuation token is predicted from the position before
        it. Continuations longer than ``max_length`` are an error (they cannot be scored exactly).
        """
        L = self.max_length
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        results: list[Optional[tuple[float, bool]]] = [None] * len(requests)
        pad = max(self.tokenizer.eos_id, 0)
        batches = [order[s: s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, disable=disable_tqdm or self._rank != 0, desc="gdn2 loglikelihood"):
            inputs, conts = [], []
            for i in batch:
                _, ctx, cont = requests[i]
                if not cont:
                    raise ValueError(f"request {i}: empty continuation")
                if len(cont) > L:
                    raise ValueError(f"request {i}: continuation of {len(cont)} tokens exceeds max_length {L}")
                whole = (list(ctx) + list(cont))[-(L + 1):]
                inputs.append(whole[:-1])
                conts.append(list(cont))
            width = max(len(x) for x in inputs)
            idx = torch.full((len(batch), width), pad, dtype=torch.long)
            for j, x in enumerate(inputs):
                idx[j, :len(x)] = torch.tensor(x, dtype=torch.long)
            logits = self.model(idx.to(self._device))
            for j, i in enumerate(batch):
                n, c = len(inputs[j]), len(conts[j])
                scored = logits[j, n - c: n]  # [c, V]
                logp = F.log_softmax(scored.double() if scored.dtype == torch.float64 else scored.float(), dim=-1)
                target = torch.tensor(conts[j], device=logp.device)
                score = float(logp.gather(-1, target[:, None]).sum())
                greedy = bool((logp.argmax(-1) == target).all())
                results[i] = (score, greedy)
                if cache_key is not None and requests[i][0] is not None:
                    self.cache_hook.add_partial(cache_key, requests[i][0], results[i])
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts: every token scored exactly once, in windows of max_length."""
        windows, owner = [], []
        for r, req in enumerate(requests):
            (text,) = req.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(r)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, cache_key=None) if windows else []
        totals = [0.0] * len(requests)
        for r, (score, _) in zip(owner, scores):
            totals[r] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation -------------------------------------------------------------------------------
    def _get_generator(self) -> Generator:
        if self._generator is None:
            self._generator = Generator(self.model, self.tokenizer, max_batch_size=self.batch_size,
                                        max_length=self.max_length, cuda_graph=self.cuda_graph,
                                        compile=self.compile)
        return self._generator

    def release(self) -> None:
        """Free the generation cache and CUDA graphs."""
        if self._generator is not None:
            self._generator.release()
            self._generator = None

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until one of ``until``, EOS or ``max_gen_toks`` tokens (greedy unless
        ``do_sample``)."""
        results: list[Optional[str]] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        gen = self._get_generator()
        bar = tqdm(total=len(requests), disable=disable_tqdm or self._rank != 0, desc="gdn2 generate_until")
        for key, members in groups.items():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_new = _as_int(kwargs.pop("max_gen_toks", None), "max_gen_toks") or self.max_gen_toks
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            params = SamplingParams(
                max_new_tokens=max_new, temperature=temperature if do_sample else 0.0,
                top_k=int(kwargs.pop("top_k", 0) or 0), top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                stop=tuple(until), seed=_as_int(kwargs.pop("seed", None), "seed"))
            if do_sample and temperature == 0.0:
                params.temperature = 1.0
            if kwargs:
                log.warning("gdn2 generate_until: ignoring generation arguments %s", sorted(kwargs))
            budget = self.max_length - max_new if self.max_length > max_new else self.max_length
            prompts = []
            for i in members:
                ids = self.tok_encode(requests[i].args[0])
                if not ids:
                    ids = [self.prefix_token_id]
                prompts.append(ids[-budget:])
            order = sorted(range(len(members)), key=lambda j: -len(prompts[j]))
            for s in range(0, len(order), self.batch_size):
                chunk = order[s: s + self.batch_size]
                for j, completion in zip(chunk, gen.generate([prompts[j] for j in chunk], params)):
                    i = members[j]
                    text = self.tok_decode(completion.tokens)
                    for stop in until:
                        text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]


def _distributed_rank_world() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else from torchrun's environment (and then
    the process group is initialised here: lm-eval gathers results across ranks)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if not dist.is_available():
            raise ValueError(f"WORLD_SIZE={world} but torch.distributed is unavailable")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
