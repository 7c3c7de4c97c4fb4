"""Plain greedy decoding against MTP speculative decoding (chains k = 1, 2, 3 and draft trees) on
one CPU-sized model.

    python benchmarks/speculative.py                  # train the tiny model briefly, then measure
    python benchmarks/speculative.py --random         # random weights: almost nothing is accepted
    python benchmarks/speculative.py --k 1 2 3 4 --batch 8 --max-new-tokens 128
    python benchmarks/speculative.py --tree small eagle 4,4,12   # static trees, a dynamic one

With random weights the MTP module's drafts are noise and speculation only adds work, so by default
the model (target and MTP module jointly, `jaxspec.train`) first learns a small synthetic language
of phrases: within a phrase the next byte is certain, at a phrase boundary it is a guess. The
measured acceptance is then what a drafter that has learned its target achieves on such text.
Training windows are as long as the decoded sequences, so decoding visits no position that training
did not. The default preset is `tiny-v3` (dense MLA): `jaxspec.train` does not train the DSA
indexer of `tiny`, whose random selection of 16 keys per query cripples the model past 16 tokens.
`--preset tiny-v4` is the CPU-sized DeepSeek-V4 (an 8-token sliding window, CSA and HCA layers,
mHC, hash routing); `jaxspec.train` leaves its CSA indexer at its initial weights (a random choice
of 4 entries per query), and the window and HCA entries carry the phrases. `--mtp-depth 2` also
trains the MTP module chained twice, as k >= 2 drafts chain it (at the command below, 32 new
tokens, measured on a 2-core CPU: depth-2 acceptance 0.42 trained at depth 1, 0.93 at depth 2):

    python benchmarks/speculative.py --preset tiny-v4 --k 1 2 --tree small --mtp-depth 2

Every configuration decodes the same prompts (windows of held-out text) to the full token budget
(no EOS). Times cover one execution of the compiled `generate` (prefill and the decode loop);
compilation and a first warm-up execution are excluded. tokens/s = emitted tokens / time, best and
median over --repeats executions. "= plain" checks that the emitted tokens equal plain decoding's.
Rows name the draft: k for a chain, the tree otherwise; mean accepted length is tokens per target
call, and acceptance per depth the fraction of steps whose accepted path reached each depth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from jaxspec import progress
from jaxspec.decode_config import MAX_DRAFT_TOKENS, DecodeConfig
from jaxspec.flags import TREE_HELP, add_model_flags, positive_int, tree_spec
from jaxspec.generation import GenerateResult, compile_generate
from jaxspec.models import DeepseekV3, model_class
from jaxspec.platforms import use_cpu_without_nvidia_driver
from jaxspec.presets import preset
from jaxspec.train import train
from jaxspec.trees import parse_tree

PHRASES = (b"the cat sat on the mat. ", b"a dog ran in the park. ", b"we drink green tea. ",
           b"it is a sunny day. ", b"she reads a long book. ", b"birds sing at dawn. ")


def phrase_stream(seed: int, size: int) -> np.ndarray:
    """[size] int32 byte ids: phrases drawn uniformly and independently, concatenated."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(PHRASES), size // min(map(len, PHRASES)) + 1)
    text = b"".join(PHRASES[i] for i in picks)[:size]
    return np.frombuffer(text, np.uint8).astype(np.int32)


def windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """[batch, length]: windows of `stream` at random offsets."""
    starts = rng.integers(0, len(stream) - length + 1, batch)
    return np.stack([stream[s:s + length] for s in starts])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3],
                        help=f"draft lengths to compare with plain decoding, each 1..{MAX_DRAFT_TOKENS}")
    parser.add_argument("--tree", type=tree_spec, nargs="*", default=["small", "eagle", "4,4,12"],
                        help=f"trees to compare as well (none: chains only); each a {TREE_HELP}")
    add_model_flags(parser, default_preset="tiny-v3")
    parser.add_argument("--batch", type=positive_int, default=4, help="rows decoded together")
    parser.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens per row")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated per row")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed executions per configuration")
    parser.add_argument("--train-steps", type=positive_int, default=150, help="training steps before measuring")
    parser.add_argument("--mtp-depth", type=positive_int, default=1,
                        help="train the MTP module chained this many times (k >= 2 drafts chain it)")
    parser.add_argument("--random", action="store_true", help="skip training: measure random weights")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the text")
    args = parser.parse_args(argv)
    bad = [k for k in args.k if not 1 <= k <= MAX_DRAFT_TOKENS]
    if bad:
        parser.error(f"--k {bad}: each must be in [1, {MAX_DRAFT_TOKENS}] (plain decoding is always measured)")
    args.k = sorted(set(args.k))
    return args


def build_model(args: argparse.Namespace) -> DeepseekV3:
    """The benchmark's model: trained on the phrase language unless --random."""
    config = preset(args.preset)
    model = model_class(config)(config, rngs=nnx.Rngs(args.seed))
    if not args.random:
        rng = np.random.default_rng(args.seed)
        stream = phrase_stream(args.seed, 200_000)
        deepest = max(args.k + [parse_tree(tree).max_depth for tree in args.tree])
        length = args.prompt_len + args.max_new_tokens + deepest
        batches = (windows(stream, rng, 8, length) for _ in range(args.train_steps))
        start = time.perf_counter()
        train(model, batches, steps=args.train_steps, learning_rate=1e-2, log_every=50, mtp_depth=args.mtp_depth)
        print(f"trained {args.train_steps} steps in {time.perf_counter() - start:.1f} s")
    return model


def measure(model: DeepseekV3, prompts: np.ndarray, config: DecodeConfig,
            repeats: int) -> tuple[list[float], GenerateResult]:
    """Seconds of each of `repeats` executions of the compiled `generate`, and its result."""
    run = compile_generate(model, list(prompts), config)
    jax.block_until_ready(run().tokens)  # the first execution also pays one-time runtime setup
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        jax.block_until_ready(result.tokens)
        seconds.append(time.perf_counter() - start)
    return seconds, result


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cpu_without_nvidia_driver()
    model = build_model(args)
    prompts = windows(phrase_stream(args.seed + 1, 10_000), np.random.default_rng(args.seed + 1),
                      args.batch, args.prompt_len)
    print(f"{args.preset}, {'random' if args.random else 'trained'} weights; batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.max_new_tokens} new tokens per row, backend {args.backend}, "
          f"best / median of {args.repeats}")

    header = f"{'draft':>7} {'best tok/s':>11} {'median tok/s':>13} {'vs plain':>9} {'mean acc len':>13}  " \
             f"{'= plain':<8} acceptance per depth"
    print(header)
    print("-" * len(header))
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_id=None, backend=args.backend)
    drafts = [(str(k), base.replace(num_draft=k)) for k in [0] + args.k]
    drafts += [(tree, base.replace(tree=tree)) for tree in args.tree]
    plain_tokens, plain_rate = None, None
    for label, config in progress.bar(drafts, "draft settings"):
        seconds, result = measure(model, prompts, config, args.repeats)
        emitted = int(np.sum(result.num_tokens))
        best, median = emitted / min(seconds), emitted / statistics.median(seconds)
        tokens = np.asarray(result.tokens)
        if plain_tokens is None:
            plain_tokens, plain_rate = tokens, best
        same = "yes" if np.array_equal(tokens, plain_tokens) else "NO"
        acceptance = " ".join(f"{a:.2f}" for a in result.acceptance_per_position) or "-"
        print(f"{label:>7} {best:>11,.0f} {median:>13,.0f} {best / plain_rate:>8.2f}x "
              f"{result.mean_accepted_length:>13.2f}  {same:<8} {acceptance}", flush=True)


if __name__ == "__main__":
    main()
