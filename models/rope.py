"""Rotary position embeddings with DeepSeek-V3's YaRN frequency scaling.

MLA rotates its 64 RoPE dims *interleaved* (pairs (x[2i], x[2i+1]), as DeepSeek's
`apply_rotary_emb` views them as complex numbers); the V3.2 indexer rotates its first 64 dims in the
*half-split* layout (pairs (x[i], x[i + d/2])). Both use the same frequencies.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxspec.model_config import ModelConfig


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(config: ModelConfig) -> tuple[jax.Array, float]:
    """Inverse frequencies [Dr / 2] float32 and the cos/sin magnitude (YaRN attention factor).

    YaRN (DeepSeek `precompute_freqs_cis`): dimensions rotating faster than `beta_fast` turns over
    the original context keep their frequency, slower than `beta_slow` are divided by `factor`, with
    a linear ramp between. It applies whenever `rope_scaling` is set (as in transformers), not only
    past the original length. The magnitude is `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`
    when both are set (1 for DeepSeek's released configs, where both are 1.0), else YaRN's default
    `mscale(factor, 1)`, as in transformers and DeepSeek's Hugging Face modeling code; the softmax
    side of YaRN is in `ModelConfig.softmax_scale`.
    """
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    rs = config.rope_scaling
    if rs is None or rs.factor <= 1:
        return inv_freq, 1.0

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 where the original frequency is kept (fast dims)
    inv_freq = inv_freq / rs.factor * (1.0 - keep) + inv_freq * keep
    if rs.mscale and rs.mscale_all_dim:
        magnitude = _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
    else:
        magnitude = _yarn_mscale(rs.factor, 1.0)
    return inv_freq, magnitude


def rope_angles(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, Q] -> (cos, sin) [B, Q, Dr / 2] float32, magnitude folded in."""
    inv_freq, magnitude = rope_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles) * magnitude, jnp.sin(angles) * magnitude


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotate x [B, Q, (H,) Dr] by angles [B, Q, Dr / 2]; the result keeps x's layout and dtype."""
    if x.ndim == cos.ndim + 1:  # a heads axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        real, imag = xf[..., 0::2], xf[..., 1::2]
    else:
        real, imag = jnp.split(xf, 2, axis=-1)
    rot_real = real * cos - imag * sin
    rot_imag = real * sin + imag * cos
    if interleaved:
        out = jnp.stack([rot_real, rot_imag], axis=-1).reshape(x.shape)
    else:
        out = jnp.concatenate([rot_real, rot_imag], axis=-1)
    return out.astype(x.dtype)


def rotate_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """DeepSeek-V4's partial RoPE: rotate the last `Dr = 2 * cos.shape[-1]` dims of x [B, Q, (H,) D]
    interleaved by angles [B, Q, Dr / 2], keep the leading D - Dr. With `-sin`, the inverse rotation
    (V4 un-rotates its attention output, whose values carry the keys' rotation)."""
    rope_dim = 2 * cos.shape[-1]
    return jnp.concatenate([x[..., :-rope_dim], apply_rope(x[..., -rope_dim:], cos, sin, interleaved=True)], axis=-1)
