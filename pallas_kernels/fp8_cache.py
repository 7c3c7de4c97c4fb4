"""FP8 caches as DeepSeek serves V3.2 and V4: the layouts, their quantizers and the Hadamard rotation.

Three kinds of paged pool hold FP8 entries, each an `Fp8Pool`:

* the MLA latent, FlashMLA's sparse FP8 decode token: the kv_lora_rank (Dq = 512) latent values in
  e4m3, one float32 scale per 128 of them (4), and the Dr = 64 RoPE values in bfloat16, 656 bytes
  a token. The scales follow vLLM's `concat_and_cache_ds_mla_kernel` (csrc/cache_kernels.cu), the
  writer of the cache FlashMLA reads: s = max(amax / 448, FLT_MIN) per 128-value tile, not rounded
  to a power of two (`quantize_latent`; the division is amax * f32(1 / 448), as XLA computes any
  division by a constant, so a scale may sit one float32 ulp from vLLM's IEEE quotient).
* DeepSeek-V4's K=V entries (the sliding-window ring and the CSA / HCA compressed entries),
  FlashMLA's `MODEL1_FP8Sparse` token (its `tests/quant.py`, read by its sm90 sparse FP8 decode):
  the head_dim - 64 = 448 leading values in e4m3 with one power-of-two scale per 64 of them (7),
  and the 64 RoPE values in bfloat16, 584 bytes a token packed (`pack_model1`). The scales follow
  the writers that serve V4 (vLLM's `fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`, SGLang's
  `cast_to_ue8m0`): amax clamped to >= 1e-4, s = 2 ** ceil(log2(amax / 448)), which is
  `quantize_act` with power-of-two scales on 64-value blocks (`V4_RULE`). FlashMLA's own test
  clamps the scale instead (s >= 1e-4), which differs only for blocks whose amax is below about
  0.045. FlashMLA multiplies e4m3 by the scale in bfloat16; the scale is a power of two, so that
  product is exact and equals `entries`' float32 product rounded to bfloat16.
* the DSA indexer keys: Hadamard-rotated (`rotate`), then e4m3 with one float32 scale per 128 values
  by DeepSeek's `act_quant` (DeepSeek-V3.2-Exp `inference/kernel.py`): amax clamped to >= 1e-4,
  s = amax * (1 / 448), rounded up to a power of two where the config sets `scale_fmt` ("ue8m0"
  in V3.2's), y = e4m3(clamp(x / s, -448, 448)) (`quantize_act`). The indexer queries are rotated
  and quantized the same way; the scores then come from the FP8 values (`indexer.score_keys`).

A pool keeps the three parts of a token as three arrays with the token's bytes (values
[P, page, Dq] e4m3, scales [P, page, Dq / block] float32, rope [P, page, Dr] bfloat16), not one
[P, page, 656] uint8 array: the Triton kernels would have to rebuild each float32 scale from four
loaded bytes, and Pallas' Triton lowering bitcasts only between types of one width (jax 0.10).
A V4 pool's power-of-two scales are float32 too (FlashMLA's byte is the exponent + 127).
`pack_flashmla` / `unpack_flashmla` and `pack_model1` / `unpack_model1` convert to and from
FlashMLA's packed tokens, byte for byte.

Widths. A quantization block is the rule's (`scale_block`: 128 values, 64 for V4's entries), or the
whole width where that is narrower (the small test models: kv_lora_rank 48 is one block of 48).
`check_fp8_widths` and `check_v4_fp8_widths` say which models fit.

Quantization is per token, so an entry's bytes never depend on the window that wrote it: greedy
speculation stays equal to plain greedy with FP8 caches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .paged import gather_rows, read_slots, write_slots

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
# Values per float32 scale (FlashMLA's V3.2 tile, DeepSeek's act_quant block).
SCALE_BLOCK = 128
# Values per scale of a DeepSeek-V4 entry (FlashMLA's MODEL1 tile).
V4_SCALE_BLOCK = 64
# The latent's RoPE part stays in bfloat16 (FlashMLA's token).
ROPE_DTYPE = jnp.bfloat16
# Scale rules (`Fp8Pool.rule`): FlashMLA's latent tiles; DeepSeek's act_quant with power-of-two
# scales (its config's `scale_fmt` "ue8m0", V3.2's release) or with amax / 448 (no `scale_fmt`);
# DeepSeek-V4's entries (FlashMLA's MODEL1 token: act_quant's power-of-two scales on 64-value blocks).
LATENT_RULE, INDEX_RULE, PLAIN_INDEX_RULE, V4_RULE = "flashmla", "act_quant_ue8m0", "act_quant", "flashmla_model1"
RULES = (LATENT_RULE, INDEX_RULE, PLAIN_INDEX_RULE, V4_RULE)
INDEX_RULES = {"ue8m0": INDEX_RULE, None: PLAIN_INDEX_RULE}
CACHE_DTYPES = (None, "fp8")


def scale_block(width: int, rule: str = LATENT_RULE) -> int:
    """Values per scale for a quantized part `width` wide under `rule`: the rule's block (128, or
    64 for V4_RULE), or the width where it is narrower."""
    return min(V4_SCALE_BLOCK if rule == V4_RULE else SCALE_BLOCK, width)


def check_cache_dtype(cache_dtype) -> None:
    """ValueError unless `cache_dtype` is one of CACHE_DTYPES (None: the compute dtype)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype={cache_dtype!r}: must be one of {CACHE_DTYPES} (None: the compute dtype)")


