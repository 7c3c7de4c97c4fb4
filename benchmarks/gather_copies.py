"""What it costs the Mosaic GPU kernels to gather scattered cache rows: the copies alone, without
the attention around them.

    python benchmarks/gather_copies.py                 # on a GPU: 132 programs x 32 tiles, rows of 576 bf16
    python benchmarks/gather_copies.py --smoke         # interpret mode at tiny sizes, any machine

Why: on a lent H200 the Mosaic sparse MLA kernel took the same 0.4 ms at B 1 and at B 32 (Q 1),
about 12 us per 64-slot tile in every program, where the tile's bytes need about 2 us of one SM's
share of HBM and its GEMMs about 1 us. Its tiles arrive by one bulk copy per slot
(`gathered_softmax_mosaic.issue_keys`), and Pallas' Lane lowering puts a warpgroup barrier before
each copy and has all 128 threads arrive on the tile's mbarrier for each (`copy_gmem_to_smem` in
jax's `pallas/mosaic_gpu/primitives.py`): 64 barriers and 8,192 arrivals a tile. These kernels
time that path alone, beside the alternatives, one program per SM, each walking `--tiles` tiles:

  rows           the kernels' own path: one copy per row (`issue_keys`), Pallas' barriers;
  rows, no auto barriers
                 the same copies with `unsafe_no_auto_barriers` (one `commit_smem` a tile instead
                 of a barrier a copy; the arrivals stay): the candidate fix, if barriers are the cost;
  rows, 2 warpgroups
                 the kernels' path with the tile's copies split between two warpgroups (32 each,
                 on the same mbarrier): whether the per-copy cost is the issuing warpgroup's (the
                 H200 measured 113 ns a copy with or without the barriers: its threads' arrivals
                 and single-lane issue), which more issuers divide, or the SM's;
  rows, 4 warps  one warpgroup whose four warps each issue 16 of the tile's copies (`issue_keys`'s by_warp:
                 a copy's arrivals come from its warp's 32 threads, not the warpgroup's 128, and the
                 warps issue side by side): the same question without a second warpgroup's
                 registers, which the kernels' scorer and followers cannot spare;
  rows, by thread
                 one copy per row as above, issued by the row's own thread, which arrives once
                 with its bytes (`thread_copies_mosaic.ThreadCopies`: Mosaic GPU code inlined
                 under Pallas, on an mbarrier of its own): 64 arrivals a tile instead of 8,192, the
                 copies issued side by side, no barrier between them. Fast, it says the per-copy
                 cost was Pallas' arrivals (the sparse MLA and V4 kernels take it as copies_by_thread).
                 Compiled only: the interpreter runs Pallas, not inline Mosaic GPU code, so its
                 check is the GPU run's;
  tile           a page of 64 consecutive rows a tile (its first row a multiple of 64) in 3 box
                 copies of 192 columns into swizzled tiles (how dense MLA reads a page): the same
                 bytes without the scatter.

Each program copies its rows into a staging tile and, after its last tile, writes that tile out
through registers (as the kernels read it), which every run checks against the rows it asked for
(interpreted, the barrier setting is ignored: there the check is of the code path). Rows are
chosen at random over a cache several times the L2. The table gives each variant's time per tile,
per copy and its bytes per second; --json writes attention_kernels.py's row format (`gpu_report.py`'s part
`gather`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from attention_kernels import (add_timing_flags, copy_bandwidth, first_call, gpu_or_smoke, hang_writer, timed,
                               watchdog, write_rows)

from jaxspec.pallas_kernels.gathered_softmax_mosaic import CHUNK, fetch_rows, issue_keys, rows_buffer, staging
from jaxspec.pallas_kernels.mosaic_gpu import compiler_params, interpreting, store, swizzled, warp_map_interpretable
from jaxspec.pallas_kernels.thread_copies_mosaic import ThreadCopies

class Variant(NamedTuple):
    per_row: bool  # one copy a row (else one copy a tile)
    unsafe: bool = False  # unsafe_no_auto_barriers
    warpgroups: int = 1  # warpgroups issuing
    per_warp: bool = False  # each warp issuing its share of the copies
    by_thread: bool = False  # each row's copy issued by its own thread (`ThreadCopies`)


VARIANTS = {"rows": Variant(True), "rows, no auto barriers": Variant(True, unsafe=True),
            "rows, 2 warpgroups": Variant(True, warpgroups=2), "rows, 4 warps": Variant(True, per_warp=True),
            "rows, by thread": Variant(True, by_thread=True), "tile": Variant(False)}
KEYS = 64  # rows a tile, as in the kernels
PIECE = 192  # columns a "tile" copy moves (a TMA box is at most 256 wide; 576 = 3 x 192)
FULL = dict(programs=132, tiles=32, cache_rows=1 << 19, width=576)
SMOKE = dict(programs=1, tiles=2, cache_rows=256, width=192)


def interpretable(variant: str) -> bool:
    """Whether this jax's Mosaic GPU interpreter runs the variant (`mosaic_gpu.warp_map_interpretable`
    for the per-warp copies; never the one written in Mosaic GPU itself)."""
    return not VARIANTS[variant].by_thread and (not VARIANTS[variant].per_warp or warp_map_interpretable())


def _gather_kernel(rows_ref, cache_ref, out_ref, *, variant: Variant):
    """One program: rows_ref [programs, tiles * KEYS] float32 (cache rows, exact integers),
    cache_ref [N, W] -> out_ref [programs, KEYS, W] (its last tile as staged). With two
    warpgroups each issues its half of a tile's row copies, with per_warp each warp its quarter;
    warpgroup 0 fetches the rows and writes the result."""
    per_row, warpgroups = variant.per_row, variant.warpgroups
    program = jax.lax.axis_index("program")
    wg = jax.lax.axis_index("wg") if warpgroups > 1 else 0
    share = KEYS // warpgroups  # copies a warpgroup issues a tile
    tiles = rows_ref.shape[1] // KEYS
    width = cache_ref.shape[1]

    def rows_at(tile):
        return rows_ref.at[program, pl.ds(tile * KEYS, KEYS)]

    def body(rows_smem, tile_smem, first, gathered, *words):
        @pl.when(wg == 0)
        def _():
            fetch_rows(rows_at, 0, tiles, rows_smem, first)

        plgpu.barrier_wait(first)
        by_thread = ThreadCopies(KEYS) if variant.by_thread else None
        if by_thread is not None:
            by_thread.init(*words)

        def step(tile, carry):
            if variant.unsafe:  # every thread is past the last tile's reads of the buffers reused here
                plgpu.commit_smem()
            rows = rows_buffer(rows_smem, tile)
            if by_thread is not None:  # its own barrier; `gathered` then counts the rows' copy alone
                by_thread.issue(rows, [cache_ref], [tile_smem])
            elif per_row:
                mine = pl.ds(wg * share, share)
                issue_keys(rows.at[mine], lambda row: [cache_ref.at[row]], [tile_smem.at[mine]], 1, gathered,
                           by_warp=variant.per_warp)
            else:  # the tile's rows are consecutive from its first: one box a piece of columns
                start = rows[0].astype(jnp.int32)
                for i in range(width // PIECE):
                    plgpu.copy_gmem_to_smem(cache_ref.at[pl.ds(start, KEYS), pl.ds(i * PIECE, PIECE)],
                                            tile_smem.at[i], gathered)
            pl.when(wg == 0)(lambda: fetch_rows(rows_at, tile + 1, tiles, rows_smem, gathered))
            if by_thread is not None:
                by_thread.wait()
            plgpu.barrier_wait(gathered)
            return carry

        jax.lax.fori_loop(0, tiles, step, 0)

        @pl.when(wg == 0)
        def _():
            for c in range(0, width, CHUNK):  # the last tile, through registers as `to_operand` reads it
                view = tile_smem if per_row else tile_smem.at[c // PIECE]
                chunk = plgpu.layout_cast(view[:, pl.ds(c if per_row else c % PIECE, CHUNK)], plgpu.Layout.WGMMA)
                store(out_ref.at[program, :, pl.ds(c, CHUNK)], chunk)

    # A tile copy lands swizzled, as dense MLA's tiles do (an unswizzled [64, 192] tile has no
    # bank-conflict-free read into registers).
    tile_smem = (staging(KEYS, width, cache_ref.dtype) if per_row
                 else plgpu.SMEM((width // PIECE, KEYS, PIECE), cache_ref.dtype,
                                 transforms=swizzled(cache_ref.dtype, PIECE)))
    arrivals = 0 if variant.by_thread else KEYS if per_row else width // PIECE  # on `gathered`, a tile's
    words = [plgpu.SMEM((2,), jnp.uint32)] if variant.by_thread else []  # ThreadCopies' mbarrier
    pl.run_scoped(body, plgpu.SMEM((2, KEYS), jnp.float32), tile_smem, plgpu.Barrier(num_arrivals=1),
                  plgpu.Barrier(num_arrivals=arrivals + 1), *words,
                  **(dict(collective_axes="wg") if warpgroups > 1 else {}))  # the warpgroups share them


def gather(variant: str, rows: jax.Array, cache: jax.Array, *, interpret: bool) -> jax.Array:
    """rows [programs, tiles * KEYS] int32, cache [N, W] -> [programs, KEYS, W]: each program's
    last tile as staged (`_gather_kernel`)."""
    if not interpret:
        return _gather(rows, cache, variant=variant, interpret=False)
    with interpreting():
        return _gather(rows, cache, variant=variant, interpret=True)


@functools.partial(jax.jit, static_argnames=("variant", "interpret"))
def _gather(rows, cache, *, variant: str, interpret: bool):
    # Jitted once per variant, so that the timed calls run the compiled program; `interpret` only
    # keys the cache, so a program traced for the simulator is never reused on a GPU.
    del interpret
    chosen = VARIANTS[variant]
    threads = dict(num_threads=chosen.warpgroups, thread_name="wg") if chosen.warpgroups > 1 else {}
    kernel = plgpu.kernel(
        functools.partial(_gather_kernel, variant=chosen),
        out_type=jax.ShapeDtypeStruct((rows.shape[0], KEYS, cache.shape[1]), cache.dtype),
        grid=(rows.shape[0],), grid_names=("program",),
        compiler_params=compiler_params(unsafe_no_auto_barriers=chosen.unsafe), **threads)
    return kernel(rows.astype(jnp.float32), cache)


def rows_for(variant: str, programs: int, tiles: int, cache_rows: int, rng) -> np.ndarray:
    """[programs, tiles * KEYS] int32 cache rows: at random ("tile": each tile one random page of
    KEYS consecutive rows, as dense MLA reads a page).

    A "tile" start is a multiple of KEYS: its box copy lands in 8-row swizzled tiles, and Mosaic
    GPU splits a dynamic row index of such a copy into (index // 8, index % 8), the remainder
    becoming the start inside an 8-row tile dimension of the copy's descriptor, so a start off
    the 8-row grid reads rows past that dimension's end, which the TMA fills with zeros. The
    interpreter does not model the tiling, which is why unaligned starts staged the right rows
    there and wrong rows on an H200."""
    if VARIANTS[variant].per_row:
        return rng.integers(0, cache_rows, (programs, tiles * KEYS)).astype(np.int32)
    starts = rng.integers(0, cache_rows // KEYS, (programs, tiles, 1)) * KEYS
    return (starts + np.arange(KEYS)).reshape(programs, tiles * KEYS).astype(np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="interpret mode at tiny sizes; runs anywhere")
    parser.add_argument("--programs", type=int, help=f"programs, one per SM (default {FULL['programs']})")
    parser.add_argument("--tiles", type=int, help=f"tiles per program (default {FULL['tiles']})")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    add_timing_flags(parser)
    args = parser.parse_args(argv)
    if not gpu_or_smoke("gather_copies.py", args.smoke):
        return 1
    sizes = {**(SMOKE if args.smoke else FULL),
             **{k: v for k, v in (("programs", args.programs), ("tiles", args.tiles)) if v is not None}}
    if sizes["programs"] < 1 or sizes["tiles"] < 1:
        parser.error("--programs and --tiles must be >= 1")
    interpret = jax.default_backend() != "gpu"
    iters, warmup = (1, 0) if args.smoke else (args.iters, args.warmup)
    cache = jax.random.normal(jax.random.key(0), (sizes["cache_rows"], sizes["width"]), jnp.bfloat16)
    copy_bw = copy_bandwidth(1 << 20 if args.smoke else 1 << 30, iters, warmup)
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s; {sizes['programs']} "
          f"programs x {sizes['tiles']} tiles, rows of {sizes['width']} bfloat16 from {sizes['cache_rows']}")
    print(f"{'variant':<24} {'ms':>8} {'us/tile':>8} {'ns/copy':>8} {'GB/s':>7}  check")
    out_rows = []
    for variant in args.variants:
        if interpret and not interpretable(variant):
            print(f"{variant:<24} not interpreted on jax {jax.__version__} (`interpretable`)", flush=True)
            continue
        per_row = VARIANTS[variant].per_row
        rows = rows_for(variant, sizes["programs"], sizes["tiles"], sizes["cache_rows"], rng)
        rows_dev = jnp.asarray(rows)
        want = np.asarray(cache, np.float32)[rows[:, -KEYS:]]
        hung = hang_writer(args.json, copy_bw, out_rows, "gather", variant)
        run, got = first_call(functools.partial(gather, variant, interpret=interpret), rows_dev, cache,
                              what=f"gather {variant}", on_hang=hung)
        ok = np.array_equal(np.asarray(got, np.float32), want)
        with watchdog(f"gather {variant} (timing)", hung):
            seconds = timed(run, rows_dev, cache, iters=iters, warmup=warmup)
        nbytes = rows.size * sizes["width"] * cache.dtype.itemsize
        per_tile = seconds / sizes["tiles"]
        copies = KEYS if per_row else sizes["width"] // PIECE
        print(f"{variant:<24} {seconds * 1e3:>8.3f} {per_tile * 1e6:>8.2f} {per_tile / copies * 1e9:>8.0f} "
              f"{nbytes / seconds / 1e9:>7.0f}  {'equal' if ok else 'WRONG'}", flush=True)
        out_rows.append(dict(op="gather", impl=variant, keys=KEYS, tiles=sizes["tiles"], programs=sizes["programs"],
                             seconds=seconds, bytes=nbytes, flops=0, correct=ok))
        if args.json:
            write_rows(args.json, copy_bw, out_rows)
    return 0 if all(row["correct"] for row in out_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
