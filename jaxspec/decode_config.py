"""`DecodeConfig`: what the decoding loop needs and the model does not (draft length or tree,
sampling and acceptance rule, token budget, cache geometry, kernel backend)."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

from jaxspec.pallas_kernels.backend import BACKENDS
from jaxspec.pallas_kernels.fp8_cache import CACHE_DTYPES
from jaxspec.trees import DynamicTreeSpec, StaticTree, chain_tree, parse_tree

MAX_DRAFT_TOKENS = 7
# Fields normalized to Python numbers before any check (`DecodeConfig._normalize_numbers`).
INTEGER_FIELDS = ("num_draft", "max_new_tokens", "page_size", "top_k")
# Fields that may be None, with what the error says they take.
OPTIONAL_INTEGER_FIELDS = {"eos_token_id": "None or a token id >= 0", "max_cache_len": "None or an integer >= 1",
                           "prefill_chunk": "None (one call) or an integer >= 1 (tokens per prefill call)"}
REAL_FIELDS = ("temperature", "top_p")


def _integer(name: str, value, takes: str = "an integer") -> int:
    """`value` as a Python int: an int, a numpy integer or a concrete 0-d integer array; anything
    else (a float, a string, a bool) is a ValueError naming the field and what it `takes`."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"DecodeConfig.{name}={value!r}: must be {takes}")