def check_fp8_widths(*, kv_lora_rank: int, index_head_dim: int = 0) -> None:
    """ValueError unless FP8 caches fit these widths: kv_lora_rank must be <= 128 or a multiple of
    128 (whole scale blocks); index_head_dim (0: no indexer) must be a power of two (the Hadamard
    transform) and <= 128 (DeepSeek's `fp8_index` takes one query scale per head and one key scale
    per slot)."""
    if kv_lora_rank > SCALE_BLOCK and kv_lora_rank % SCALE_BLOCK:
        raise ValueError(f"cache_dtype='fp8': kv_lora_rank={kv_lora_rank} must be <= {SCALE_BLOCK} or a multiple "
                         f"of {SCALE_BLOCK} (one float32 scale per {SCALE_BLOCK} latent values)")
    if index_head_dim and (index_head_dim & (index_head_dim - 1) or index_head_dim > SCALE_BLOCK):
        raise ValueError(f"cache_dtype='fp8': index_head_dim={index_head_dim} must be a power of two (the Hadamard "
                         f"rotation) and <= {SCALE_BLOCK} (one scale per indexer key)")


def check_v4_fp8_widths(*, head_dim: int, rope_dim: int) -> None:
    """ValueError unless DeepSeek-V4's entries fit FP8 caches: head_dim - rope_dim (the quantized
    part) must be <= 64 or a multiple of 64 (whole scale blocks: 448 = 7 x 64 at DeepSeek's widths)."""
    quant_dim = head_dim - rope_dim
    if quant_dim < 1 or (quant_dim > V4_SCALE_BLOCK and quant_dim % V4_SCALE_BLOCK):
        raise ValueError(f"cache_dtype='fp8': head_dim - qk_rope_head_dim = {head_dim} - {rope_dim} = {quant_dim} "
                         f"must be positive and <= {V4_SCALE_BLOCK} or a multiple of {V4_SCALE_BLOCK} (one "
                         f"power-of-two scale per {V4_SCALE_BLOCK} values, FlashMLA's MODEL1 token)")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales", "rope"], meta_fields=["rule"])
@dataclasses.dataclass(frozen=True)
class Fp8Pool:
    """One layer's paged pool of FP8 entries (or, inside a kernel, the refs of one).

    values: [P, page, Dq] float8_e4m3fn; scales: [P, page, Dq / block] float32 (block =
    `scale_block(Dq, rule)`); rope: [P, page, Dr] bfloat16, or None (indexer keys); rule: how
    `write` picks the scales (LATENT_RULE, INDEX_RULE / PLAIN_INDEX_RULE for indexer keys, V4_RULE
    for DeepSeek-V4's entries). Any leading shape works the same ([n, P, page, ...] stacked over
    layers, or gathered rows). An entry reads as
    `concat[values * scales (per block), rope]`, [Dq + Dr] (`dequantize`).
    """

    values: jax.Array
    scales: jax.Array
    rope: jax.Array | None
    rule: str = LATENT_RULE

    @property
    def shape(self) -> tuple[int, int, int]:
        """[P, page, Dq + Dr]: the shape of the dequantized pool (what a compute-dtype pool has)."""
        rope = 0 if self.rope is None else self.rope.shape[-1]
        return (*self.values.shape[:-1], self.values.shape[-1] + rope)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def token_bytes(self) -> int:
        """Bytes one slot takes: 656 for DeepSeek's latent (512 + 4 * 4 + 64 * 2), 132 for its keys,
        604 for a V4 entry (448 + 7 * 4 + 64 * 2; FlashMLA's packed token holds the 7 scales in a
        byte each, 584)."""
        return sum(a.shape[-1] * a.dtype.itemsize for a in jax.tree.leaves(self))


