"""Acceptance rules: pure functions from draft and target tokens to accepted counts.

Greedy chain verification: draft token j (0-based) is accepted when it equals the target's argmax
after the previous window token and every earlier draft was accepted; the bonus token is the
target's argmax after the last accepted one. Emitted tokens per row are therefore
`target_tokens[:, :accepted + 1]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_accept_chain(draft_tokens: jax.Array, target_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft_tokens [B, k], target_tokens [B, k + 1] (argmax after each window token)
    -> accepted [B] int32 in [0, k], bonus [B] int32 (`target_tokens[b, accepted[b]]`)."""
    matches = draft_tokens == target_tokens[:, :-1]
    accepted = jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus
