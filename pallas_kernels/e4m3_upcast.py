"""FP8 (e4m3) weights to float16, or to bfloat16, by integer operations, in inline PTX for both
grouped matmuls (their `Tiles.integer_upcast`, variant `k64-int`).

Why: Hopper issues conversion instructions at a fraction of its integer and float32 rates, and
both FP8 loops spend one a weight (the Mosaic kernel's sm_90a SASS for a K step of 64, per thread:
32 `F2FP.F16.E4M3.UNPACK_B` and 32 `F2FP.BF16.F32.PACK_AB` for 64 weights, beside 64 `HADD2.F32`
and 64 `FMUL`; the Triton kernel's PTX the same); Triton's compiler replaced its int8-to-bfloat16
conversions with integer operations on Hopper for the same reason. Here a pair of e4m3 bytes
becomes a 16-bit float pair with three integer instructions: a byte permute that sign-extends each
byte to 16 bits, a mask, a shift. Whether that is faster is the GPU's to say (docs/performance.md);
the values are the same bit for bit. Two targets, chosen per scale block:

* **bfloat16, when the block's scale is a power of two** (`bfloat16_exact`: 2^e with e in
  [-117, 7]). Masked with 0x087F and shifted left by 4, the sign-extended byte b = s eeee mmm is the
  bfloat16 s 000eeee mmm0000, that is w / 2^120 for e4m3's value w, exactly (the exponent biases
  differ by 127 - 7; e4m3's subnormals become bfloat16's, whose steps of 2^-129 it holds). One
  bfloat16 multiply by the scale times 2^120 (`bfloat16_scale`, exact: at most 2^127) then gives w
  times the scale, and that product is exact: w has 4 significant bits, and at those exponents it
  is a normal number in float32 and in bfloat16. `block_fp8.dequantize` computes the same exact
  product in float32 and rounds it to bfloat16 without change, so the bits are equal. The loop then
  has no conversion and no float32 arithmetic at all: 2 instructions a weight, where converting
  spends about 4. DeepSeek's releases since V3.1 scale their weights by powers of two (their
  configs' `scale_fmt` "ue8m0"; V4 stores the scales as float8_e8m0fnu), and so do random FP8
  models of such a config (`block_fp8.quantize`).
* **float16, any other scale.** Masked with 0x017F and shifted left by 7, the byte is the float16
  s 0eeee mmm0000000, that is w / 256, exactly, subnormals included (biases 15 - 7; e4m3's
  subnormal steps of 2^-9 become float16's of 2^-17, above its smallest 2^-24). In float32 times
  the block's scale times 256 it is w times the scale: both factors exact, the same real product,
  so the same float32 rounding as `block_fp8.dequantize` (the scale times 256 is finite for every
  scale a quantization of finite float32 weights gives: at most 3.4e38 / 448 * 256). That leaves
  the rounding to bfloat16 as the loop's one conversion, half a one a weight.

A NaN byte (0x7F, 0xFF: e4m3fn's only NaN) reads as +-480 times the scale where the conversion
gives NaN; FP8 weights quantized from finite values hold none. `unpacked` is the recipe in numpy,
instruction by instruction; the tests hold both targets against `block_fp8.dequantize` for every
byte, in bytes of mixed signs (a wrong permute selector fails), at scales whose products are
normal float32 (XLA's CPU flushes subnormal ones; the kernels' float32 products, either way they
unpack, keep them).

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

# float16 holds e4m3's w as w / 2^8, bfloat16 as w / 2^120: the differences of the exponent
# biases (15 - 7, 127 - 7).
FACTOR = 256.0
BFLOAT16_FACTOR = 2.0 ** 120
# The scale exponents e (scale 2^e) at which the bfloat16 route is exact (module docstring): from
# the smallest product 2^-9 * 2^e still a normal float32 (2^-126) to a scale times BFLOAT16_FACTOR
# within bfloat16 (2^127).
BFLOAT16_EXPONENTS = (-117, 7)
# A byte permute whose output bytes are: byte j of the word, then its sign replicated (selector
# nibble 8 + j), for bytes 0 and 1, and for bytes 2 and 3.
_SIGN_EXTEND = (0x9180, 0xB3A2)
# Per target, the mask that keeps of each sign-extended 16-bit half one sign bit and the byte's 7
# low bits, and the shift that puts them in the target's sign bit and its exponent and mantissa.
_MASK_SHIFT = {jnp.dtype(jnp.float16): (0x017F017F, 7), jnp.dtype(jnp.bfloat16): (0x087F087F, 4)}


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


def unpacked(codes: np.ndarray, dtype) -> np.ndarray:
    """The recipe in numpy, instruction by instruction as the kernels emit it: e4m3 codes (uint8, a
    multiple of 4) -> `dtype` (float16: w / FACTOR; bfloat16: w / BFLOAT16_FACTOR) for each finite
    code's w, in the codes' order."""
    mask, shift = _MASK_SHIFT[jnp.dtype(dtype)]
    words = np.ascontiguousarray(codes, np.uint8).view(np.uint32)
    pairs = [(_prmt(words, selector) & np.uint32(mask)) << np.uint32(shift) for selector in _SIGN_EXTEND]
    return np.stack(pairs, axis=1).view(jnp.dtype(dtype)).reshape(-1)


def bfloat16_exact(scale: jax.Array) -> jax.Array:
    """Whether a block's float32 scale (a scalar, inside a kernel or not) is 2^e with e in
    BFLOAT16_EXPONENTS, where the bfloat16 route gives `block_fp8.dequantize`'s bits."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
    exponent = jax.lax.shift_right_logical(bits, 23) - 127  # the sign bit, if set, puts it out of range
    low, high = BFLOAT16_EXPONENTS
    return ((bits & 0x7FFFFF) == 0) & (exponent >= low) & (exponent <= high)


