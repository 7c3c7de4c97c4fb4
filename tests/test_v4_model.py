"""DeepSeek-V4 model pieces and the whole model against transformers 5.23, in fp32, on the same random
weights: mHC (HyperConnection, HyperHead) and the MoE (sqrtsoftplus scores, hash routing, SwiGLU clamp)
module by module; then `DeepseekV4` (prefill logits, cached decode step by step, greedy generation)
on configs where transformers is self-consistent.

Every parameter, norm weights, biases and hash tables included, is re-drawn at random before it is
copied: with transformers' init (norms at 1, mHC base 0 and scale 1, router bias 0) several wrong
wirings would not change a number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models.hyper_connections import HyperConnection, HyperHead
from jaxspec.models.moe import MoE
from jaxspec.presets import preset
from layer_names import per_layer_names, restacked

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

pytestmark = pytest.mark.hf

jax.config.update("jax_default_matmul_precision", "highest")


def hf_config(config):
    """transformers' DeepseekV4Config for our ModelConfig (eager attention: the only one V4 has)."""
    raw = {k: v for k, v in config.to_hf().items() if k != "model_type"}
    hf = DeepseekV4Config(**raw)
    hf._attn_implementation = "eager"
    return hf


def randomize(module: torch.nn.Module, seed: int, vocab_experts: tuple[int, int] | None = None):
    """Re-draw every float parameter and buffer of `module` (normal, std 0.5 for 1-D tensors around
    1 for norm-like weights, std 0.2 otherwise) and every `tid2eid` (distinct experts per token)."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name.endswith("tid2eid"):
            vocab, k = tensor.shape
            num_experts = vocab_experts[1]
            tensor.data.copy_(torch.argsort(torch.rand(vocab, num_experts, generator=gen), dim=-1)[:, :k])
        elif tensor.is_floating_point() and "inv_freq" not in name:
            std = 0.2
            draw = torch.randn(tensor.shape, generator=gen) * std
            if name.endswith("weight") and tensor.ndim == 1:  # norms: around 1
                draw = 1 + draw
            tensor.data.copy_(draw.to(tensor.dtype))


def to_jax(tensor: torch.Tensor) -> jax.Array:
    return jnp.asarray(tensor.detach().numpy())


# -- mHC --------------------------------------------------------------------------------------------

def test_hyper_connection_and_head_equal_transformers():
    """post, comb (Sinkhorn), the collapsed input, the merged streams and the hyper head: transformers'
    DeepseekV4HyperConnection / DeepseekV4HyperHead / decoder-layer merge on the same weights."""
    config = preset("tiny-v4")
    hf = hf_config(config)
    torch.manual_seed(0)
    hc, head = hf_v4.DeepseekV4HyperConnection(hf), hf_v4.DeepseekV4HyperHead(hf)
    randomize(hc, 1)
    randomize(head, 2)
    ours_hc = abstract(lambda: HyperConnection(config, rngs=nnx.Rngs(0)))
    ours_head = abstract(lambda: HyperHead(config, rngs=nnx.Rngs(0)))
    for name in ("fn", "base", "scale"):
        getattr(ours_hc, name).set_value(to_jax(getattr(hc, name)))
    for name in ("hc_fn", "hc_base", "hc_scale"):
        getattr(ours_head, name).set_value(to_jax(getattr(head, name)))

    streams = torch.randn(2, 5, config.hc_mult, config.hidden_size, generator=torch.Generator().manual_seed(3))
    block_out = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
        merged = post.unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        headed = head(streams)
    ours = jax.jit(lambda s: ours_hc(s))(to_jax(streams))
    for got, want in zip(ours, (post, comb, collapsed)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(HyperConnection.merge(*ours[:2], to_jax(block_out), to_jax(streams)), merged.numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours_head(to_jax(streams)), headed.numpy(), rtol=1e-5, atol=1e-6)
    # Sinkhorn made comb doubly stochastic (up to its epsilons), so the merge does not blow up.
    np.testing.assert_allclose(np.asarray(ours[1]).sum(-1), 1, atol=1e-3)
    np.testing.assert_allclose(np.asarray(ours[1]).sum(-2), 1, atol=1e-3)


# -- MoE --------------------------------------------------------------------------------------------

def copy_moe(block, moe: MoE) -> None:
    """transformers' DeepseekV4SparseMoeBlock weights -> our MoE (router [E, D] -> [D, E]; fused
    gate_up [E, 2I, D] -> gate / up [E, D, I]; down [E, D, I] -> [E, I, D]; shared MLP transposed)."""
    moe.gate_weight.set_value(to_jax(block.gate.weight).T)
    if moe.tid2eid is not None:
        moe.tid2eid.set_value(to_jax(block.gate.tid2eid).astype(jnp.int32))
    else:
        moe.e_score_correction_bias.set_value(to_jax(block.gate.e_score_correction_bias))
    for name, value in _split_fused("experts.gate_up_proj", to_jax(block.experts.gate_up_proj)).items():
        getattr(moe, name).set_value(value)
    moe.experts_down_proj.set_value(to_jax(block.experts.down_proj).transpose(0, 2, 1))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        getattr(moe.shared_experts, proj).weight.set_value(to_jax(getattr(block.shared_experts, proj).weight).T)


def abstract(build):
    """A module built without its random init (`nnx.eval_shape`: the eager init ops would cost
    seconds of compiles); every parameter is then filled from transformers'."""
    return nnx.eval_shape(build)