def key_rule(keys) -> str | None:
    """A key cache's scale rule: its `Fp8Pool.rule`, None for keys in the compute dtype (an array or None)."""
    return keys.rule if isinstance(keys, Fp8Pool) else None


def init_pool(num_pages: int, page_size: int, quant_dim: int, rope_dim: int = 0, *, rule: str = LATENT_RULE,
              stack: tuple[int, ...] = ()) -> Fp8Pool:
    """An all-zero pool of [*stack, num_pages, page_size] slots: quant_dim values in e4m3 (and
    their scales, `scale_block(quant_dim, rule)` values each), rope_dim values in bfloat16 (0: no
    rope part, `rope` is None)."""
    slots = (*stack, num_pages, page_size)
    return Fp8Pool(values=jnp.zeros((*slots, quant_dim), E4M3),
                   scales=jnp.zeros((*slots, quant_dim // scale_block(quant_dim, rule)), jnp.float32),
                   rope=jnp.zeros((*slots, rope_dim), ROPE_DTYPE) if rope_dim else None, rule=rule)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """[..., D] -> [..., D / block, block] float32."""
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _to_e4m3(blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """blocks [..., N, block] / scales [..., N], clamped to +-448, rounded to nearest even -> [..., N * block] e4m3."""
    y = jnp.clip(blocks / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return y.reshape(*y.shape[:-2], -1)


def quantize_latent(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FlashMLA's latent quantization (vLLM `concat_and_cache_ds_mla_kernel`): x [..., Dq] ->
    (e4m3 [..., Dq], scales [..., Dq / block] float32), s = max(amax * f32(1 / 448), FLT_MIN) per
    block (XLA rewrites amax / 448 into that product; written so, it says what runs)."""
    blocks = _blocks(x, scale_block(x.shape[-1]))
    scales = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1) * jnp.float32(1 / E4M3_MAX), jnp.finfo(jnp.float32).tiny)
    return _to_e4m3(blocks, scales), scales


def quantize_act(x: jax.Array, *, pow2_scales: bool = True, block: int = SCALE_BLOCK) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's `act_quant` (V3.2-Exp `inference/kernel.py`): x [..., D] -> (e4m3 [..., D],
    scales [..., D / block] float32), block = min(block, D). amax = max(max|x|, 1e-4) per block,
    s = amax * f32(1 / 448); pow2_scales (`scale_fmt` set, "ue8m0"): s = 2 ** ceil(log2(s)), which
    the kernel takes from the float's bits (exponent, plus one if any mantissa bit is set);
    `jnp.frexp` gives the same. With power-of-two scales, dividing by s and multiplying by 1 / s
    (vLLM's V4 writer) are the same exact operation."""
    blocks = _blocks(x, min(block, x.shape[-1]))
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-4)
    scales = amax * jnp.float32(1 / E4M3_MAX)
    if pow2_scales:
        mantissa, exponent = jnp.frexp(scales)  # scales = mantissa * 2**exponent, mantissa in [0.5, 1)
        scales = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    return _to_e4m3(blocks, scales), scales


def fp8_index_queries(q_idx: jax.Array, raw_weights: jax.Array, *, pow2_scales: bool) -> tuple[jax.Array, jax.Array]:
    """The query side of DeepSeek's FP8 indexer (V3.2-Exp `inference/model.py`, `Indexer.forward`):
    q_idx [B, Q, Hi, Di] (after its RoPE), raw_weights [B, Q, Hi] float32 (`weights_proj(x)`) ->
    (rotated e4m3 queries [B, Q, Hi, Di], weights [B, Q, Hi] = raw * Hi**-0.5 * q_scale * Di**-0.5,
    multiplied in that order). Di <= 128, so each head has one scale, which `fp8_index` folds into
    its weight. pow2_scales: as `quantize_act` (the key pool's rule: INDEX_RULE or PLAIN_INDEX_RULE)."""
    heads, dim = q_idx.shape[-2:]
    q_fp8, q_scale = quantize_act(rotate(q_idx), pow2_scales=pow2_scales)
    return q_fp8, raw_weights * heads ** -0.5 * q_scale[..., 0] * dim ** -0.5


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., Dq] e4m3, scales [..., Dq / block] -> [..., Dq] float32 (values * their block's scale)."""
    blocks = values.astype(jnp.float32).reshape(*scales.shape, -1)
    return (blocks * scales[..., None]).reshape(values.shape)


def entries(pool: Fp8Pool) -> jax.Array:
    """A pool (or gathered rows of one: any leading shape) -> its entries [..., Dq + Dr] bfloat16:
    each value times its scale, rounded to bfloat16, as FlashMLA dequantizes in registers before
    its bfloat16 tensor-core products (the Triton kernels do the same, so every reader sees the
    same entries), then the RoPE part."""
    latent = dequantize(pool.values, pool.scales).astype(ROPE_DTYPE)
    return latent if pool.rope is None else jnp.concatenate([latent, pool.rope], axis=-1)


def quantize_entries(values: jax.Array, rule: str, quant_dim: int) -> Fp8Pool:
    """Entries [..., Dq + Dr] -> what a pool of `rule` stores for them: an `Fp8Pool` of e4m3
    [..., Dq], scales and rope [..., Dr] (or None)."""
    if rule == LATENT_RULE:
        quantized, scales = quantize_latent(values[..., :quant_dim])
    elif rule in (INDEX_RULE, PLAIN_INDEX_RULE):
        quantized, scales = quantize_act(values[..., :quant_dim], pow2_scales=rule == INDEX_RULE)
    elif rule == V4_RULE:  # rounded to bfloat16 first, as vLLM's V4 writers quantize the entry
        quantized, scales = quantize_act(values[..., :quant_dim].astype(ROPE_DTYPE), block=V4_SCALE_BLOCK)
    else:
        raise ValueError(f"Fp8Pool.rule={rule!r}: must be one of {RULES}")
    rope = values[..., quant_dim:].astype(ROPE_DTYPE) if values.shape[-1] > quant_dim else None
    return Fp8Pool(quantized, scales, rope, rule)


# -- paged access: plain arrays and FP8 pools alike --------------------------------------------------

def write_entries(cache, page_table: jax.Array, slots: jax.Array, values: jax.Array):
    """`paged.write_slots` for a plain pool [P, page, D] or an `Fp8Pool`, which quantizes
    values [B, Q, Dq + Dr] per token by its rule first."""
    if not isinstance(cache, Fp8Pool):
        return write_slots(cache, page_table, slots, values)
    return jax.tree.map(lambda pool, part: write_slots(pool, page_table, slots, part), cache,
                        quantize_entries(values, cache.rule, cache.values.shape[-1]))


def read_parts(cache, page_table: jax.Array, slots: jax.Array):
    """`paged.read_slots` of every part: [B, ..., D] for a plain pool, an `Fp8Pool` of [B, ...] rows
    for an FP8 one (zeros where a slot is invalid)."""
    return jax.tree.map(lambda pool: read_slots(pool, page_table, slots), cache)


def copy_slots(cache, page_table: jax.Array, src_slots: jax.Array, dst_slots: jax.Array):
    """A plain pool [P, page, D] or an `Fp8Pool` with slots src_slots copied to dst_slots (both
    [B, L] int32, -1 = skip): every part's stored bytes, never requantized; every source is read
    before anything is written, so a destination may be another pair's source."""
    return jax.tree.map(lambda part: write_slots(part, page_table, dst_slots, read_slots(part, page_table, src_slots)),
                        cache)


def gather_parts(cache, page_table: jax.Array):
    """`paged.gather_rows` of every part: [B, S, D] for a plain pool, an `Fp8Pool` of [B, S, ...]."""
    return jax.tree.map(lambda pool: gather_rows(pool, page_table), cache)


def as_entries(rows) -> jax.Array:
    """Gathered rows (`read_parts` / `gather_parts`) -> entries [..., D]: an FP8 pool's dequantized
    (`entries`, bfloat16), a plain pool's as they are."""
    return entries(rows) if isinstance(rows, Fp8Pool) else rows


def as_stored(cache, values: jax.Array) -> jax.Array:
    """values [..., D] as `cache` (a plain pool or an `Fp8Pool`) would read them back once written:
    cast to a plain pool's dtype, or quantized by an FP8 pool's rule and dequantized (`entries`)."""
    if not isinstance(cache, Fp8Pool):
        return values.astype(cache.dtype)
    return entries(quantize_entries(values, cache.rule, cache.values.shape[-1]))


def entry_dtype(cache):
    """The dtype `cache`'s entries read as: a plain pool's own, an `Fp8Pool`'s RoPE dtype (its
    dequantized entries are rounded to it, `entries`)."""
    return cache.rope.dtype if isinstance(cache, Fp8Pool) else cache.dtype


def cache_token_bytes(cache) -> int:
    """Bytes a slot of `cache` (a plain pool [P, page, D] or an `Fp8Pool`) takes."""
    return cache.token_bytes if isinstance(cache, Fp8Pool) else cache.shape[-1] * cache.dtype.itemsize


def flat_pool(cache):
    """A pool [P, page, ...] (or any keys [..., width], plain or an `Fp8Pool`) as its kernels read
    it: every part [rows, width], its leading dims flattened."""
    return jax.tree.map(lambda pool: pool.reshape(-1, pool.shape[-1]), cache)


# -- FlashMLA's packed token ---------------------------------------------------------------------------

def pack_flashmla(pool: Fp8Pool) -> jax.Array:
    """A latent pool -> [P, page, Dq + 4 * Dq / block + 2 * Dr] uint8, FlashMLA's token byte for
    byte (656 bytes at DeepSeek's widths): the e4m3 values, the float32 scales, the bfloat16 RoPE
    values, each little-endian as the GPU stores them."""
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape[:-1], -1)
    return jnp.concatenate([as_bytes(pool.values), as_bytes(pool.scales), as_bytes(pool.rope)], axis=-1)


def unpack_flashmla(packed: jax.Array, quant_dim: int, rope_dim: int) -> Fp8Pool:
    """The inverse of `pack_flashmla`: [P, page, bytes] uint8 -> the latent pool of those widths."""
    num_scales = quant_dim // scale_block(quant_dim)
    expected = quant_dim + 4 * num_scales + 2 * rope_dim
    if packed.shape[-1] != expected:
        raise ValueError(f"packed token of {packed.shape[-1]} bytes: expected {expected} for quant_dim={quant_dim}, "
                         f"rope_dim={rope_dim}")
    lead = packed.shape[:-1]
    values = jax.lax.bitcast_convert_type(packed[..., :quant_dim], E4M3)
    scales = jax.lax.bitcast_convert_type(
        packed[..., quant_dim:quant_dim + 4 * num_scales].reshape(*lead, num_scales, 4), jnp.float32)
    rope = jax.lax.bitcast_convert_type(packed[..., quant_dim + 4 * num_scales:].reshape(*lead, rope_dim, 2),
                                        ROPE_DTYPE)
    return Fp8Pool(values=values, scales=scales, rope=rope, rule=LATENT_RULE)


# FlashMLA's MODEL1 page: its tokens' values and RoPE parts, then a byte per scale (and one pad byte) for
# each token, the page padded to whole 576-byte units (`tests/quant.py`, `quantize_k_cache`).
MODEL1_SCALE_BYTES, MODEL1_PAGE_UNIT = 8, 576


def pack_model1(pool: Fp8Pool) -> jax.Array:
    """A V4 pool (V4_RULE) [P, page, ...] -> [P, bytes] uint8, FlashMLA's `MODEL1_FP8Sparse` page
    byte for byte: page x (Dq e4m3 values, then Dr bfloat16 RoPE values little-endian), then page
    x (Dq / 64 scale bytes, each the power-of-two scale's exponent + 127 (`float8_e8m0fnu`), and a
    0 pad byte to 8), zeros to a multiple of 576 bytes (584 bytes a token at DeepSeek's widths)."""
    if pool.rule != V4_RULE or pool.rope is None:
        raise ValueError(f"pack_model1: needs a V4 entry pool (rule {V4_RULE!r}, with a RoPE part), got rule "
                         f"{pool.rule!r}{'' if pool.rope is not None else ' without a RoPE part'}")
    num_pages, page_size = pool.values.shape[:2]
    num_scales = pool.scales.shape[-1]
    if num_scales >= MODEL1_SCALE_BYTES:
        raise ValueError(f"pack_model1: {num_scales} scales a token do not fit FlashMLA's {MODEL1_SCALE_BYTES} bytes")
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape[:-1], -1)
    # A power-of-two float32's biased exponent is its e8m0 byte: the bits above the 23-bit mantissa.
    exponents = (jax.lax.bitcast_convert_type(pool.scales, jnp.uint32) >> 23).astype(jnp.uint8)
    scale_bytes = jnp.pad(exponents, [(0, 0), (0, 0), (0, MODEL1_SCALE_BYTES - num_scales)])
    tokens = jnp.concatenate([as_bytes(pool.values), as_bytes(pool.rope)], axis=-1)
    page = jnp.concatenate([tokens.reshape(num_pages, -1), scale_bytes.reshape(num_pages, -1)], axis=-1)
    return jnp.pad(page, [(0, 0), (0, -page.shape[1] % MODEL1_PAGE_UNIT)])


def unpack_model1(packed: jax.Array, page_size: int, quant_dim: int, rope_dim: int) -> Fp8Pool:
    """The inverse of `pack_model1`: [P, bytes] uint8 pages of `page_size` tokens -> the V4 pool of
    those widths (ValueError if the page's size is not FlashMLA's for them)."""
    num_scales = quant_dim // scale_block(quant_dim, V4_RULE)
    token = quant_dim + 2 * rope_dim
    used = page_size * (token + MODEL1_SCALE_BYTES)
    expected = used + -used % MODEL1_PAGE_UNIT
    if packed.ndim != 2 or packed.shape[1] != expected:
        raise ValueError(f"packed pages of shape {tuple(packed.shape)}: expected [P, {expected}] for page_size="
                         f"{page_size}, quant_dim={quant_dim}, rope_dim={rope_dim}")
    num_pages = packed.shape[0]
    tokens = packed[:, :page_size * token].reshape(num_pages, page_size, token)
    exponents = packed[:, page_size * token:used].reshape(num_pages, page_size, MODEL1_SCALE_BYTES)[..., :num_scales]
    return Fp8Pool(values=jax.lax.bitcast_convert_type(tokens[..., :quant_dim], E4M3),
                   scales=jax.lax.bitcast_convert_type(exponents.astype(jnp.uint32) << 23, jnp.float32),
                   rope=jax.lax.bitcast_convert_type(tokens[..., quant_dim:].reshape(num_pages, page_size, rope_dim, 2),
                                                     ROPE_DTYPE),
                   rule=V4_RULE)


# -- the indexer's rotation ------------------------------------------------------------------------------

@functools.cache
def hadamard_matrix(dim: int) -> np.ndarray:
    """The Sylvester Hadamard matrix H_dim [dim, dim] of +-1 (dim a power of two), float32: the
    matrix `fast_hadamard_transform.hadamard_transform` multiplies by."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"dim={dim}: the Hadamard transform needs a power of two")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return h


def rotate(x: jax.Array) -> jax.Array:
    """DeepSeek's `rotate_activation`: x [..., D] -> x @ H_D * D**-0.5 in float32, returned in x's
    dtype (bfloat16 in, bfloat16 out, as `hadamard_transform(x, scale=D ** -0.5)` does). Orthogonal:
    unquantized dot products are unchanged; it spreads outliers before the FP8 quantization."""
    dim = x.shape[-1]
    h = jnp.asarray(hadamard_matrix(dim))
    rotated = jnp.einsum("...d,de->...e", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return (rotated * dim ** -0.5).astype(x.dtype)
