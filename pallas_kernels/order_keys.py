"""IEEE total order as int32 keys: what the MoE router's selections compare (`jaxspec.pallas_kernels.ranks`,
`router_mosaic`), so that NaN and signed zeros order the same way on every platform and in every
implementation.

The order is `lax.top_k`'s on floats: +NaN > +inf > ... > +0.0 > -0.0 > ... > -inf > -NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Below every key, or equal to the lowest -NaN's, which no selection can tell from it.
LOWEST_KEY = jnp.iinfo(jnp.int32).min


def total_order_keys(values: jax.Array) -> jax.Array:
    """values [...] float (float32 or narrower) -> int32 keys [...] whose signed order is the values'
    IEEE total order (each key is the value's float32 bits, with the magnitude bits flipped for a
    negative sign)."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def ordered_values(keys: jax.Array) -> jax.Array:
    """`total_order_keys`' inverse: int32 keys [...] -> the float32 values [...] they order."""
    return jax.lax.bitcast_convert_type(keys ^ ((keys >> 31) & 0x7FFFFFFF), jnp.float32)