@pytest.mark.parametrize("layer", [0, 2], ids=["hash", "learned"])
@pytest.mark.parametrize("limit", [10.0, 0.3], ids=["limit10", "limit0.3"])
def test_moe_equals_transformers(layer, limit):
    """Learned routing (sqrtsoftplus scores + bias) and hash routing (tid2eid[token]), with the SwiGLU
    clamp inactive (10) and active on most activations (0.3), on both expert paths."""
    config = preset("tiny-v4", swiglu_limit=limit)
    hf = hf_config(config)
    torch.manual_seed(0)
    block = hf_v4.DeepseekV4SparseMoeBlock(hf, layer)
    randomize(block, 5 + layer, (config.vocab_size, config.n_routed_experts))
    moe = abstract(lambda: MoE(config, rngs=nnx.Rngs(0), hash_routing=config.is_hash_layer(layer)))
    copy_moe(block, moe)

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, config.hidden_size, generator=gen)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        want = block(x, input_ids=ids).numpy()
    for path in ("gathered", "grouped"):
        got = moe(to_jax(x), backend="xla", path=path, token_ids=to_jax(ids).astype(jnp.int32))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if limit < 1:  # the clamp did bite: without it the output differs
        unclamped = abstract(lambda: MoE(config.replace(swiglu_limit=None), rngs=nnx.Rngs(0),
                                         hash_routing=config.is_hash_layer(layer)))
        copy_moe(block, unclamped)
        diff = unclamped(to_jax(x), backend="xla", token_ids=to_jax(ids).astype(jnp.int32)) - want
        assert np.abs(diff).max() > 1e-2


def test_hash_moe_needs_token_ids():
    config = preset("tiny-v4")
    moe = abstract(lambda: MoE(config, rngs=nnx.Rngs(0), hash_routing=True))
    with pytest.raises(ValueError, match="token_ids"):
        moe(jnp.zeros((1, 3, config.hidden_size)))
    with pytest.raises(ValueError, match="token_ids"):
        moe(jnp.zeros((1, 3, config.hidden_size)), token_ids=jnp.zeros((1, 2), jnp.int32))


# -- the whole model --------------------------------------------------------------------------------

def _split_fused(name: str, value: jax.Array) -> dict[str, jax.Array]:
    """transformers' fused experts -> ours: gate_up_proj [E, 2I, D] -> experts_{gate,up}_proj [E, D, I];
    down_proj [E, D, I] -> experts_down_proj [E, I, D]."""
    prefix = name.rsplit("experts.", 1)[0]
    if name.endswith("gate_up_proj"):
        inter = value.shape[1] // 2
        return {prefix + "experts_gate_proj": value[:, :inter].transpose(0, 2, 1),
                prefix + "experts_up_proj": value[:, inter:].transpose(0, 2, 1)}
    return {prefix + "experts_down_proj": value.transpose(0, 2, 1)}


_RENAMES = (("mlp.gate.weight", "mlp.gate_weight"), ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
            ("mlp.gate.tid2eid", "mlp.tid2eid"))


def copy_weights(hf_model, model) -> None:
    """Every tensor of transformers' DeepseekV4ForCausalLM state_dict into our DeepseekV4 by name:
    `model.` dropped, the embedding's `weight` -> `embedding`, router renames, fused experts split,
    2-D `.weight`s (Linear, router) transposed to [in, out], raw parameters (mHC, sinks,
    position_bias, tid2eid) as stored. Every parameter of ours but the MTP module's (transformers
    has none) must be filled exactly once."""
    ours = {}
    for name, tensor in hf_model.state_dict().items():
        value = to_jax(tensor)
        name = name.removeprefix("model.")
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if name == "embed_tokens.weight":
            ours["embed_tokens.embedding"] = value
        elif ".mlp.experts." in name:
            ours.update(_split_fused(name, value))
        else:
            ours[name] = value.T if name.endswith("weight") and value.ndim == 2 else value
    state = nnx.state(model, nnx.Param)
    flat = {key: var for key, var in ((".".join(map(str, path)), var) for path, var in nnx.to_flat_state(state))
            if not key.startswith("mtp.")}
    names = per_layer_names(flat, model.config)
    assert sorted(names) == sorted(ours), sorted(set(names) ^ set(ours))
    ours = restacked(flat, ours, model.config)
    for key, var in flat.items():
        assert var.shape == ours[key].shape, (key, var.shape, ours[key].shape)
        var.set_value(ours[key].astype(var.dtype))
    nnx.update(model, state)


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.Tensor.topk with ties broken by the lowest index, as jax.lax.top_k breaks them. The CSA
    indexer scores an entry exactly 0 whenever all its heads' q.k are negative (often, with two
    random heads), and torch.topk's order among tied zeros depends on the length of the call:
    that, not the formulas, is what made transformers' CSA layers look inconsistent between a
    prefix and a longer forward."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


