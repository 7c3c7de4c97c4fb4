"""MLA, DSA-indexer, sparse-MLA and DeepSeek-V4 sliding + compressed attention ops over the paged cache,
the MoE's grouped matmul and DeepSeek-V4's Sinkhorn normalization: pure-jnp references and Pallas
kernels.

Every op takes `backend="xla" | "pallas" | "auto"`; the reference is the op's definition. This
package imports only jax.
"""

from .backend import resolve_backend
from .contracts import EMPTY_LSE, select_topk
from .grouped_matmul import grouped_matmul, grouped_matmul_backend, grouped_matmul_reference
from .indexer import indexer_scores, indexer_scores_reference, indexer_topk, indexer_topk_reference
from .mla_attention import attend_latent, mla_attention, mla_attention_reference
from .paged import gather_rows, read_slots, slot_address, write_slots
from .sinkhorn import sinkhorn, sinkhorn_reference
from .sliding_compressed_attention import sliding_compressed_attention, sliding_compressed_attention_reference
from .sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_reference
from .visibility import Visibility, kv_bound, query_valid, visible_mask, window_slots

__all__ = [
    "EMPTY_LSE", "Visibility", "attend_latent", "gather_rows", "grouped_matmul", "grouped_matmul_backend",
    "grouped_matmul_reference", "indexer_scores", "indexer_scores_reference", "indexer_topk",
    "indexer_topk_reference", "kv_bound",
    "mla_attention", "mla_attention_reference", "query_valid",
    "read_slots", "resolve_backend", "select_topk", "sinkhorn", "sinkhorn_reference", "sliding_compressed_attention",
    "sliding_compressed_attention_reference", "slot_address", "sparse_mla_attention",
    "sparse_mla_attention_reference", "visible_mask", "window_slots", "write_slots",
]
