"""How many rows of greedy speculative decoding equal plain greedy decoding, per backend and mode.

    python benchmarks/exactness.py                              # bfloat16, backends xla and pallas
    python benchmarks/exactness.py --dtype float32 --backend xla --max-new-tokens 64

The shipped model and the 12 held-out prompts of `benchmarks/heldout.py`, decoded as one batch:
for each kernel backend and each `window_invariant` setting, plain greedy decoding (k = 0) is the
reference, and each draft (chains k = 1..4, a static and a dynamic tree) prints how many rows are
identical to it and the first token where each other row departs. On XLA's CPU backend
`window_invariant=True` must give 12 / 12 everywhere (tests/test_exactness.py pins it); on a GPU
this script is the measurement (run it on the device: nothing here assumes a CPU). Exit status 1
if any window-invariant row differs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import jax

from heldout import DEFAULT_CHECKPOINT, DTYPES, held_out_prompts
from jaxspec import progress
from jaxspec.decode_config import DecodeConfig
from jaxspec.flags import checkpoint_dir
from jaxspec.generation import generate
from jaxspec.orbax_io import restore_model
from jaxspec.platforms import use_cpu_without_nvidia_driver

DRAFTS = [("k=1", dict(num_draft=1)), ("k=2", dict(num_draft=2)), ("k=3", dict(num_draft=3)),
          ("k=4", dict(num_draft=4)), ("small", dict(num_draft=1, tree="small")), ("4,3,8", dict(num_draft=1, tree="4,3,8"))]


def first_departures(rows: list[list[int]], reference: list[list[int]]) -> list[int]:
    """For each row that differs from its reference row, the index of the first differing token."""
    departures = []
    for row, ref in zip(rows, reference):
        if row != ref:
            departures.append(next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), min(len(row), len(ref))))
    return departures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=checkpoint_dir, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--backend", choices=["xla", "pallas"], nargs="+", default=["xla", "pallas"])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--prompts", type=int, default=None, help="only the first N held-out prompts")
    parser.add_argument("--drafts", nargs="+", choices=[label for label, _ in DRAFTS],
                        default=[label for label, _ in DRAFTS], help="the draft settings to compare")
    parser.add_argument("--invariant-only", action="store_true", help="only window_invariant=True")
    parser.add_argument("--json", metavar="PATH", help="also write every printed row here")
    args = parser.parse_args(argv)
    use_cpu_without_nvidia_driver()

    model = restore_model(args.checkpoint, dtype=DTYPES[args.dtype])
    prompts = held_out_prompts(args.checkpoint)[:args.prompts]
    print(f"{len(prompts)} prompts, batch {len(prompts)}, {args.max_new_tokens} new tokens, {args.dtype}, "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"{'backend':>7}  {'window_invariant':>16}  {'draft':>5}  {'identical rows':>14}  {'seconds':>7}  "
          f"first departures")
    exact = True
    measured = []
    invariants = (True,) if args.invariant_only else (False, True)
    for backend, invariant in progress.bar(list(itertools.product(args.backend, invariants)), "settings"):
        base = DecodeConfig(max_new_tokens=args.max_new_tokens, backend=backend, num_draft=0,
                            window_invariant=invariant)
        result = generate(model, prompts, base)
        reference = [result.row_tokens(b) for b in range(len(prompts))]
        for label, draft in [(label, draft) for label, draft in DRAFTS if label in args.drafts]:
            start = time.perf_counter()
            result = generate(model, prompts, base.replace(**draft))
            rows = [result.row_tokens(b) for b in range(len(prompts))]
            seconds = time.perf_counter() - start
            departures = first_departures(rows, reference)
            exact &= not (invariant and departures)
            measured.append(dict(backend=backend, window_invariant=invariant, draft=label, rows=len(rows),
                                 identical=len(rows) - len(departures), first_departures=departures))
            print(f"{backend:>7}  {str(invariant):>16}  {label:>5}  {len(rows) - len(departures):>6} / "
                  f"{len(rows):<5}  {seconds:>7.1f}  {departures or '-'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "dtype": args.dtype, "rows": measured}, f, indent=1)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
