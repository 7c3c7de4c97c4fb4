"""The engine drives any `jaxspec.models.interface.DecoderModel`, and the package's imports form no cycle.

A third, toy family (a bigram-plus-previous-token model whose cache holds each slot's token) runs
through `generate` unchanged: its greedy speculative output equals its plain greedy output and a
numpy reference of its greedy decoding, chains and trees alike. The engine's modules never ask
which family they run (no `is_v4`, no V4 names), read from their syntax trees.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.model_config import CSA
from jaxspec.models import DeepseekV3, DeepseekV4, model_class
from jaxspec.models.interface import DecodeCache, DecoderModel, window_rows
from jaxspec.pallas_kernels import Visibility
from jaxspec.presets import preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Package name -> folder (models/ and pallas_kernels/ install under jaxspec, pyproject.toml).
PACKAGES = {"jaxspec": "jaxspec", "jaxspec.models": "models", "jaxspec.pallas_kernels": "pallas_kernels"}
ENGINE = ["jaxspec/batch.py", "jaxspec/generation.py", "jaxspec/loop.py", "jaxspec/memory_plan.py",
          "jaxspec/drafting.py", *(f"jaxspec/aot/{f}" for f in sorted(os.listdir(os.path.join(REPO, "jaxspec/aot")))
                                   if f.endswith(".py"))]


def package_modules() -> dict[str, str]:
    """Every module of the installed package: dotted name -> file."""
    modules = {}
    for package, folder in PACKAGES.items():
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(root, name), os.path.join(REPO, folder))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join([package, *parts])] = os.path.join(root, name)
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (at the top or inside a function). `from P import
    name` imports P.name when that is a module, else P. A module's own enclosing packages are left
    out: Python has begun importing them before the module (the standard package pattern)."""
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        graph[module] = {t for t in targets if t in modules and t != module and t not in ancestors}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert graph["jaxspec.loop"] >= {"jaxspec.batch"} and "jaxspec.generation" not in graph["jaxspec.loop"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", ENGINE)
def test_the_engine_does_not_ask_the_family(path):
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    family = {"is_v4", "is_v32", "DeepseekV3", "DeepseekV4", "V4Cache", "PagedCache", "jaxspec.cache_v4"}
    names = ({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
             | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
             | {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
             | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)})
    assert not names & family, f"{path} names {sorted(names & family)}"


# -- a third family: the toy -------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyCache:
    """tokens [B, capacity] int32: the token written at each slot; lengths [B]; no pages."""

    tokens: jax.Array
    lengths: jax.Array
    page_table: None = None

    @property
    def page_size(self) -> int:
        return 1

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def replace(self, **changes) -> "ToyCache":
        return dataclasses.replace(self, **changes)

    def commit(self, lengths):
        return self.replace(lengths=lengths)

    def move(self, src_slots, dst_slots):
        rows = jnp.arange(self.batch_size)[:, None]
        values = jnp.take_along_axis(self.tokens, jnp.maximum(src_slots, 0), axis=1)
        dst = jnp.where(src_slots >= 0, dst_slots, self.tokens.shape[1])
        return self.replace(tokens=self.tokens.at[rows, dst].set(values, mode="drop"))

    def partition_specs(self, rows):
        return jax.tree.map(lambda _: rows, self)


class ToyModel(nnx.Module):
    """logits(t_q) = bigram[t_q] + previous[t_{q-1}], t_{q-1} being the parent in the window or,
    for the window's first token, the last committed token, read from the cache. The draft guesses
    bigram[t] + its hidden state (the embedding of t) times a small matrix."""

    def __init__(self, seed: int = 0):
        self.config = preset("tiny").replace(vocab_size=32, eos_token_id=None)  # the byte EOS (257) is past 32
        keys = jax.random.split(jax.random.key(seed), 4)
        vocab, dim = self.config.vocab_size, 8
        self.bigram = nnx.Param(jax.random.normal(keys[0], (vocab, vocab)))
        self.previous = nnx.Param(0.5 * jax.random.normal(keys[1], (vocab, vocab)))
        self.embed = nnx.Param(jax.random.normal(keys[2], (vocab, dim)))
        self.mtp = nnx.Param(0.1 * jax.random.normal(keys[3], (dim, vocab)))

    hidden_width = 8

    def init_cache(self, batch_size, capacity, *, page_size=64, mtp=False, page_table=None, row_shards=1,
                   max_window=None, lookback=None, cache_dtype=None):
        if cache_dtype is not None:
            raise ValueError(f"cache_dtype={cache_dtype!r}: the toy stores tokens, not activations")
        return ToyCache(jnp.zeros((batch_size, capacity), jnp.int32), jnp.zeros((batch_size,), jnp.int32))

    def check_layout(self, *, head_split, page_table):
        if page_table is not None:
            raise ValueError("page_table: the toy has no pages")

    def prefill_layer_bytes(self, *, rows, width, prompt_len, capacity, heads, chunked, backend, row_shards):
        return 0

    @staticmethod
    def _write(cache, tokens, vis):
        q = jnp.arange(tokens.shape[1])[None, :]
        slots = jnp.where(q < vis.query_len[:, None], vis.prefix_len[:, None] + q, cache.tokens.shape[1])
        rows = jnp.arange(tokens.shape[0])[:, None]
        return cache.replace(tokens=cache.tokens.at[rows, slots].set(tokens, mode="drop"))

    def __call__(self, tokens, positions, cache, vis, *, form="absorbed", backend="auto", window_invariant=False,
                 unroll_layers=False, logits_at=None):
        batch, width = tokens.shape
        q = jnp.arange(width)
        if vis.tree_mask is None:
            parent = jnp.broadcast_to(q - 1, (batch, width))
        else:  # the nearest ancestor: the largest window index below q the token sees
            parent = jnp.max(jnp.where(vis.tree_mask & (q[None, None, :] < q[None, :, None]), q, -1), axis=-1)
        committed = jnp.take_along_axis(cache.tokens, jnp.maximum(vis.prefix_len - 1, 0)[:, None], axis=1)
        previous = jnp.where(parent >= 0, jnp.take_along_axis(tokens, jnp.maximum(parent, 0), axis=1), committed)
        logits = self.bigram[...][tokens] + self.previous[...][previous]
        return window_rows(logits, logits_at), self.embed[...][tokens], self._write(cache, tokens, vis)

    def draft(self, next_tokens, hidden, positions, cache, vis, *, form="absorbed", backend="auto", logits_at=None):
        logits = self.bigram[...][next_tokens] + hidden @ self.mtp[...]
        return window_rows(logits, logits_at), self.embed[...][next_tokens], self._write(cache, next_tokens, vis)


def toy_greedy(model: ToyModel, prompt: list[int], steps: int) -> list[int]:
    """The toy's greedy continuation, in numpy."""
    bigram, previous = np.asarray(model.bigram[...]), np.asarray(model.previous[...])
    sequence = list(prompt)
    for _ in range(steps):
        prev = sequence[-2] if len(sequence) > 1 else 0
        sequence.append(int(np.argmax(bigram[sequence[-1]] + previous[prev])))
    return sequence[len(prompt):]


def test_the_model_families_implement_the_interface():
    for model in (DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0)), DeepseekV4(preset("tiny-v4"), rngs=nnx.Rngs(0)),
                  ToyModel()):
        assert isinstance(model, DecoderModel)
        assert isinstance(model.init_cache(2, 16, page_size=8, max_window=4), DecodeCache)