def bfloat16_scale(scale: jax.Array) -> jax.Array:
    """A `bfloat16_exact` scale times BFLOAT16_FACTOR, as bfloat16 (exact): the one multiplier of
    the bfloat16 route's unpacked weights."""
    return (scale * BFLOAT16_FACTOR).astype(jnp.bfloat16)


def dequantized(upcast, scale: jax.Array) -> jax.Array:
    """A weight block's `block_fp8.dequantize` bits through either route (module docstring):
    upcast(dtype) -> the block unpacked to float16 or bfloat16 (`upcast_triton`, `upcast_mosaic`),
    scale: its float32 scale (a scalar); -> bfloat16. One branch a block, the same for every
    thread."""
    return jax.lax.cond(bfloat16_exact(scale),
                        lambda: upcast(jnp.bfloat16) * bfloat16_scale(scale),
                        lambda: (upcast(jnp.float16).astype(jnp.float32) * (scale * FACTOR)).astype(jnp.bfloat16))


def _pair_ptx(selector: int, out: str, word: str, dtype) -> str:
    """PTX that makes register `out` the `dtype` pair (module docstring) of the two bytes of `word`
    that `selector` sign-extends (a `.b32` register named `extended` must be declared)."""
    mask, shift = _MASK_SHIFT[jnp.dtype(dtype)]
    return (f"prmt.b32 extended, {word}, 0, {selector:#06x}; and.b32 extended, extended, {mask:#010x}; "
            f"shl.b32 {out}, extended, {shift};")


def _pair_words(word: ir.Value, dtype) -> list[ir.Value]:
    """A 32-bit word of four e4m3 bytes -> two words of `dtype` pairs (bytes 0, 1 and 2, 3)."""
    i32 = ir.IntegerType.get_signless(32)
    return [llvm.inline_asm(i32, [word], f"{{ .reg .b32 extended; {_pair_ptx(selector, '$0', '$1', dtype)} }}",
                            "=r,r")
            for selector in _SIGN_EXTEND]


def upcast_triton(tile: jax.Array, dtype) -> jax.Array:
    """tile float8_e4m3fn (a value inside a Pallas Triton kernel compiled for a GPU; its size a
    multiple of 4) -> `dtype` (float16 or bfloat16) of its shape, each w / FACTOR or w /
    BFLOAT16_FACTOR (module docstring)."""
    words = (_pair_ptx(selector, out, "$2", dtype) for selector, out in zip(_SIGN_EXTEND, ("$0", "$1")))
    (halves,) = pallas_triton.elementwise_inline_asm(
        f"{{ .reg .b32 extended; {' '.join(words)} }}",
        args=[jax.lax.bitcast_convert_type(tile, jnp.uint8)], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, dtype)])
    return halves


def upcast_mosaic(weights: jax.Array, layout, dtype) -> jax.Array:
    """weights (float8_e4m3fn registers in `layout`, four bytes a register, as Mosaic GPU's
    WGMMA_UPCAST_2X layout holds them) -> `dtype` (float16 or bfloat16) registers in the same
    layout, each w / FACTOR or w / BFLOAT16_FACTOR (module docstring). Inside a `plgpu.kernel`
    compiled for a GPU."""

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(weights.shape, dtype, layout=layout))
    def body(_, codes):
        i32 = ir.IntegerType.get_signless(32)
        element = ir.F16Type.get() if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else ir.BF16Type.get()
        registers = np.empty_like(codes.registers)
        for index, register in np.ndenumerate(codes.registers):
            (length,) = ir.VectorType(register.type).shape
            if length != 4:
                raise NotImplementedError(f"e4m3_upcast.upcast_mosaic: registers of {length} bytes, expected 4")
            pairs = [mgpu_utils.bitcast(word, ir.VectorType.get((2,), element))
                     for word in _pair_words(mgpu_utils.bitcast(register, i32), dtype)]
            registers[index] = mgpu_utils.vector_concat(pairs)
        return mgpu.FragmentedArray(_registers=registers, _layout=codes.layout, _is_signed=None)

    return body(weights)
