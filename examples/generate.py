"""Generate text with MTP speculative decoding, and report speed and acceptance.

    python examples/generate.py                       # tiny model, MTP k = 3
    python examples/generate.py --mtp 0               # plain greedy decoding: the same text
    python examples/generate.py --prompt "Hello" --prompt "Once upon" --batch 8 --max-new-tokens 128

Greedy speculative decoding is lossless: for one seed, every --mtp prints the same text; only the
speed and the acceptance statistics change. The model is the `tiny` preset (or `tiny-v3`) with
random weights drawn from --seed, so the text itself is noise and few drafts are accepted
(`benchmarks/speculative.py` trains the model first). `generate` is compiled ahead of time and
run once to warm up, so the decode time excludes both.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from jaxspec.config import MAX_DRAFT_TOKENS, DecodeConfig, preset
from jaxspec.flags import add_model_flags, positive_int
from jaxspec.generate import compile_generate
from jaxspec.models import DeepseekV3
from jaxspec.pallas_kernels.backend import resolve_backend
from jaxspec.tokenizer import Tokenizer, load_tokenizer

DEFAULT_PROMPTS = ("The quick brown fox", "Speculative decoding is")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help=f"a prompt; repeat for several (default: {' / '.join(DEFAULT_PROMPTS)})")
    parser.add_argument("--batch", type=positive_int,
                        help="rows to decode together; the prompts are cycled to fill them (default: one per prompt)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per row")
    parser.add_argument("--mtp", type=int, default=3,
                        help=f"k, draft tokens per step from the MTP module, 0..{MAX_DRAFT_TOKENS} (0 = plain decoding)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model weights")
    add_model_flags(parser, default_preset="tiny")
    parser.add_argument("--page-size", type=positive_int, default=64, help="cache slots per page")
    args = parser.parse_args(argv)

    args.prompts = args.prompts or list(DEFAULT_PROMPTS)
    if any(not p for p in args.prompts):
        parser.error("--prompt: prompts must not be empty")
    if args.batch is None:
        args.batch = len(args.prompts)
    elif args.batch < len(args.prompts):
        parser.error(f"--batch {args.batch}: smaller than the number of prompts ({len(args.prompts)})")
    if not 0 <= args.mtp <= MAX_DRAFT_TOKENS:
        parser.error(f"--mtp {args.mtp}: must be in [0, {MAX_DRAFT_TOKENS}]")
    return args


def build_model(args: argparse.Namespace) -> tuple[DeepseekV3, Tokenizer, str]:
    """The model, its tokenizer, and a line saying where the weights came from."""
    model = DeepseekV3(preset(args.preset), rngs=nnx.Rngs(args.seed))
    return model, load_tokenizer(None), f"random weights (seed {args.seed}), byte tokenizer"


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tokenizer, weights = build_model(args)
    prompts = [args.prompts[row % len(args.prompts)] for row in range(args.batch)]
    config = DecodeConfig(num_draft=args.mtp, max_new_tokens=args.max_new_tokens,
                          eos_token_id=tokenizer.eos_token_id, page_size=args.page_size, backend=args.backend)
    mconf = model.config
    print(f"model     {args.preset} ({mconf.model_type}, {mconf.num_hidden_layers} layers), {weights}")
    print(f"decoding  batch {args.batch}, MTP k={args.mtp}, up to {args.max_new_tokens} new tokens per row, "
          f"backend {args.backend} -> {resolve_backend(args.backend)}, page size {args.page_size}")

    start = time.perf_counter()
    run = compile_generate(model, [tokenizer.encode(p) for p in prompts], config)
    compile_s = time.perf_counter() - start
    # The first execution also pays one-time runtime setup; time the second.
    start = time.perf_counter()
    jax.block_until_ready(run().tokens)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    result = run()
    jax.block_until_ready(result.tokens)
    decode_s = time.perf_counter() - start

    emitted = int(np.sum(result.num_tokens))
    acceptance = " ".join(f"{a:.2f}" for a in result.acceptance_per_position) or "- (no drafts)"
    print(f"compile   {compile_s:.2f} s ahead of time, then {warmup_s:.3f} s warm-up run (both not counted below)")
    print(f"decode    {decode_s:.3f} s for {emitted} tokens: {emitted / decode_s:,.0f} tokens/s "
          f"(prefill + {result.steps} steps)")
    print(f"mean accepted length {result.mean_accepted_length:.2f} tokens per target call")
    print(f"acceptance per position {acceptance}")
    print()
    for row, prompt in enumerate(prompts):
        print(f"[{row}] {prompt!r} -> {tokenizer.decode(result.row_tokens(row))!r}")


if __name__ == "__main__":
    main()