@pytest.mark.parametrize("draft", [dict(num_draft=3), dict(tree="small"), dict(tree="3,3,6")])
def test_a_third_family_runs_through_the_engine(draft):
    model = ToyModel()
    prompts = [[1, 2, 3, 4, 5], [7, 8], [30]]
    plain = generate(model, prompts, DecodeConfig(num_draft=0, max_new_tokens=12))
    spec = generate(model, prompts, DecodeConfig(max_new_tokens=12, **draft))
    for row, prompt in enumerate(prompts):
        assert plain.row_tokens(row) == toy_greedy(model, prompt, 12)
        assert spec.row_tokens(row) == plain.row_tokens(row)
    assert 0 < int(np.sum(spec.accepted)) and spec.steps < plain.steps  # drafts were accepted, and some rejected
    assert int(np.sum(spec.accepted)) < int(np.sum(spec.target_calls)) * 3


def test_check_layout_names_what_does_not_split():
    """Each family says before tracing which of its widths a head split must divide."""
    v3 = nnx.eval_shape(lambda: DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0)))
    v4 = nnx.eval_shape(lambda: DeepseekV4(preset("tiny-v4"), rngs=nnx.Rngs(0)))
    heads, groups = v4.config.num_attention_heads, v4.config.o_groups
    v3.check_layout(head_split=v3.config.num_attention_heads, page_table=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=f"num_attention_heads={v3.config.num_attention_heads} is not a multiple"):
        v3.check_layout(head_split=v3.config.num_attention_heads + 1, page_table=None)
    v4.check_layout(head_split=groups, page_table=None)
    with pytest.raises(ValueError, match=f"o_groups={groups} must be a multiple of {heads}"):
        v4.check_layout(head_split=heads, page_table=None)
    with pytest.raises(ValueError, match="page_table: a DeepSeek-V4 model's caches"):
        v4.check_layout(head_split=1, page_table=jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
@pytest.mark.parametrize("window_invariant", [False, True])
def test_logits_at_returns_those_rows_of_the_full_logits(name, window_invariant):
    """A family's target and draft calls with `logits_at` [B, L] (out of order, repeated) return
    those rows of the full window's logits, and the same hidden states and caches bit for bit;
    window-invariant target logits are the same bits (each row is a [B, 1] product either way).
    V4 runs one CSA layer (its indexer included): it selects the rows only at its heads, after
    every layer, so further layers would run the same code with and without `logits_at`."""
    config = preset(name) if name == "tiny" else preset(name, num_hidden_layers=1, layer_types=(CSA,),
                                                        mlp_layer_types=("hash_moe",))
    model = model_class(config)(config, rngs=nnx.Rngs(0))
    batch, width = 2, 5
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (batch, width)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.asarray([width, 3], jnp.int32))
    at = jnp.asarray([[4, 0, 4], [2, 1, 0]], jnp.int32)

    @jax.jit
    def calls(params, at):
        model_ = nnx.merge(graphdef, params)
        logits, hidden, cache = model_(tokens, positions, model_.init_cache(batch, 16, page_size=8), vis,
                                       form="absorbed", backend="xla", window_invariant=window_invariant,
                                       logits_at=at)
        mtp_cache = model_.init_cache(batch, 16, page_size=8, mtp=True)
        draft_logits, draft_hidden, mtp_cache = model_.draft(tokens, hidden, positions, mtp_cache, vis,
                                                             backend="xla", logits_at=at)
        return (logits, draft_logits), (hidden, cache, draft_hidden, mtp_cache)

    graphdef, params = nnx.split(model)
    (logits, draft_logits), rest = calls(params, at)
    (full, full_draft), full_rest = calls(params, None)
    assert logits.shape == draft_logits.shape == (batch, 3, model.config.vocab_size)
    for mine, whole in zip(jax.tree.leaves(rest), jax.tree.leaves(full_rest)):
        np.testing.assert_array_equal(mine, whole)
    rows = jnp.take_along_axis(full, at[..., None], axis=1)
    draft_rows = jnp.take_along_axis(full_draft, at[..., None], axis=1)
    if window_invariant:
        np.testing.assert_array_equal(logits, rows)
    np.testing.assert_allclose(logits, rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(draft_logits, draft_rows, rtol=1e-5, atol=1e-5)
