"""DeepSeek-V4's decoder as scans over its repeating layer pattern (`models.deepseek_v4.layer_runs`,
`models.stack.repeating_runs`): how the layer lists segment (V4-Flash, V4-Pro, tiny-v4, hand-made
lists), `layer(i)` as the i-th layer's rows of the stacks, the scanned decoder equal to the unrolled
one bit for bit (logits, hidden states and every cache pool), and a save from before the layers
were stacked (the shipped tiny-v4 fixture) restoring each layer into its row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxspec.model_config import CSA, HCA, SLIDING
from jaxspec.models import DeepseekV4
from jaxspec.models.deepseek_v4 import layer_runs
from jaxspec.models.stack import LayerRun, repeating_runs
from jaxspec.orbax_io import PARAMS_DIR
from jaxspec.pallas_kernels import Visibility
from jaxspec.presets import preset
from layer_names import unstacked
from trained_models import FIXTURES

# Six layers: a sliding + CSA unit once (hash-routed), then HCA + CSA twice (a scan of two steps).
SIX = dict(num_hidden_layers=6, layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA),
           mlp_layer_types=("hash_moe",) * 2 + ("moe",) * 4)


@pytest.fixture(scope="module")
def six_layers() -> DeepseekV4:
    return DeepseekV4(preset("tiny-v4", **SIX), rngs=nnx.Rngs(0))


def runs(config) -> list[tuple[int, int, int]]:
    return [(run.start, run.period, run.repeats) for run in layer_runs(config)]


def test_flash_pro_and_tiny_segment_into_the_fewest_runs():
    """V4-Flash (S, S, C, H, C, ..., C; three hash layers) and V4-Pro (H, H, C, H, ..., C) take
    three scans each, the alternating body one scan of [H, C] units; tiny-v4 (S, C, H, C with hash
    on the first two) two units of two."""
    assert runs(preset("deepseek-v4-flash")) == [(0, 1, 2), (2, 1, 1), (3, 2, 20)]
    assert runs(preset("deepseek-v4-pro")) == [(0, 1, 2), (2, 1, 1), (3, 2, 29)]
    assert runs(preset("tiny-v4")) == [(0, 2, 1), (2, 2, 1)]
    assert layer_runs(preset("tiny-v4", **SIX)) == (LayerRun("layer_groups.0", 0, 2, 1),
                                                    LayerRun("layer_groups.1", 2, 2, 2))


@pytest.mark.parametrize("units, want", [
    ("", ()),
    ("a", ((0, 1, 1),)),
    ("aaab", ((0, 1, 3), (3, 1, 1))),
    ("abababa", ((0, 2, 3), (6, 1, 1))),
    ("aababab", ((0, 1, 1), (1, 2, 3))),       # not the longest run first: [a, a] x 1 would cost 3 runs
    ("abcabc", ((0, 2, 1), (2, 2, 1), (4, 2, 1))),  # a period of 3 is not looked for
    ("abba", ((0, 2, 1), (2, 2, 1))),           # ties: the longer first run, then the shorter unit
])
def test_repeating_runs_on_hand_made_lists(units, want):
    got = repeating_runs(list(units))
    assert got == want
    covered = [layer for start, period, repeats in got for layer in range(start, start + period * repeats)]
    assert covered == list(range(len(units)))  # in order, each layer once
    for start, period, repeats in got:  # every repeat of a unit is the same kinds
        assert all(units[start + r * period:start + (r + 1) * period] == units[start:start + period]
                   for r in range(repeats))


def test_layer_i_is_its_rows_of_the_stacks(six_layers):
    model = six_layers
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    per_layer = unstacked(params, model.config)
    for i in range(6):
        layer = model.layer(i)
        assert layer.self_attn.kind == model.config.layer_types[i]
        assert (layer.mlp.tid2eid is not None) == model.config.is_hash_layer(i)
        for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
            want = per_layer[f"layers.{i}." + ".".join(map(str, path))]
            np.testing.assert_array_equal(np.asarray(variable.get_value()), np.asarray(want))
    with pytest.raises(ValueError, match=r"index=6: must be in \[0, num_hidden_layers=6\)"):
        model.layer(6)


def test_scanned_equals_unrolled_bit_for_bit(six_layers):
    """A prefill of two rows (one padded) then a three-token chain call over the cache it wrote:
    the scans and the unrolled layers give the same logits, hidden states and cache pools, bit for
    bit, on six layers (the second stack a scan of two steps) with random weights."""
    model = six_layers
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 19), 0, model.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(19, dtype=jnp.int32), (2, 19))
    cache = model.init_cache(2, 64, page_size=8, max_window=16)

    def run(params, cache, unroll):
        model = nnx.merge(graphdef, params)
        prefill = Visibility(prefix_len=jnp.zeros(2, jnp.int32), query_len=jnp.array([16, 11], jnp.int32))
        first = model(tokens[:, :16], positions[:, :16], cache, prefill, backend="xla", unroll_layers=unroll)
        step = Visibility(prefix_len=jnp.array([16, 11], jnp.int32), query_len=jnp.array([3, 3], jnp.int32))
        second = model(tokens[:, 16:], positions[:, :3] + step.prefix_len[:, None], first[2], step, backend="xla",
                       unroll_layers=unroll)
        return first[:2], second

    scanned = jax.jit(run, static_argnums=2)(params, cache, False)
    unrolled = jax.jit(run, static_argnums=2)(params, cache, True)
    assert np.isfinite(np.asarray(scanned[1][0])).all()
    assert jax.tree.structure(scanned) == jax.tree.structure(unrolled)
    for got, want in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(scanned[1][2].hca_entries).any()  # the second stack's layers wrote their pools


def test_a_save_from_before_stacking_restores_each_layer_into_its_row(trained_v4):
    """The shipped tiny-v4 fixture holds one array per layer (`layers.{i}.<path>`); restored, each
    is layer i's row of its stack, bit for bit."""
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.restore(FIXTURES / "tiny-v4" / PARAMS_DIR)
    assert any(name.startswith("layers.3.") for name in saved)
    restored = unstacked({".".join(map(str, p)): v.get_value()
                          for p, v in nnx.to_flat_state(nnx.state(trained_v4, nnx.Param))}, trained_v4.config)
    assert sorted(restored) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value).astype(restored[name].dtype),
                                      err_msg=name)


def test_sinkhorn_rounds_are_a_loop_on_the_cpu_and_straight_line_on_a_gpu(h100):
    """mHC's Sinkhorn rounds (19 at V4's 20 iterations): on the CPU one loop (there it compiles
    faster and saves no launch); compiled for sm_90a without a GPU, no loop, so that a decode step
    does not run 19 loop trips of one-thread kernels, each read by the host, at every mHC site."""
    from jaxspec import aot
    from jaxspec.aot.hlo_loops import parse_module
    from jaxspec.pallas_kernels import sinkhorn

    comb = jax.ShapeDtypeStruct((2, 3, 4, 4), jnp.float32)
    rounds = lambda c: sinkhorn(c, 20, 1e-6)  # noqa: E731
    assert [loop.trip_count for loop in parse_module(jax.jit(rounds).lower(comb).compile().as_text()).loops] == [19]
    assert parse_module(aot.compile_gpu(rounds, comb, devices=h100).as_text()).loops == []
