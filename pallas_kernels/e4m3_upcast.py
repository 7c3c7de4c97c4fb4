"""FP8 (e4m3) weights to float16 by integer operations, in inline PTX for both grouped matmuls.

Why: Hopper issues conversion instructions at a fraction of its integer and float32 rates, and
both FP8 loops spend one a weight (the Mosaic kernel's sm_90a SASS for a K step of 64, per thread:
32 `F2FP.F16.E4M3.UNPACK_B` and 32 `F2FP.BF16.F32.PACK_AB` for 64 weights, beside 64 `HADD2.F32`
and 64 `FMUL`; the Triton kernel's PTX the same); Triton's compiler replaced its int8-to-bfloat16
conversions with integer operations on Hopper for the same reason. Here the unpacking goes: a pair
of e4m3 bytes becomes a float16 pair with three integer instructions (a byte permute that
sign-extends each byte to 16 bits, a mask, a shift), which leaves the rounding to bfloat16 as the
loop's one conversion, half a one a weight. Whether that is faster is the GPU's to say (the
grouped matmul's `k64-int` variant, docs/performance.md); the values are the same bit for bit.

The recipe, per byte b = s eeee mmm: sign-extended to 16 bits, masked with 0x017F and shifted
left by 7, it is the float16 s 0eeee mmm0000000, that is w / 256 for e4m3's value w, exactly,
subnormals included (e4m3's exponent bias is 7, float16's 15; e4m3's subnormal steps of 2^-9
become float16's of 2^-17, above its smallest 2^-24). In float32 times the block's scale times
256 it is w times the scale: both factors exact, the same real product, so the same float32
rounding as `block_fp8.dequantize` (the scale times 256 is finite for every scale a quantization
of finite float32 weights gives: at most 3.4e38 / 448 * 256). A NaN byte (0x7F, 0xFF: e4m3fn's
only NaN) reads as +-480 where the conversion gives NaN; FP8 weights quantized from finite values
hold none. `scaled_float16` is the recipe in numpy, instruction by instruction; the tests hold it
against `block_fp8.dequantize` for every byte, in bytes of mixed signs (a wrong permute selector
fails), at scales whose products are normal float32 (XLA's CPU flushes subnormal ones; the
kernels' float32 products, either way they unpack, keep them).

Compiled only: neither interpreter runs inline PTX, and the kernels convert there (the same
values). The Mosaic kernel's part is Mosaic GPU code inlined under Pallas (`plgpu.inline_mgpu`,
like `thread_copies_mosaic`); `jax.experimental.mosaic.gpu` and jax's bundled MLIR bindings are
private, with this API on jax 0.10.2 and 0.11. The Triton kernel's is Pallas' own
`elementwise_inline_asm`.
"""

from __future__ import annotations

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pallas_triton

# float16 holds e4m3's w as w / 2^8: the difference of the exponent biases (15 - 7).
FACTOR = 256.0
# A byte permute whose output bytes are: byte j of the word, then its sign replicated (selector
# nibble 8 + j), for bytes 0 and 1, and for bytes 2 and 3.
_SIGN_EXTEND = (0x9180, 0xB3A2)
_MASK = 0x017F017F  # a 16-bit half's sign (as bit 8) and the byte's 7 low bits
_SHIFT = 7


def _prmt(word: np.ndarray, selector: int) -> np.ndarray:
    """PTX's `prmt.b32 d, word, 0, selector` (default mode) on uint32 words: output byte i is the
    byte selector nibble i names (0-3 the word's, 4-7 zero), or with the nibble's bit 3 that
    byte's sign bit replicated."""
    source = np.concatenate([word.view(np.uint8).reshape(-1, 4), np.zeros((word.size, 4), np.uint8)], axis=1)
    out = np.empty((word.size, 4), np.uint8)
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = source[:, nibble & 7]
        out[:, i] = np.where(byte & 0x80, 0xFF, 0) if nibble & 8 else byte
    return out.reshape(-1).view(np.uint32)


def scaled_float16(codes: np.ndarray) -> np.ndarray:
    """The recipe in numpy, instruction by instruction as the kernels emit it: e4m3 codes (uint8, a
    multiple of 4) -> float16, w / FACTOR for each finite code's w, in the codes' order."""
    words = np.ascontiguousarray(codes, np.uint8).view(np.uint32)
    pairs = [(_prmt(words, selector) & np.uint32(_MASK)) << np.uint32(_SHIFT) for selector in _SIGN_EXTEND]
    return np.stack(pairs, axis=1).view(np.float16).reshape(-1)


def _pair_ptx(selector: int, out: str, word: str) -> str:
    """PTX that makes register `out` the float16 pair w / FACTOR of the two bytes of `word` that
    `selector` sign-extends (a `.b32` register named `extended` must be declared)."""
    return (f"prmt.b32 extended, {word}, 0, {selector:#06x}; and.b32 extended, extended, {_MASK:#010x}; "
            f"shl.b32 {out}, extended, {_SHIFT};")


def _pair_words(word: ir.Value) -> list[ir.Value]:
    """A 32-bit word of four e4m3 bytes -> two words of float16 pairs (bytes 0, 1 and 2, 3)."""
    i32 = ir.IntegerType.get_signless(32)
    return [llvm.inline_asm(i32, [word], f"{{ .reg .b32 extended; {_pair_ptx(selector, '$0', '$1')} }}", "=r,r")
            for selector in _SIGN_EXTEND]


def upcast_triton(tile: jax.Array) -> jax.Array:
    """tile float8_e4m3fn (a value inside a Pallas Triton kernel compiled for a GPU; its size a
    multiple of 4) -> float16 of its shape, each w / FACTOR (module docstring)."""
    (halves,) = pallas_triton.elementwise_inline_asm(
        f"{{ .reg .b32 extended; {_pair_ptx(_SIGN_EXTEND[0], '$0', '$2')} {_pair_ptx(_SIGN_EXTEND[1], '$1', '$2')} }}",
        args=[jax.lax.bitcast_convert_type(tile, jnp.uint8)], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, jnp.float16)])
    return halves


def upcast_mosaic(weights: jax.Array, layout) -> jax.Array:
    """weights (float8_e4m3fn registers in `layout`, four bytes a register, as Mosaic GPU's
    WGMMA_UPCAST_2X layout holds them) -> float16 registers in the same layout, each w / FACTOR
    (module docstring). Inside a `plgpu.kernel` compiled for a GPU."""

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(weights.shape, jnp.float16, layout=layout))
    def body(_, codes):
        i32 = ir.IntegerType.get_signless(32)
        f16 = ir.F16Type.get()
        registers = np.empty_like(codes.registers)
        for index, register in np.ndenumerate(codes.registers):
            (length,) = ir.VectorType(register.type).shape
            if length != 4:
                raise NotImplementedError(f"e4m3_upcast.upcast_mosaic: registers of {length} bytes, expected 4")
            pairs = [mgpu_utils.bitcast(word, ir.VectorType.get((2,), f16))
                     for word in _pair_words(mgpu_utils.bitcast(register, i32))]
            registers[index] = mgpu_utils.vector_concat(pairs)
        return mgpu.FragmentedArray(_registers=registers, _layout=codes.layout, _is_signed=None)

    return body(weights)
