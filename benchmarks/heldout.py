"""Speculative decoding with the shipped default model on held-out stdlib files: acceptance and speed.

    python benchmarks/heldout.py                                  # examples/checkpoints/tiny-stdlib
    python benchmarks/heldout.py --prompts-per-file 4 --max-new-tokens 256 --repeats 5
    python benchmarks/heldout.py --dtype bfloat16 --window-invariant   # every row equal to k = 0's in bfloat16 too
    python benchmarks/heldout.py --cache-dtype fp8                # caches as DeepSeek serves V3.2 (docs/fp8-caches.md)
    python benchmarks/heldout.py --dtype bfloat16 --window-invariant --compare-caches --batch 64 --prompts-per-file 64 --repeats 1

The prompts are byte windows of the files `examples/train_tiny.py` held out of training (listed in
the checkpoint's `training.json`), starting at evenly spaced line starts. Every prompt is decoded
greedily, one row at a time (the latency case speculative decoding is for), with plain decoding
(k = 0), with the MTP module drafting chains of k = 1, 2, 3 tokens per step, and with draft trees
(`--tree`). For each it reports the mean accepted length (tokens emitted per target call), the
per-position acceptance (the fraction of steps whose j-th draft was accepted; for a tree, whose
accepted path reached depth j), decode tokens/s and the speedup over k = 0, and how many prompts' outputs are identical to
those of k = 0 (all of them, or the exit status is 1). In bfloat16 without `--window-invariant`
a few rows may depart at a near-tie (`DecodeConfig.window_invariant` says why).

All prompts have one length, so `generate` compiles once per k (before timing); each prompt is then
decoded `--repeats` times and the fastest run counts, which filters out other processes on a shared
machine. Times are whole `generate` calls: prefill, the decode loop and a few milliseconds of input
checks and cache allocation, the same for every k. Before decoding, it also prints teacher-forced
held-out losses and how often the MTP module's top-1 equals the target's next-next-token top-1,
which bounds what drafting can accept.

The accepted length is a mean over prompts, and prompts differ far more than settings do: its 95%
bootstrap interval says how far the choice of prompts moves it. `--compare-caches` decodes every
setting with caches in the compute dtype and in FP8 on the same prompts and gives the interval of
the difference from the same resamples of both (paired), which is narrower than the two figures'
own intervals side by side. `--batch` decodes many prompts per call, for acceptance over hundreds
of prompts in minutes; in bfloat16 a few of its texts can depart from batch 1's at a near-tie
(XLA's matmuls round differently at another batch), each still equal to k = 0's at the same batch.

Where a step's time goes on the 2-core CPU (jax 0.10.2; 30 `jaxspec.loop._step` calls timed in one
`fori_loop`, batch 1, these prompts; a component's share is the time saved by replacing it with a
stub): a plain step takes 0.77 ms, a k = 3 step 1.9 ms (2.5x, while it emits 3.27 tokens). Of the
k = 3 step, the three MTP calls take 0.39 ms and the loop's own bookkeeping 0.04 ms; the rest is the
target verifying 4 tokens, about twice its one-token cost. XLA's CPU backend is compute-bound at
this size, not bandwidth-bound as a GPU decoding a large model is: the DSA indexer's `lax.top_k`
costs about 5 us per query row and layer (0.26 ms of a plain step, 0.56 ms of a k = 3 step), and
matmuls with 4 rows go through YNNPACK at about 2.5x the cost of the one-row matvec. The model's
shape does not change this: with random weights, a narrower model (hidden 64), 2 heads,
index_topk 16 or no DSA at all give k = 3 steps of 2.2-2.6 plain steps. Speculation pays where
verifying k + 1 tokens costs about as much as one token, as on a GPU decoding a large model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import progress
from jaxspec.decode_config import DecodeConfig
from jaxspec.flags import TREE_HELP, add_cache_dtype_flag, checkpoint_dir, positive_int, tree_spec
from jaxspec.generation import generate
from jaxspec.orbax_io import restore_model
from jaxspec.platforms import use_cpu_without_nvidia_driver
from jaxspec.pallas_kernels import Visibility

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(REPO, "examples", "checkpoints", "tiny-stdlib")


def held_out_files(checkpoint: str) -> list[str]:
    with open(os.path.join(checkpoint, "training.json")) as f:
        return json.load(f)["held_out"]


def read_stdlib(name: str) -> bytes:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), "rb") as f:
        return f.read()


def line_start_prompts(text: bytes, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` bytes, each starting at the first line start after an evenly spaced offset."""
    prompts = []
    for i in range(count):
        start = text.find(b"\n", i * len(text) // count) + 1
        start = min(start, len(text) - length)
        prompts.append(list(text[start:start + length]))
    return prompts


def held_out_prompts(checkpoint: str, per_file: int = 3, length: int = 96) -> list[list[int]]:
    """The benchmark's prompts: `per_file` line-start windows of `length` bytes from each held-out file."""
    return [p for name in held_out_files(checkpoint) for p in line_start_prompts(read_stdlib(name), per_file, length)]


@functools.partial(nnx.jit, static_argnames=("cache_dtype",))
def teacher_forced(model, tokens, cache_dtype=None):
    """tokens [B, L] -> (target nats/byte, MTP nats/byte, MTP top-1 == target's top-1 for the token
    after next), the MTP fed the true next token and the target's hidden state as in decoding;
    caches in `cache_dtype` (`DecodeConfig.cache_dtype`)."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
    logits, hidden, _ = model(tokens, positions, model.init_cache(batch, length, page_size=length,
                                                                  cache_dtype=cache_dtype), vis,
                              form="expanded", backend="xla")
    mtp_vis = vis._replace(query_len=vis.query_len - 1)
    mtp_logits, _, _ = model.draft(tokens[:, 1:], hidden[:, :-1], positions[:, :-1],
                                   model.init_cache(batch, length, page_size=length, mtp=True,
                                                    cache_dtype=cache_dtype), mtp_vis,
                                   form="expanded", backend="xla")
    nll = lambda lg, t: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), t[..., None], axis=-1))
    agree = jnp.mean(jnp.argmax(mtp_logits[:, :-1], -1) == jnp.argmax(logits[:, 1:-1], -1))
    return nll(logits[:, :-1], tokens[:, 1:]), nll(mtp_logits[:, :-1], tokens[:, 2:]), agree


def measure(model, prompts: list[list[int]], config: DecodeConfig, repeats: int, batch: int = 1):
    """Decode the prompts `batch` rows per `generate` call (the last call padded with copies of its
    first prompt, whose rows are dropped, so that every call has one shape); returns (emitted tokens
    per prompt, per-prompt stats, summed best decode seconds of the calls). The stats are arrays
    over prompts: calls [N] target calls, accepted [N] accepted drafts, position_accepts [N, D]."""
    outputs, seconds, rows = [], 0.0, []
    jax.block_until_ready(generate(model, prompts[:1] * batch, config).tokens)  # compiles, once for all the prompts
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            result = generate(model, group + group[:1] * (batch - len(group)), config)
            jax.block_until_ready(result.tokens)
            best = min(best, time.perf_counter() - start)
        seconds += best
        for row in range(len(group)):
            outputs.append(result.row_tokens(row))
            rows.append((int(result.target_calls[row]), int(result.accepted[row]),
                         np.atleast_1d(np.asarray(result.position_accepts[row]))))
    calls, accepted, position_accepts = (np.array(column) for column in zip(*rows))
    return outputs, dict(calls=calls, accepted=accepted, position_accepts=position_accepts), seconds


def accepted_length_interval(stats: dict, other: dict | None = None, resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the mean accepted length (sum(accepted + calls) / sum(calls)) of
    `stats` (`measure`'s), or, given `other` (the same prompts under another setting), of other's
    minus stats': prompts resampled with replacement (fixed seed), both settings' figures from the
    same resample. How far a figure moves with the choice of prompts is what separates two
    settings from noise, and pairing the prompts removes the part they share."""
    picks = np.random.default_rng(0).integers(0, len(stats["calls"]), size=(resamples, len(stats["calls"])))

    def lengths(s):
        calls = s["calls"][picks].sum(axis=1)
        return (s["accepted"][picks].sum(axis=1) + calls) / np.maximum(calls, 1)

    values = lengths(stats) if other is None else lengths(other) - lengths(stats)
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def accepted_length(stats: dict) -> float:
    """The mean accepted length: tokens emitted per target call, over all prompts."""
    calls = max(int(stats["calls"].sum()), 1)
    return (int(stats["accepted"].sum()) + calls) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=checkpoint_dir, default=DEFAULT_CHECKPOINT, help="a directory written by save_model")
    parser.add_argument("--prompts-per-file", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=96, help="bytes per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=160,
                        help="per prompt; prompt plus continuation stay within the 256-byte training windows")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per prompt; the fastest counts")
    parser.add_argument("--batch", type=positive_int, default=1,
                        help="prompts decoded together per generate call (default 1, the latency case; more "
                             "measures acceptance over many prompts quickly, and tokens/s becomes throughput)")
    parser.add_argument("--max-k", type=int, default=3, help="draft lengths 1..max-k are compared with k = 0")
    parser.add_argument("--tree", type=tree_spec, nargs="*", default=["small"],
                        help=f"draft trees to compare as well (none: chains only); each a {TREE_HELP}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the weights' and caches' dtype")
    parser.add_argument("--window-invariant", action="store_true",
                        help="DecodeConfig(window_invariant=True): every token computed as if alone in its call")
    add_cache_dtype_flag(parser)
    parser.add_argument("--compare-caches", action="store_true",
                        help="decode every setting twice, caches in the compute dtype and in FP8, and print the "
                             "accepted lengths side by side with a paired 95%% interval of their difference")
    args = parser.parse_args(argv)
    if args.compare_caches and args.cache_dtype:
        parser.error("--compare-caches: runs both cache dtypes itself; leave out --cache-dtype")
    use_cpu_without_nvidia_driver()

    model = restore_model(args.checkpoint, dtype=DTYPES[args.dtype])
    files = held_out_files(args.checkpoint)
    texts = [read_stdlib(name) for name in files]
    c = model.config
    cache_dtypes = [None, "fp8"] if args.compare_caches else [args.cache_dtype]
    print(f"model      {args.checkpoint}: {c.model_type}, {c.num_hidden_layers} layers + MTP, hidden {c.hidden_size}, "
          f"{c.n_routed_experts} routed experts, index_topk {c.index_topk}")
    print(f"held out   {', '.join(files)} ({jax.default_backend()}, {jax.device_count()} device(s)), "
          f"{args.dtype}, window_invariant={args.window_invariant}, caches "
          f"{' and '.join(cache or args.dtype for cache in cache_dtypes)}")

    windows = np.concatenate([np.frombuffer(t[:len(t) // 256 * 256], np.uint8).reshape(-1, 256) for t in texts])
    for cache in cache_dtypes:
        target_nll, mtp_nll, agree = teacher_forced(model, jnp.asarray(windows, jnp.int32), cache)
        print(f"teacher-forced  {cache or args.dtype} caches: target {float(target_nll):.3f} nats/byte, MTP (byte "
              f"after next) {float(mtp_nll):.3f} nats/byte, MTP top-1 == target top-1 {float(agree):.1%}")

    prompts = held_out_prompts(args.checkpoint, args.prompts_per_file, args.prompt_len)
    print(f"decoding   {len(prompts)} prompts x {args.prompt_len} bytes, {args.max_new_tokens} new tokens each, "
          f"batch {args.batch}, best of {args.repeats}\n")
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, backend="xla", window_invariant=args.window_invariant)
    drafts = [(str(k), base.replace(num_draft=k)) for k in range(args.max_k + 1)]
    drafts += [(tree, base.replace(tree=tree)) for tree in args.tree]
    if args.compare_caches:
        print(f"{'draft':>5}  {'accepted length, ' + args.dtype + ' caches':>30}  {'fp8 caches':>10}  "
              f"{'fp8 - ' + args.dtype:>16}  {'95% interval':>13}  rows identical to k = 0 ({args.dtype} / fp8)")
    else:
        print(f"{'draft':>5}  {'accepted length':>15}  {'95% interval':>12}  {'acceptance per position':<26}  "
              f"{'tokens/s':>9}  {'speedup':>7}  rows identical to k = 0")
    references, base_rate, lossless = {}, None, True
    for label, config in progress.bar(drafts, "draft settings"):
        runs = {}
        for cache in cache_dtypes:
            outputs, stats, seconds = measure(model, prompts, config.replace(cache_dtype=cache), args.repeats,
                                              args.batch)
            references.setdefault(cache, outputs)
            same = sum(a == b for a, b in zip(outputs, references[cache]))
            lossless &= same == len(prompts)
            runs[cache] = stats, same, sum(len(o) for o in outputs) / seconds
        if args.compare_caches:
            (plain, plain_same, _), (fp8, fp8_same, _) = runs[None], runs["fp8"]
            low, high = accepted_length_interval(plain, fp8)
            print(f"{label:>5}  {accepted_length(plain):>30.2f}  {accepted_length(fp8):>10.2f}  "
                  f"{accepted_length(fp8) - accepted_length(plain):>+16.2f}  {f'{low:+.2f} to {high:+.2f}':>13}  "
                  f"{plain_same} / {fp8_same} of {len(prompts)}", flush=True)
            continue
        (stats, same, rate), = runs.values()
        base_rate = base_rate or rate
        low, high = accepted_length_interval(stats)
        calls = max(int(stats["calls"].sum()), 1)
        per_position = " ".join(f"{a:.2f}" for a in stats["position_accepts"].sum(axis=0) / calls)
        print(f"{label:>5}  {accepted_length(stats):>15.2f}  {f'{low:.2f}-{high:.2f}':>12}  {per_position or '-':<26}  "
              f"{rate:>9,.0f}  {rate / base_rate:>6.2f}x  {same} / {len(prompts)}", flush=True)
    reference = references[cache_dtypes[0]]
    print(f"\nsample prompt (from {files[0]}):\n{bytes(prompts[0]).decode('utf-8', 'replace')}\n"
          f"greedy continuation:\n{bytes(t for t in reference[0] if t < 256).decode('utf-8', 'replace')}")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
