"""A key tile's copies issued one thread a key, in Mosaic GPU code inlined under Pallas.

Why: on a lent H200 the gathering kernels' row copies (`gathered_softmax_mosaic.issue_keys`) cost
113 ns each, one after another, with or without Pallas' automatic barriers. Pallas' copy has every
thread of the issuing warpgroup arrive on the tile's mbarrier with a share of each copy's bytes
(128 arrivals a copy, 8,192 a 64-key tile) before one thread issues it. Here thread k of the
warpgroup reads key k's row from SMEM, arrives once with the bytes of that key's copies (none for
a key that is not there, -1) and issues them itself: T arrivals a tile, and the copies issued side
by side. Pallas cannot say that (its copies arrive for themselves), so these few operations are
written in Mosaic GPU's own Python API (`plgpu.inline_mgpu`) on an mbarrier of their own.

Compiled only: the Mosaic GPU interpreter runs Pallas, not inline Mosaic GPU code. The kernels
that take it refuse it interpreted, and on a GPU host the suite compares it with their default
copies bit for bit (the same bytes to the same places). `jax.experimental.mosaic.gpu` and jax's
bundled MLIR bindings (private, as Mosaic GPU's own code uses them) have the same API on the
jax versions the project supports, 0.10.2 and 0.11.
"""

from __future__ import annotations

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, nvvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from .gathered_softmax_mosaic import pieces

WARPGROUP = mgpu_utils.WARPGROUP_SIZE  # threads


def check_copies_by_thread(name: str, copies_by_thread: bool, copies_by_warp: bool, interpret: bool) -> None:
    """ValueError before tracing for a kernel asked for `ThreadCopies` where it cannot run them:
    interpreted, or together with copies_by_warp (two ways to issue the same copies)."""
    if copies_by_thread and copies_by_warp:
        raise ValueError(f"{name}: copies_by_thread and copies_by_warp issue the same copies two ways: choose one")
    if copies_by_thread and interpret:
        raise ValueError(f"{name}: copies_by_thread=True runs compiled only (the Mosaic GPU interpreter does not run "
                         "inline Mosaic GPU code)")


class ThreadCopies:
    """The copies of tiles of `keys` keys (at most a warpgroup's threads), on one mbarrier of
    their own whose phase each thread tracks. Call `init` once in the issuing warpgroup before
    any `issue`; then per tile `issue`, later `wait`, with one tile in flight at a time. The
    mbarrier takes 8 bytes of an SMEM buffer the kernel gives (`init`'s `words`: Pallas has no
    64-bit SMEM type without x64). The inline code runs when the kernel is lowered, in program
    order, so `init`'s barrier is there for the `issue` and `wait` after it."""

    def __init__(self, keys: int):
        if not 0 < keys <= WARPGROUP:
            raise ValueError(f"keys={keys}: must be in [1, {WARPGROUP}] (one thread a key)")
        self.keys = keys
        self._barrier = None

    def _check_initialized(self, what: str) -> None:
        if self._barrier is None:
            raise RuntimeError(f"ThreadCopies.{what} lowered before init")

    def init(self, words) -> None:
        """The mbarrier in the first 8 bytes of `words` (an SMEM ref, 8-byte aligned: a buffer's
        start), expecting one arrival a key; then the warpgroup's threads see it initialized."""

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
        def init(ctx, words):
            i32 = ir.IntegerType.get_signless(32)
            address = mgpu_utils.memref_ptr(words)
            phases = memref.alloca(ir.MemRefType.get((), i32), [], [])  # as `mgpu.BarrierRef.initialize`
            memref.store(mgpu_utils.c(0, i32), phases, [])
            nvvm.mbarrier_init(address, mgpu_utils.c(self.keys, i32),
                               predicate=mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.BLOCK))
            nvvm.fence_mbarrier_init()
            mgpu_utils.warpgroup_barrier()
            self._barrier = mgpu.BarrierRef(address, mgpu_utils.c(0, i32), phases, 1)

        init(words)

    def issue(self, rows, parts, stagings) -> None:
        """A tile's copies: rows, an SMEM ref [keys] float32, holds key k's row of the parts (an
        exact float32 integer; -1 for none); parts, GMEM refs [N, W_i]; stagings, SMEM refs
        [keys, >= W_i], row k taking key k's row of part i (`pieces` of it, as `copy_key`). Rows
        are in bounds by construction."""
        layout = [(i, start, length) for i, part in enumerate(parts) for start, length in
                  pieces(part.shape[-1], part.dtype)]
        key_bytes = sum(length * jnp.dtype(parts[i].dtype).itemsize for i, _, length in layout)

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), tuple(plgpu.RefType() for _ in parts),
                                      tuple(plgpu.RefType() for _ in stagings)))
        def issue(ctx, rows, parts, stagings):
            self._check_initialized("issue")
            i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
            thread = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(WARPGROUP, i32))
            mine = arith.cmpi(arith.CmpIPredicate.ult, thread, mgpu_utils.c(self.keys, i32))
            key = arith.index_cast(index, arith.minui(thread, mgpu_utils.c(self.keys - 1, i32)))
            row = arith.fptosi(i32, memref.load(rows, [key]))
            present = arith.cmpi(arith.CmpIPredicate.sge, row, mgpu_utils.c(0, i32))
            self._barrier.arrive_expect_tx(arith.select(present, mgpu_utils.c(key_bytes, i32), mgpu_utils.c(0, i32)),
                                           predicate=mine)
            row = arith.index_cast(index, arith.select(present, row, mgpu_utils.c(0, i32)))
            for i, start, length in layout:
                into = mgpu_utils.memref_slice(stagings[i], (key, mgpu_utils.ds(start, length)))
                ctx.async_copy(src_ref=parts[i], dst_ref=into,
                               gmem_slice=(row, mgpu_utils.ds(start, length)), barrier=self._barrier, arrive=False,
                               predicate=arith.andi(mine, present), oob_mode=mgpu.OOBFillMode.PROMISE_IN_BOUNDS)

        issue(rows, tuple(parts), tuple(stagings))

    def wait(self) -> None:
        """Every thread of the warpgroup waits for the tile last issued."""
        @plgpu.inline_mgpu()
        def wait(ctx):
            self._check_initialized("wait")
            self._barrier.wait()

        wait()