CASES = {
    # transformers' sliding and HCA layers are self-consistent as they are (the tie order of its
    # top-k does not matter without CSA).
    "sliding+hca": dict(num_hidden_layers=2, layer_types=("sliding_attention", "heavily_compressed_attention"),
                        mlp_layer_types=("hash_moe", "moe")),
    # Every kind, the indexer keeping 4 of up to 10 entries; transformers with its top-k tie order fixed.
    "all-kinds": dict(),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    """(transformers' DeepseekV4ForCausalLM, our DeepseekV4 with its weights, its config)."""
    from transformers import DeepseekV4ForCausalLM

    from jaxspec.models.deepseek_v4 import DeepseekV4
    config = preset("tiny-v4", num_nextn_predict_layers=0, **CASES[request.param])
    torch.manual_seed(0)
    hf_model = DeepseekV4ForCausalLM(hf_config(config)).eval()
    randomize(hf_model, 11, (config.vocab_size, config.n_routed_experts))
    model = abstract(lambda: DeepseekV4(config, rngs=nnx.Rngs(0)))
    copy_weights(hf_model, model)
    return hf_model, model, config


@pytest.fixture(autouse=True)
def stable_topk(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)


def _forward(model):
    from jaxspec.pallas_kernels import Visibility
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, tokens, positions, cache, prefix_len, query_len):
        return nnx.merge(graphdef, params)(tokens, positions, cache, Visibility(prefix_len, query_len), backend="xla")

    def call(tokens, start, cache):
        batch, num = tokens.shape
        positions = jnp.broadcast_to(start + jnp.arange(num, dtype=jnp.int32), (batch, num))
        return run(params, tokens, positions, cache, jnp.full((batch,), start, jnp.int32),
                   jnp.full((batch,), num, jnp.int32))
    return call


BATCH, PROMPT, TOTAL = 2, 23, 40  # 40 tokens: 10 CSA and 5 HCA entries, five sliding windows


def test_prefill_decode_and_greedy_equal_transformers(pair):
    """Transformers' forward over 40 tokens against ours: a 23-token prefill (logits at every
    position), then cached one-token steps to the end; greedy generation from the prefix, token for
    token against transformers' `generate` (its own cached decode)."""
    hf_model, model, config = pair
    ids = torch.randint(0, config.vocab_size, (BATCH, TOTAL), generator=torch.Generator().manual_seed(1))
    tokens = to_jax(ids).astype(jnp.int32)
    with torch.no_grad():
        full = hf_model(ids).logits.numpy()
        # An explicit mask: without one, generate masks out prompt tokens equal to pad_token_id.
        greedy = hf_model.generate(ids[:, :PROMPT], attention_mask=torch.ones_like(ids[:, :PROMPT]),
                                   max_new_tokens=TOTAL - PROMPT, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[:, PROMPT:].numpy()
    call = _forward(model)

    def decode(next_token):  # the prefill, then one cached step per token fed (ring sized for the prefill)
        cache = model.init_cache(BATCH, 64, page_size=8, max_window=PROMPT)
        logits, hidden, cache = call(tokens[:, :PROMPT], 0, cache)
        assert hidden.shape == (BATCH, PROMPT, config.hc_mult * config.hidden_size)
        steps = [logits]
        for i in range(PROMPT, TOTAL):
            logits, _, cache = call(next_token(i, steps[-1][:, -1])[:, None], i, cache)
            steps.append(logits)
        return np.concatenate(steps, 1)

    np.testing.assert_allclose(decode(lambda i, _: tokens[:, i]), full, rtol=1e-4, atol=1e-4)
    ours_greedy = decode(lambda i, last: jnp.argmax(last, -1).astype(jnp.int32))[:, PROMPT - 1:-1].argmax(-1)
    np.testing.assert_array_equal(ours_greedy, greedy)
