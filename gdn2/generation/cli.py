"""Command line: generate text from a checkpoint (``python -m gdn2 generate``).

    python -m gdn2 generate --checkpoint out/run/final/model.pt --prompt "Once upon a time" \\
        [--max_new_tokens 64] [--temperature 0.8 --top_k 50 --top_p 0.95 --seed 0] [--stop "\\n\\n"]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from gdn2.checkpoint.load import load_model
from gdn2.commandline import option, parse_options
from gdn2.generation.generator import Generator
from gdn2.generation.sampling import SamplingParams
from gdn2.tokenizer import TOKENIZER_FILE

__all__ = ["main"]


@dataclass(kw_only=True)
class GenerateOptions:
    checkpoint: str = option(help="consolidated .pt file or training checkpoint directory")
    prompt: list[str] = option(help="repeatable: prompts run as one batch")
    config: Optional[str] = option(None, "config name or YAML path", meaning_of_null="the one saved with the checkpoint")
    tokenizer: Optional[str] = option(None, f"{TOKENIZER_FILE} path", meaning_of_null="the run's own, found beside "
                                                                                     "the checkpoint or its data")
    allow_tokenizer_mismatch: bool = option(False, "generate with --tokenizer even when it is not the tokenizer the "
                                                   "checkpoint's run recorded (its sha256 differs)")
    max_new_tokens: int = option(64, "tokens to generate per prompt")
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    top_k: int = option(0, "sample among the k likeliest tokens; 0 = all")
    top_p: float = option(1.0, "sample among the likeliest tokens holding this probability mass")
    seed: Optional[int] = option(None, "sampling seed", meaning_of_null="not seeded")
    stop: list[str] = option([], "repeatable stop string (backslash escapes such as \\n are read)")
    device: Optional[str] = option(None, "e.g. cuda:0 or cpu", meaning_of_null="cuda when available")
    dtype: str = option("auto", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, ...")
    no_cuda_graph: bool = option(False, "decode without CUDA graphs")
    compile: Optional[bool] = option(None, "torch.compile the decode step (the first call compiles, ~10 s)",
                                     meaning_of_null="on CUDA")
    no_compile: bool = option(False, "do not compile the decode step (the same as --compile false)")
    no_fused: bool = option(False, "decode on the parameters as they are, without the fused weight copies")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_options(GenerateOptions, list(argv or []), "gdn2 generate", "Generate text from a gdn2 checkpoint.")
    if args is None:
        return 0
    loaded = load_model(args.checkpoint, config=args.config, tokenizer=args.tokenizer, device=args.device,
                        dtype=args.dtype, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)
    gen = Generator(loaded.model, loaded.tokenizer, max_batch_size=len(args.prompt),
                    cuda_graph=False if args.no_cuda_graph else None,
                    compile=False if args.no_compile else args.compile,
                    fused=not args.no_fused)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop=tuple(s.encode().decode("unicode_escape") for s in args.stop),
                            seed=args.seed)
    for prompt, completion in zip(args.prompt, gen.generate(args.prompt, params)):
        print(f"{prompt}{completion.text}")
        print(f"[{len(completion.tokens)} tokens, {completion.finish_reason}]", file=sys.stderr)
    return 0
