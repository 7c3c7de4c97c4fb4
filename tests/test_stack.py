"""`jaxspec.models.stack`: decoder layers stacked [n, ...] and run as scans.

The scanned model is the unrolled one (the same parameters, bit for bit the same logits, hidden
states and caches), a layer's parameters are its rows of the stacks, and the ops that read a
stacked weight in place (`grouped_matmul(rhs_row=)`) compute what they compute on the row itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models import DeepseekV3, layer_runs
from jaxspec.models.stack import LayerRun, StackRow, in_place, layer_slice, run_layers, stack_layers
from jaxspec.pallas_kernels import Visibility, grouped_matmul
from jaxspec.presets import preset


def test_layer_runs_of_v3_split_dense_and_moe():
    config = preset("deepseek-v3.2")
    assert layer_runs(config) == (LayerRun("dense_layers", 0, 1, 3), LayerRun("moe_layers", 3, 1, 58))
    assert layer_runs(config.replace(first_k_dense_replace=0)) == (LayerRun("moe_layers", 0, 1, 61),)
    assert LayerRun("moe_layers", 3, 1, 58).locate(10) == ("moe_layers.", 7)
    assert LayerRun("pairs", 2, 2, 3).locate(5) == ("pairs.1.", 1)
    with pytest.raises(ValueError, match=r"layer=8: run 'pairs' holds layers \[2, 8\)"):
        LayerRun("pairs", 2, 2, 3).locate(8)


def test_stack_rows_are_the_layers():
    """A stack of modules drawn from split keys: each row is a module of its own (different draws),
    and `layer(i)` reads layer i's rows of the stacks it belongs to."""
    model = DeepseekV3(preset("tiny-v3").replace(num_hidden_layers=3), rngs=nnx.Rngs(0))
    rows = [model.layer(i).self_attn.o_proj.weight[...] for i in (1, 2)]
    assert not np.array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[1], model.moe_layers.self_attn.o_proj.weight[...][1])
    np.testing.assert_array_equal(model.layer(0).mlp.up_proj.weight[...], model.dense_layers.mlp.up_proj.weight[...][0])
    with pytest.raises(ValueError, match=r"index=3: must be in \[0, num_hidden_layers=3\)"):
        model.layer(3)


@pytest.mark.parametrize("name", ["tiny", "tiny-v3"])
def test_scanned_equals_unrolled_bit_for_bit(name):
    """A prefill and a chain window through the scans and through the unrolled loop: the same
    logits, hidden states and caches, bit for bit (the same parameters and ops, only the program
    differs)."""
    config = preset(name).replace(num_hidden_layers=4)
    model = DeepseekV3(config, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 12)), jnp.int32)

    @nnx.jit(static_argnames=("unroll",))
    def run(model, tokens, unroll):
        cache = model.init_cache(2, 32, page_size=8)
        positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
        prompt = Visibility(jnp.zeros((2,), jnp.int32), jnp.asarray([8, 6], jnp.int32))
        _, _, cache = model(tokens[:, :8], positions[:, :8], cache, prompt, form="expanded", backend="xla",
                            unroll_layers=unroll)
        window = Visibility(jnp.asarray([8, 6], jnp.int32), jnp.full((2,), 4, jnp.int32))
        return model(tokens[:, 8:], positions[:, 8:] - jnp.asarray([[0], [2]]), cache, window, backend="xla",
                     unroll_layers=unroll)

    scanned, unrolled = run(model, tokens, False), run(model, tokens, True)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_cache_of_another_depth_is_refused():
    model = DeepseekV3(preset("tiny-v3"), rngs=nnx.Rngs(0))
    other = DeepseekV3(preset("tiny-v3").replace(num_hidden_layers=3), rngs=nnx.Rngs(0))
    vis = Visibility(jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="cache: holds 3 layers, the model has 2"):
        model(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), other.init_cache(1, 8), vis)


def test_run_layers_visits_rows_in_order():
    """`run_layers` as a scan and unrolled: body sees row r with its own parameters, in order."""
    stack = stack_layers(lambda rngs: nnx.Linear(3, 3, rngs=rngs), 4, nnx.Rngs(2))
    x = jnp.arange(3, dtype=jnp.float32)
    want = x
    for r in range(4):
        want = layer_slice(stack, r)(want) + r
    for unroll in (False, True):
        got = run_layers(stack, lambda layer, r, carry: layer(carry) + r, x, unroll=unroll)
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_matmul_reads_a_stack_row_in_place(fp8):
    """grouped_matmul(rhs_row=r) over a stack [n, G, K, N] equals the op on the row rhs[r], bit for
    bit, on the reference and on the kernel (interpret mode on the CPU, native on a GPU), each
    against itself; the kernel sees the other rows as empty groups. The two backends agree within
    rounding (they sum in different orders; on the CPU they happen to agree exactly). `in_place` of
    a plain array is the array as a one-row stack."""
    from jaxspec.pallas_kernels.block_fp8 import quantize
    rng = np.random.default_rng(3)
    stack = jnp.asarray(rng.normal(size=(3, 4, 128, 128)), jnp.float32)
    scales = None
    if fp8:
        stack, scales = jax.vmap(jax.vmap(quantize))(stack)
    lhs = jnp.asarray(rng.normal(size=(20, 128)), jnp.bfloat16 if fp8 else jnp.float32)
    sizes = jnp.asarray([5, 0, 9, 4], jnp.int32)
    for row in (0, 2):
        got = {}
        for backend in ("xla", "pallas"):
            want = grouped_matmul(lhs, stack[row], sizes, None if scales is None else scales[row], backend=backend)
            got[backend] = grouped_matmul(lhs, stack, sizes, scales, rhs_row=jnp.int32(row), backend=backend)
            np.testing.assert_array_equal(np.asarray(got[backend]), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got["pallas"], np.float32), np.asarray(got["xla"], np.float32),
                                   rtol=1e-2, atol=1e-2)
    whole, row = in_place(stack[1])
    assert whole.shape == (1, *stack.shape[1:]) and int(row) == 0
    assert in_place(StackRow(stack, jnp.int32(2)))[0] is stack
    with pytest.raises(ValueError, match=r"rhs: with rhs_row, must be a stack \[n, G, K, N\]"):
        grouped_matmul(lhs, stack[0], sizes, None if scales is None else scales[0], rhs_row=jnp.int32(0))
