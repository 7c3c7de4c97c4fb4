"""Small building blocks: linear layers, RMS norms (weighted and unit), LayerNorm, the SwiGLU MLP, `per_position`.

Parameter names follow the Hugging Face DeepSeek checkpoints (`weight`, `bias`), with linear
weights stored `[in, out]` (the checkpoint loader transposes), so a loaded tree reads like the file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.pallas_kernels import grouped_matmul, resolve_backend
from jaxspec.pallas_kernels.block_fp8 import FP8, dequantize, quantize

from .interface import window_rows
from .stack import StackRow, in_place


def compute_dtype(dtype):
    """The dtype of activations, caches and unquantized parameters of a model built with `dtype`:
    bfloat16 for `jnp.float8_e4m3fn` (DeepSeek's FP8 checkpoint layout: only the `Linear`s that
    `jaxspec.fp8` lists hold FP8 weights), `dtype` itself otherwise."""
    return jnp.bfloat16 if jnp.dtype(dtype) == FP8 else dtype


def param(value: jax.Array, *names: str | None) -> nnx.Param:
    """An `nnx.Param` whose axes carry logical names (one per axis; None = never sharded), which
    `jaxspec.sharding`'s rule tables map to mesh axes. Eager sharding is off: weights are built
    (random init, a checkpoint) before anyone chose a mesh, and are placed by `jaxspec.sharding`."""
    if len(names) != value.ndim:
        raise ValueError(f"names={names}: need one per axis of a {value.ndim}-d parameter")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def weight_params(init, key: jax.Array, shape: tuple[int, ...], dtype, names: tuple[str | None, ...],
                  scale_fmt: str | None = None) -> tuple[nnx.Param, nnx.Param | None]:
    """A weight [..., in, out] drawn by `init` and its block scales, both named `names`: in `dtype`
    with no scales, or for `jnp.float8_e4m3fn` drawn in float32 and quantized (`block_fp8.quantize`)
    into FP8 plus float32 `scale_inv` [..., ceil(in / 128), ceil(out / 128)], powers of two where
    `scale_fmt` (the model's `ModelConfig.scale_fmt`) is "ue8m0", as in DeepSeek's releases."""
    if jnp.dtype(dtype) != FP8:
        return param(init(key, shape, dtype), *names), None
    weight, scale_inv = quantize(init(key, shape, jnp.float32), power_of_two=scale_fmt == "ue8m0")
    return param(weight, *names), param(scale_inv, *names)


class Linear(nnx.Module):
    """y = x @ weight (+ bias); weight [in, out]. names: the logical names of (in, out).

    dtype=jnp.float8_e4m3fn builds DeepSeek's block-quantized layer: `weight` float8_e4m3fn
    [in, out] and `weight_scale_inv` float32 [ceil(in / 128), ceil(out / 128)], both named `names`
    (random weights are quantized from a normal draw, with power-of-two scales where `scale_fmt` is
    "ue8m0": `weight_params`); with any other dtype `weight_scale_inv` is None. A quantized layer
    multiplies by its dequantized bfloat16 weight (`pallas_kernels.block_fp8`) without storing it:
    on the "pallas" and "mosaic" backends through a grouped-matmul kernel as one group, which
    dequantizes each weight tile after loading it (XLA's GPU gemm fusion takes in an FP8 convert but
    not the block scales' multiply, so its dot writes a bfloat16 copy of the weight first); on "xla"
    as XLA's dot of the dequantized weight (bit for bit the layer a model dequantized at load
    computes).
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 use_bias: bool = False, names: tuple[str | None, str | None] = (None, None),
                 scale_fmt: str | None = None):
        init = nnx.initializers.normal(stddev=in_features ** -0.5)
        self.weight, self.weight_scale_inv = weight_params(init, rngs.params(), (in_features, out_features), dtype,
                                                           names, scale_fmt)
        self.bias = param(jnp.zeros((out_features,), compute_dtype(dtype)), names[1]) if use_bias else None

    def dense_weight(self) -> jax.Array:
        """The [in, out] weight the layer multiplies by: `weight`, or an FP8 one dequantized to bfloat16."""
        if self.weight_scale_inv is None:
            return self.weight[...]
        return dequantize(self.weight[...], self.weight_scale_inv[...])

    def __call__(self, x: jax.Array, *, backend: str) -> jax.Array:
        """x [..., in] -> [..., out]. backend: the model call's (`DecodeConfig.backend`), which decides
        how a quantized layer multiplies (class docstring). It has no default: a layer called
        without it would resolve "auto" by itself, and on a GPU a model run on "xla" (the reference)
        would then multiply through the Triton kernel.

        A layer of a stack (`models.stack`: its weight a `StackRow`) multiplies on the GPU backends
        through the grouped-matmul kernel too, as one group read in place, when its weight has x's
        16-bit dtype: XLA's gemms would read the row only after copying it out of the stack."""
        weight = self.weight.get_value()
        stacked = isinstance(weight, StackRow) and weight.dtype == x.dtype and jnp.dtype(x.dtype).itemsize == 2
        if (self.weight_scale_inv is not None or stacked) and resolve_backend(backend, "grouped_matmul") != "xla":
            rows = x.reshape(-1, x.shape[-1])
            stack, row = in_place(weight)
            scales = None if self.weight_scale_inv is None else in_place(self.weight_scale_inv.get_value())[0][:, None]
            y = grouped_matmul(rows, stack[:, None], jnp.full((1,), rows.shape[0], jnp.int32), scales, rhs_row=row,
                               backend=backend).reshape(*x.shape[:-1], -1)
        else:
            y = x @ self.dense_weight().astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


