"""Memory plan with compute-dtype and FP8 caches: cache per device, and the rows that fit.

    JAX_PLATFORMS=cpu python benchmarks/fp8_caches.py                 # DeepSeek-V3.2, 8 x H200, context 32k
    JAX_PLATFORMS=cpu python benchmarks/fp8_caches.py --batch 32 --context 4096

From shapes alone (`jaxspec.memory_plan.plan_memory`, nothing allocated or compiled): the model in
DeepSeek's FP8 weights on a 1 x N mesh of one node (default plan), MTP k drafts, planned for the
programs a GPU runs (`DecodeConfig(backend="pallas")`: the Triton kernels, which this CPU host would
not resolve "auto" to). For each cache dtype it prints the cache bytes per device at `--batch` rows
of `--context` slots, and the most rows (a multiple of the mesh's row shards) whose plan fits
`--fraction` of a device:

  decode     weights + caches + loop state + one decode step's temporaries (prompts of one token,
             `--context` new tokens: the program `jaxspec aot --phase decode` compiles);
  + prefill  the peak of the whole run for prompts of `--context` less the budget and the window,
             prefilled in chunks of C tokens, one column per `--prefill-chunk` C (docs/scale.md's
             "Context 32k").
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jaxspec import memory_plan
from jaxspec.decode_config import DecodeConfig
from jaxspec.presets import preset

H200_BYTES = 151397597184  # the H200 target's device_memory_size (jaxspec/targets/h200.txtpb): 141 GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--devices", type=int, default=8, help="GPUs of one node (mesh 1 x N)")
    parser.add_argument("--batch", type=int, default=96, help="rows for the cache-per-device column")
    parser.add_argument("--context", type=int, default=32768, help="slots per row")
    parser.add_argument("--mtp", type=int, default=3, help="MTP chain length k")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per row in the prefill setting")
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[64, 32], metavar="C",
                        help="prefill chunk sizes, a column each")
    parser.add_argument("--fraction", type=float, default=0.9, help="of the device's memory JAX may use")
    args = parser.parse_args()

    config, mesh, budget = preset(args.preset), (1, args.devices), args.fraction * H200_BYTES
    prompt_len = args.context - args.new_tokens - args.mtp

    def plan(cache_dtype, batch: int, chunk: int | None):
        """The plan of decoding alone (chunk None) or of the whole run, prefilled in chunks of `chunk`."""
        if chunk is not None:
            decode = DecodeConfig(num_draft=args.mtp, max_new_tokens=args.new_tokens, cache_dtype=cache_dtype,
                                  prefill_chunk=chunk, backend="pallas")
            return memory_plan.plan_memory(config, decode, batch=batch, prompt_len=prompt_len, mesh=mesh,
                                           dtype=jnp.float8_e4m3fn)
        decode = DecodeConfig(num_draft=args.mtp, max_new_tokens=args.context, cache_dtype=cache_dtype,
                              backend="pallas")
        return memory_plan.plan_memory(config, decode, batch=batch, prompt_len=1, mesh=mesh, dtype=jnp.float8_e4m3fn)

    def peak(p, chunk: int | None) -> int:
        return p.total if chunk is not None else p.resident + p.step_temp

    def most_rows(cache_dtype, chunk: int | None) -> int:
        """The largest multiple of the mesh's rows whose plan fits (bisection: bytes grow with rows)."""
        step = args.devices
        fits = lambda rows: peak(plan(cache_dtype, rows, chunk), chunk) <= budget
        low, high = 0, step
        while fits(high):
            low, high = high, 2 * high
        while high - low > step:
            middle = (low + high) // 2 // step * step
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    print(f"{args.preset}, FP8 weights, {args.devices} x H200 (mesh 1x{args.devices}), MTP k={args.mtp}, context "
          f"{args.context}, {args.fraction:.0%} of {H200_BYTES / 2**30:.0f} GiB per device")
    chunk_columns = [f"rows (+ prefill, chunks of {chunk})" for chunk in args.prefill_chunk]
    print(f"{'caches':>8}  {f'cache/device at B={args.batch}':>24}  {'rows (decode)':>13}  "
          + "  ".join(chunk_columns))
    for cache_dtype in (None, "fp8"):
        caches = plan(cache_dtype, args.batch, None).caches
        rows = [f"{most_rows(cache_dtype, chunk):>{len(column)}}" for chunk, column in zip(args.prefill_chunk, chunk_columns)]
        print(f"{cache_dtype or 'bf16':>8}  {memory_plan.readable(caches):>24}  {most_rows(cache_dtype, None):>13}  "
              + "  ".join(rows), flush=True)


if __name__ == "__main__":
    main()