def _real(name: str, value) -> float:
    """`value` as a Python float: any real number (a string or a bool is a ValueError)."""
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"DecodeConfig.{name}={value!r}: must be a number")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What the decoding loop needs beyond the model. Every field is static (part of the compiled
    computation) except the values of temperature, top_k and top_p: the programs read those at
    run time (`program_config`), so changing them with temperature > 0 reuses the compiled
    program; the sampling seed is not a field but an argument of `generate`.

    num_draft: k, draft tokens per speculative step when `tree` is None (0 = plain decoding, the
      baseline; 1..MAX_DRAFT_TOKENS chains the one MTP layer). With a tree it must be >= 1 and is
      otherwise unused: the tree decides the drafts.
    tree: None (a chain of num_draft), a `StaticTree`, a `DynamicTreeSpec` (EAGLE-2), or a string
      for either (`jaxspec.trees.parse_tree`: a name in STATIC_TREES, or "top_k,depth,budget");
      stored parsed.
    temperature: 0 = greedy (lossless against plain greedy decoding); > 0 samples, and lossless
      rejection sampling makes the output distributed as the target's processed distribution.
    top_k / top_p: sampling filters (0 / 1.0 = off); they need temperature > 0.
    relaxed: None, or (top_k, delta) for relaxed acceptance: a draft among the target's top_k and
      within delta of its top-1 probability is accepted. LOSSY: the output is no longer the
      target's greedy output. Needs temperature 0 and drafts.
    max_new_tokens: per-row budget of generated tokens (the first token after the prompt counts);
      the program reads it at run time and is built for its bucket (`buckets`).
    eos_token_id: a row stops after emitting it (an id in [0, vocab_size), checked against the
      model by `generate`); None = only the budget stops rows.
    page_size: cache slots per page.
    max_cache_len: slots per row; None sizes the cache to the prompts and the budget.
    backend: kernel implementation, "xla" (pure-jnp references), "pallas" (Triton kernels),
      "mosaic" (Mosaic GPU kernels where an op has one, its Triton kernel elsewhere), or "auto"
      (`jaxspec.pallas_kernels.backend`).
    window_invariant: compute every token of a verification window as if it were alone in a
      plain [B, 1] decode step (`jaxspec.models.layers.per_position`: the window's positions run
      one after another through the token-local ops, and attention reads each token's entries in
      plain decoding's order with the pure-jnp reference ops; on the "mosaic" backend, with the
      Mosaic GPU attention kernels, which are window-invariant by construction: docs/kernels.md). Then
      greedy speculative decoding emits exactly the tokens of plain greedy decoding with the same
      flag, batch and prompts, for every k and tree, in bfloat16 as in float32: guaranteed on
      XLA's CPU backend (tests/test_exactness.py). Without it the guarantee holds only up to
      rounding: a window computes its tokens with matmul and reduction algorithms chosen for
      k + 1 rows, so in bfloat16 a near-tie between two logits can resolve differently. Off by
      default: it costs speed (`benchmarks/heldout.py --window-invariant` measures both). On a
      GPU no test pins it; it reads the weights once per window position there, so it forfeits
      most of verification's saving.
      DeepSeek-V4 trees run each node as a one-token chain call (`models/v4_attention.py`); V4's
      attention reduces over its whole ring, so a plain and a speculative run compare bit for
      bit when their rings have one size (the prompt at least as wide as the window).
      With `prefill_chunk` set it covers the target's prefill chunks too (the one-call prefill
      and the MTP's calls are not window-invariant): its caches and the first token are then the
      same, bit for bit, for every chunk size, on caches of one geometry (V4's attention reduces
      over its whole ring, which `generate` sizes by the widest call, so by the chunk).
    cache_dtype: None (default) stores the caches in the model's compute dtype; "fp8" stores them as
      DeepSeek serves V3.2: each MLA latent in FlashMLA's FP8 token (656 bytes at DeepSeek's
      widths), the DSA indexer keys Hadamard-rotated in e4m3 with per-128 scales (powers of two
      where the model's `scale_fmt` says "ue8m0"), and the indexer scores from FP8 queries and keys
      (docs/fp8-caches.md). Quantization is per token, so the exactness guarantees above hold
      unchanged. Every backend reads them, and DeepSeek-V4 models store their window and compressed
      entries in FlashMLA's V4 token (docs/fp8-caches.md).
    prefill_chunk: None (default) runs the whole padded prompt [B, P] through the target and the
      MTP module in one call each. C >= 1 runs it in ceil(P / C) calls of min(C, P) tokens inside
      one `jax.lax.fori_loop` (`jaxspec.loop.prefill`), so the prefill's activations and
      DeepSeek-V4's rings (`jaxspec.cache_v4`, sized by the widest call) follow C instead of P.
      Any C works: a chunk may end anywhere in a page or a compression block, as a verification
      window does (each call re-closes the blocks that ended before it from the projection
      rings). Greedy output equals the one-call prefill's up to rounding (token for token on the
      tests' models); the chunks use the cached ("absorbed") attention form.
    prefill_in_loop: run the prompts through the decoding loop's own calls instead of a prefill
      program: each loop iteration feeds a row still in its prompt the next D + 1 prompt tokens
      (`max_depth` + 1, the MTP catch-up's width; 1 for plain decoding) through the step's target
      call and catch-up MTP call, while the rows past their prompts decode in the same call
      (`jaxspec.loop`). The compiled program then holds no prefill calls (about 40% of a small
      model's compile time on the CPU) and the prompt width only sizes an input, at the cost of
      ceil(P / (D + 1)) loop iterations for a P-token prompt: for short prompts (a notebook, the
      main job), not for long ones. The tokens emitted equal a prefill program's up to rounding;
      with `window_invariant` the target's caches and greedy tokens equal those of chunks of
      D + 1 bit for bit, and so do plain sampling's (a row's draws use its own step count, so the
      same keys; speculative sampling's depend on the drafts too, and the MTP's calls are not
      window-invariant).
    unroll_layers: run the target's decoder layers as a python loop (one copy of a layer per
      layer in the compiled program) instead of one `jax.lax.scan` per stack of identical layers
      (`jaxspec.models.stack`). The same parameters and the same tokens; the scan compiles in a
      time that barely depends on depth, the unrolled program in one that grows with it. A switch
      for debugging and per-layer inspection of the compiled program.
    buckets: pad the shapes a run compiles for up to buckets, so that runs of similar sizes share
      one compiled program: a notebook's next prompt or budget runs without compiling. The
      prompts' width P (the longest prompt) goes up to a power of two (at least 16; past 1024 a
      multiple of 1024: `jaxspec.batch.prompt_bucket`), and the token budget the program is built
      for, its output buffer and the cache's room for it, by the same rule
      (`jaxspec.batch.budget_bucket`); each row still stops at `max_new_tokens`, a value the
      program reads at run time. The padding is masked out as a shorter row's is in any batch; a
      prefill call also computes the padded positions, and the cache holds them (at most twice
      the prompt and the budget, and fewer than 1024 more of each past 1024). Off, or where a
      bucket would not fit the positions, `max_cache_len` or a given page table: exactly P and
      `max_new_tokens`. Prompts traced inside a user's `jax.jit` keep their width.
    """

    num_draft: int = 3
    max_new_tokens: int = 64
    eos_token_id: int | None = None
    page_size: int = 64
    max_cache_len: int | None = None
    backend: str = "auto"
    tree: StaticTree | DynamicTreeSpec | str | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    relaxed: tuple[int, float] | None = None
    window_invariant: bool = False
    prefill_chunk: int | None = None
    prefill_in_loop: bool = False
    unroll_layers: bool = False
    cache_dtype: str | None = None
    buckets: bool = True

    def __post_init__(self):
        self._normalize_numbers()
        if not 0 <= self.num_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"DecodeConfig.num_draft={self.num_draft}: must be in [0, {MAX_DRAFT_TOKENS}]")
        if self.max_new_tokens < 1:
            raise ValueError(f"DecodeConfig.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"DecodeConfig.page_size={self.page_size}: must be >= 1")
        if self.max_cache_len is not None and self.max_cache_len < 1:
            raise ValueError(f"DecodeConfig.max_cache_len={self.max_cache_len}: must be >= 1 or None")
        if self.eos_token_id is not None and self.eos_token_id < 0:
            raise ValueError(f"DecodeConfig.eos_token_id={self.eos_token_id}: must be a token id >= 0 or None")
        if self.backend not in BACKENDS:
            raise ValueError(f"DecodeConfig.backend={self.backend!r}: must be one of {BACKENDS}")
        if not isinstance(self.window_invariant, bool):
            raise ValueError(f"DecodeConfig.window_invariant={self.window_invariant!r}: must be True or False")
        if not isinstance(self.unroll_layers, bool):
            raise ValueError(f"DecodeConfig.unroll_layers={self.unroll_layers!r}: must be True or False")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"DecodeConfig.prefill_chunk={self.prefill_chunk!r}: must be None (one call) or an "
                             "integer >= 1 (tokens per prefill call)")
        if not isinstance(self.buckets, bool):
            raise ValueError(f"DecodeConfig.buckets={self.buckets!r}: must be True or False")
        if not isinstance(self.prefill_in_loop, bool):
            raise ValueError(f"DecodeConfig.prefill_in_loop={self.prefill_in_loop!r}: must be True or False")
        if self.prefill_in_loop and self.prefill_chunk is not None:
            raise ValueError(f"DecodeConfig.prefill_in_loop=True runs the prompts through the loop's own calls, "
                             f"but prefill_chunk={self.prefill_chunk} asks for a prefill program in chunks; "
                             "set one of them")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"DecodeConfig.cache_dtype={self.cache_dtype!r}: must be one of {CACHE_DTYPES} "
                             "(None: the model's compute dtype)")
        self._check_tree()
        self._check_sampling()

    def _normalize_numbers(self):
        """Numeric fields as Python numbers, whatever integer or real type was passed (a numpy
        integer, a 0-d array): a config is a static argument of the compiled programs, hashed and
        compared, and the shape arithmetic (`jaxspec.batch`) needs ints."""
        for name in INTEGER_FIELDS:
            object.__setattr__(self, name, _integer(name, getattr(self, name)))
        for name, takes in OPTIONAL_INTEGER_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _integer(name, getattr(self, name), takes))
        for name in REAL_FIELDS:
            object.__setattr__(self, name, _real(name, getattr(self, name)))

    def _check_tree(self):
        if isinstance(self.tree, str):
            object.__setattr__(self, "tree", parse_tree(self.tree))
        if self.tree is None:
            return
        if not isinstance(self.tree, (StaticTree, DynamicTreeSpec)):
            raise ValueError(f"DecodeConfig.tree={self.tree!r}: must be None, a StaticTree, a DynamicTreeSpec "
                             "or a string for one")
        if self.num_draft == 0:
            raise ValueError("DecodeConfig.num_draft=0 means plain decoding, but a tree is given; "
                             "use num_draft >= 1 (the tree decides the drafts)")

    def _check_sampling(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"DecodeConfig.temperature={self.temperature}: must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"DecodeConfig.top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"DecodeConfig.top_p={self.top_p}: must be in (0, 1] (1 = off)")
        for name, value, off in (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0)):
            if self.temperature == 0 and value != off:
                raise ValueError(f"DecodeConfig.{name}={value} filters sampling, but temperature=0 is greedy; "
                                 f"set temperature > 0 or leave {name} at {off}")
        if self.relaxed is None:
            return
        if not isinstance(self.relaxed, (tuple, list)) or len(self.relaxed) != 2:
            raise ValueError(f"DecodeConfig.relaxed={self.relaxed!r}: must be None or (top_k, delta)")
        top_k, delta = _integer("relaxed top_k", self.relaxed[0]), _real("relaxed delta", self.relaxed[1])
        if top_k < 1:
            raise ValueError(f"DecodeConfig.relaxed top_k={top_k}: must be an integer >= 1")
        if not 0 <= delta <= 1:
            raise ValueError(f"DecodeConfig.relaxed delta={delta}: must be in [0, 1] (a probability gap)")
        if self.temperature > 0:
            raise ValueError(f"DecodeConfig.relaxed={self.relaxed!r} is a lossy variant of greedy acceptance; "
                             f"it needs temperature=0, got {self.temperature}")
        if self.num_draft == 0:
            raise ValueError("DecodeConfig.relaxed needs drafts to accept; num_draft=0 is plain decoding")
        object.__setattr__(self, "relaxed", (top_k, delta))  # hashable, whatever was passed

    @functools.cached_property
    def draft_tree(self) -> StaticTree | DynamicTreeSpec | None:
        """The tree drafted each step: `tree`, else the chain of num_draft drafts; None for plain decoding."""
        if self.tree is not None:
            return self.tree
        return chain_tree(self.num_draft) if self.num_draft else None

    @property
    def window_size(self) -> int:
        """N: tokens per verification window (the root plus the drafts)."""
        return 1 if self.draft_tree is None else self.draft_tree.num_nodes

    def prefill_width(self, prompt_width: int) -> int:
        """Tokens per prefill call for a [B, prompt_width] prompt: all of them, the chunk, or in the
        loop D + 1 (each at most the prompt: a longer chunk would only add padding)."""
        if self.prefill_in_loop:
            return min(self.max_depth + 1, prompt_width)
        return prompt_width if self.prefill_chunk is None else min(self.prefill_chunk, prompt_width)

    @property
    def max_depth(self) -> int:
        """D: the most drafts one step can accept (the depth of the tree)."""
        return 0 if self.draft_tree is None else self.draft_tree.max_depth

    def program_config(self, max_new_tokens: int | None = None) -> "DecodeConfig":
        """This config as the jitted programs take it (their static argument), with the values a
        program reads at run time (`jaxspec.loop.row_sampling`) normalized, so that configs
        differing only in them share one compiled program:

        - max_new_tokens: the budget the program is built for (its token buffer; default this
          config's): `generate` passes its batch's bucket (`DecodeConfig.buckets`), `step` the
          budget of the state's buffer. The loop stops each row at the row's own budget, a
          runtime value.
        - temperature, top_k and top_p: placeholders (1, off, off) when sampling. Whether a run
          samples (temperature > 0) stays static: greedy and sampled runs are different
          programs. Inside a program only `temperature > 0` may be read from the config.
        """
        program = self if max_new_tokens is None else self.replace(max_new_tokens=max_new_tokens)
        if self.temperature == 0:
            return program
        return program.replace(temperature=1.0, top_k=0, top_p=1.0)

    def replace(self, **changes) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)
