"""What the decoding engine may ask of a model family: the written contract between `jaxspec.models`
and the engine (`jaxspec.batch`, `jaxspec.loop`, `jaxspec.generation`, `jaxspec.memory_plan`,
`jaxspec.aot`).

A family is a Flax NNX module implementing `DecoderModel`, whose caches implement `DecodeCache`.
The engine never asks which family it runs: `DeepseekV3` (paged MLA latents) and `DeepseekV4`
(sliding-window rings and compressed entries) both implement these, and so does the toy model of
`tests/test_interface.py`. docs/model-interface.md says how to add a family.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import Visibility


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """The shape of the caches one decoding run needs, whatever the family.

    batch_size: rows B (a mesh's padding rows included); capacity: slots per row (the longest
    committed sequence plus one step's writes); page_size: slots per page; max_window: the most
    tokens Q of any call (a prefill chunk, the verification window, a drafting call), which a
    bounded structure (a ring) must leave room for; lookback: the widest tree call, whose
    committed positions the next call may revisit (at most max_window); row_shards: the cache is
    laid out for a mesh splitting the rows into that many blocks, each numbering its own pages;
    cache_dtype: None (entries in the model's compute dtype) or "fp8" (`DecodeConfig.cache_dtype`).
    """

    batch_size: int
    capacity: int
    page_size: int = 64
    max_window: int | None = None
    lookback: int | None = None
    row_shards: int = 1
    cache_dtype: str | None = None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `DecoderModel.init_cache` after its first two."""
        return dict(page_size=self.page_size, max_window=self.max_window, lookback=self.lookback,
                    row_shards=self.row_shards, cache_dtype=self.cache_dtype)


@runtime_checkable
class DecodeCache(Protocol):
    """A model's cache as the loop carries it: a pytree of arrays addressed by committed length.

    Whatever a call wrote past `lengths` is invisible to every later call and rewritten before
    anyone reads it, so rejecting drafts needs no operation at all.
    """

    lengths: jax.Array  # [B] int32: committed tokens per row
    page_table: Any     # the rows' page layout (an array or a dict of them): data, unlike the zeroed pools

    def replace(self, **changes) -> "DecodeCache":
        """This cache with the named fields replaced."""

    @property
    def page_size(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    def commit(self, lengths: jax.Array) -> "DecodeCache":
        """This cache with rows' committed lengths [B] set (entries below them become visible)."""

    def move(self, src_slots: jax.Array, dst_slots: jax.Array) -> "DecodeCache":
        """Copy each row's entries from src_slots to dst_slots, both [B, L] int32 (-1 = skip the
        pair), reading every source before writing: a tree's accepted path made contiguous."""

    def partition_specs(self, rows: PartitionSpec) -> "DecodeCache":
        """The same pytree with a `PartitionSpec` per leaf, given `rows`, the spec of an array whose
        leading axis is rows or a row's pages (`jaxspec.sharding.row_spec`)."""


def window_rows(x: jax.Array, at: jax.Array | None) -> jax.Array:
    """x [B, Q, ...] at the window positions `at` [B, L] int32 (each in [0, Q)) -> [B, L, ...];
    x itself where `at` is None: the rows a model call's `logits_at` selects."""
    if at is None:
        return x
    return jnp.take_along_axis(x, at.reshape(*at.shape, *(1,) * (x.ndim - 2)), axis=1)


@runtime_checkable
class DecoderModel(Protocol):
    """A target model with (optionally) its draft module, as the engine drives it.

    Token windows are `[B, Q]` with a `Visibility` (`jaxspec.pallas_kernels`): token (b, q) writes
    cache slot prefix_len[b] + q when q < query_len[b], sees the slots below prefix_len[b] and its
    ancestors in the window, and padding tokens write nothing and return finite values.
    """

    config: ModelConfig  # the engine reads vocab_size, max_position_embeddings, num_attention_heads
    mtp: Any  # the draft (MTP) module, or None: the model cannot draft

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: DecodeCache, vis: Visibility, *,
                 form: str = "absorbed", backend: str = "auto", window_invariant: bool = False,
                 unroll_layers: bool = False,
                 logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, DecodeCache]:
        """Target call: tokens, positions [B, Q] int32 -> logits [B, Q, V] float32, hidden [B, Q, H]
        (what `draft` reads, H = `hidden_width`), the updated cache. form: "expanded" (a prefill
        over an empty cache) or "absorbed"; window_invariant: every token's outputs equal a
        [B, 1] call's bit for bit; unroll_layers: the layers as a python loop rather than a
        scan (a family without layer stacks ignores it); logits_at: None, or [B, L] int32 window
        positions (each in [0, Q)) whose logits alone are computed and returned, [B, L, V], each
        equal to its row of the full [B, Q, V] (a prefill needs one row of a prompt's)."""

    def draft(self, next_tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache: DecodeCache,
              vis: Visibility, *, form: str = "absorbed", backend: str = "auto",
              logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, DecodeCache]:
        """Draft (MTP) call over pairs (h_i, t_{i+1}): next_tokens [B, Q], hidden [B, Q, H],
        positions [B, Q] (i) -> logits [B, Q, V] float32 for t_{i+2} ([B, L, V] at `logits_at`, as
        in the target call), its own hidden [B, Q, H] (to chain), the updated draft cache."""

    @property
    def hidden_width(self) -> int:
        """H: the width of the hidden state a target call returns and a draft call reads."""

    def init_cache(self, batch_size: int, capacity: int, *, page_size: int = 64, mtp: bool = False,
                   page_table=None, row_shards: int = 1, max_window: int | None = None,
                   lookback: int | None = None, cache_dtype: str | None = None) -> DecodeCache:
        """An empty cache for the target (mtp=True: for the draft module) of the `CacheGeometry`
        these arguments give; page_table: an optional user page layout, where the family has one;
        cache_dtype: None or "fp8" (ValueError naming it where the family or its widths cannot)."""

    def check_layout(self, *, head_split: int, page_table) -> None:
        """Raise ValueError (naming the argument) when this model cannot run with its attention
        heads split `head_split` ways, or with a user `page_table` (None: none given)."""

    def prefill_layer_bytes(self, *, rows: int, width: int, prompt_len: int, capacity: int, heads: int,
                            chunked: bool, backend: str, row_shards: int | None) -> int:
        """An estimate, erring high, of the bytes of the temporaries one decoder layer holds at once
        on a device in one prefill call: `rows` rows of `width` tokens (`prompt_len` in one call
        unless `chunked`; a decode step's calls are chunks of 1 to its window) over `capacity`
        slots, `heads` attention heads on the device, the ops' implementation `backend` ("xla",
        "pallas" or "mosaic", resolved), and `row_shards` the row shards of a mesh (None: one
        device, no mesh) (`jaxspec.memory_plan`)."""


def check_head_split(config: ModelConfig, head_split: int) -> None:
    """The check every attention makes of a head split: it must divide num_attention_heads."""
    if config.num_attention_heads % head_split:
        raise ValueError(f"the plan splits attention heads {head_split} ways; num_attention_heads="
                         f"{config.num_attention_heads} is not a multiple")


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of `tree` (real arrays or `jax.ShapeDtypeStruct`s)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def cache_bytes(model: DecoderModel, geometry: CacheGeometry, *, mtp: bool = False) -> int:
    """Bytes of the cache `model.init_cache` builds for `geometry` (traced abstractly, nothing
    allocated): what the memory plan counts for it."""
    return tree_bytes(jax.eval_shape(lambda: model.init_cache(geometry.batch_size, geometry.capacity, mtp=mtp,
                                                              **geometry.kwargs())))