def embedding(vocab_size: int, dim: int, *, rngs: nnx.Rngs, dtype) -> nnx.Embed:
    """The token embedding [vocab_size, dim] (`embedding`, named ("vocab", "embed")), N(0, 1) at init."""
    return nnx.Embed(vocab_size, dim, param_dtype=dtype, rngs=rngs, embedding_init=nnx.initializers.normal(1.0),
                     embedding_metadata=dict(out_sharding=("vocab", "embed"), eager_sharding=False))


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 (as DeepSeek and transformers do)."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32, name: str | None = "embed"):
        self.weight = param(jnp.ones((dim,), compute_dtype(dtype)), name)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = unit_rms_norm(x.astype(jnp.float32), self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def unit_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32, no weight (transformers'
    `DeepseekV4UnweightedRMSNorm`; V4's `q_b_norm` and its mHC input norm)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """Standard LayerNorm with weight and bias, in float32 (the V3.2 indexer's `k_norm`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32, name: str | None = None):
        self.weight = param(jnp.ones((dim,), compute_dtype(dtype)), name)
        self.bias = param(jnp.zeros((dim,), compute_dtype(dtype)), name)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None = None) -> jax.Array:
    """silu(gate) * up; with `limit` (DeepSeek-V4's `swiglu_limit`) gate clamped above at limit and
    up to [-limit, limit] first, as transformers' DeepseekV4MLP / DeepseekV4Experts do."""
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(swiglu(gate(x), up(x), swiglu_limit)). hidden_name: the logical name
    of the intermediate axis ("mlp" for a dense layer, "expert_mlp" for the MoE's shared experts);
    scale_fmt: the FP8 scales' format, as for `Linear`."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, dtype=jnp.float32, hidden_name: str = "mlp",
                 swiglu_limit: float | None = None, scale_fmt: str | None = None):
        linear = functools.partial(Linear, rngs=rngs, dtype=dtype, scale_fmt=scale_fmt)
        self.gate_proj = linear(dim, hidden, names=("embed", hidden_name))
        self.up_proj = linear(dim, hidden, names=("embed", hidden_name))
        self.down_proj = linear(hidden, dim, names=(hidden_name, "embed"))
        self.swiglu_limit = swiglu_limit

    def __call__(self, x: jax.Array, *, backend: str) -> jax.Array:
        """x [..., dim] -> [..., dim]. backend: the model call's, for the linears (`Linear`)."""
        linear = lambda layer, x: layer(x, backend=backend)
        return linear(self.down_proj, swiglu(linear(self.gate_proj, x), linear(self.up_proj, x), self.swiglu_limit))


def head_logits(norm: RMSNorm, lm_head: Linear, x: jax.Array, at: jax.Array | None = None, *,
                per_token: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [B, Q, D] (the last block's output) -> (logits [B, Q, V] float32, norm(x) [B, Q, D] in x's dtype).

    at: None, or [B, L] int32 window positions: the logits of those rows only, [B, L, V] (a
    prefill reads one row of a prompt's; the others were [B, P, V] float32 products computed for
    nothing). per_token: each position computed alone (`per_position`).

    The logits that greedy decoding and acceptance compare are computed in float32 from x: the
    norm's float32 output times the float32 head, never rounded to bfloat16 in between (as
    serving engines compute logits for sampling). A bfloat16 logit has 8 significant bits, so
    near-ties would otherwise become exact ties or flip order on the last rounding.
    """
    normed = per_position(lambda x: norm(x.astype(jnp.float32)), x, enabled=per_token)
    # The head is cast inside the product, where XLA fuses the cast into the GEMM: cast outside a
    # per-position loop it would be a float32 copy of the head made before the loop.
    logits = per_position(lambda rows: rows @ lm_head.weight[...].astype(jnp.float32), window_rows(normed, at),
                          enabled=per_token)
    return logits, normed.astype(x.dtype)


def per_position(fn, *window_args, enabled: bool = True):
    """Apply `fn` to each window position of `window_args` separately: a window-invariant call.

    window_args: pytrees of [B, Q, ...] arrays (None leaves allowed); fn takes them as [B, 1, ...]
    and returns a pytree of [B, 1, ...] arrays; the result is fn's outputs stacked back to [B, Q, ...].
    With `enabled=False`, simply fn(*window_args).

    Why: XLA's CPU backend picks a matmul or reduction algorithm by the operand shapes (a one-row
    matmul is an Eigen matrix-vector product, four rows go to YNNPACK with other blocking), so a
    token computed with Q - 1 others can round differently from the same token alone, and a greedy
    near-tie can then flip. Here the window's Q positions run one after another through a
    `jax.lax.map` (a rolled loop, so XLA neither unrolls nor merges the Q copies), each with the
    [B, 1] shapes of a plain decode step: every token meets exactly the algorithms it would meet
    alone. An optimization barrier around fn's inputs and outputs, at every Q (1 included), fixes
    where values are rounded to the model's dtype: without it XLA may keep a bfloat16 result in
    float32 into the next op (excess precision) in one program and not in the other.
    """
    if not enabled:
        return fn(*window_args)
    isolated = lambda *args: jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))
    if jax.tree.leaves(window_args)[0].shape[1] == 1:
        return isolated(*window_args)
    stacked = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0)[:, :, None], window_args)  # [Q, B, 1, ...]
    out = jax.lax.map(lambda args: isolated(*args), stacked)
    return jax.tree.map(lambda y: jnp.moveaxis(y[:, :, 0], 0, 1), out)
