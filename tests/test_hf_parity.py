"""Parity with an independent implementation: Hugging Face transformers' DeepSeek-V3 / V3.2, in fp32.

Tiny random `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM` models are saved with
`save_pretrained` (per-expert or fused, one file or shards, transformers 5 or DeepSeek's released
config.json form); an MTP layer from transformers' own `MtpModel` is written beside them in
DeepSeek's key layout (`model.layers.{N}.enorm ...`), as DeepSeek ships it. jaxspec loads the
directory and must match transformers on prefill logits, cached decode steps, greedy generations
(speculative, k = 1..3, against plain greedy `generate`) and the MTP module's drafts.

Every parameter (norm weights and router bias included) is re-drawn at random: with transformers'
init (norms at 1, bias at 0) several mistakes, feeding hnorm the pre-norm hidden among them, would
not change a single number.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_layers import MtpModel  # noqa: E402

from jaxspec.checkpoint import load_hf_checkpoint  # noqa: E402
from jaxspec.decode_config import DecodeConfig  # noqa: E402
from jaxspec.generation import generate  # noqa: E402
from jaxspec.model_config import ModelConfig  # noqa: E402
from jaxspec.pallas_kernels import Visibility  # noqa: E402
from jaxspec.shards import INDEX_FILE, read_header, write  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            eos_token_id=1)
# Eight indexer heads: with two, an all-negative head set scores a slot exactly 0, and ties among
# zeros are broken differently by torch.topk and lax.top_k (both are right).
V32 = dict(index_n_heads=8, index_head_dim=8)


def yarn(factor, mscale, mscale_all_dim):
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 32, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim, "rope_theta": 10000.0}


@dataclasses.dataclass(frozen=True)
class Case:
    """One tiny model: transformers config fields, how it is written, and the draft length it decodes with."""

    name: str
    kind: str  # "v3" | "v32"
    fields: dict
    num_draft: int
    fused: bool = False    # transformers' fused experts (save_original_format=False) instead of per-expert
    sharded: bool = False  # several safetensors files and an index
    released: bool = False  # config.json rewritten in DeepSeek's released form (rope_scaling + rope_theta)
    predictable: bool = False  # weights under which the MTP drafts well (see `draft_bigrams`)


CASES = [
    # mscale_all_dim 0: YaRN's default cos/sin magnitude, 0.1 ln(factor) + 1, with the plain softmax scale.
    Case("v3-no-q-lora-yarn", "v3", dict(q_lora_rank=None, norm_topk_prob=False, n_group=1, topk_group=1,
                                         first_k_dense_replace=0, n_shared_experts=1,
                                         rope_parameters=yarn(4.0, 1.0, 0.0)), num_draft=1),
    # A large rms_norm_eps shows which norms use it (the latent norms do not).
    Case("v3-groups-dense-first", "v3", dict(norm_topk_prob=True, n_group=4, topk_group=2, first_k_dense_replace=1,
                                             n_shared_experts=2, rope_parameters=yarn(8.0, 0.9, 1.0),
                                             rms_norm_eps=0.05),
         num_draft=2, sharded=True, released=True),
    Case("v32-topk4-fused", "v32", dict(norm_topk_prob=True, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        n_shared_experts=2, index_topk=4, rope_parameters=yarn(8.0, 1.0, 0.5),
                                        rms_norm_eps=0.05, **V32),
         num_draft=3, fused=True, sharded=True),
    Case("v32-predictable", "v32", dict(norm_topk_prob=True, n_group=2, topk_group=2, first_k_dense_replace=1,
                                        n_shared_experts=1, index_topk=5, rope_parameters=yarn(4.0, 1.0, 1.0), **V32),
         num_draft=3, predictable=True),
]


def randomize(module, seed: int, *, prefix: str = "") -> None:
    """Redraw every parameter under `prefix`: weights ~ N(0, fan_in^-1), norm weights ~ 1 + N(0, 0.2^2),
    biases and the router's score-correction bias small and nonzero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not name.startswith(prefix) or not tensor.is_floating_point() or "rotary" in name:
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if tensor.ndim >= 2:
                tensor.copy_(noise * tensor.shape[-1] ** -0.5)
            elif name.endswith("bias"):
                tensor.copy_(noise * 0.05)
            else:
                tensor.copy_(1.0 + 0.2 * noise)


def shrink_block_outputs(module) -> None:
    """Scale the blocks' output projections by 0.1: the residual stream stays close to the token
    embedding, so the target is nearly a bigram model (next token a function of the current one)."""
    with torch.no_grad():
        for name, tensor in module.named_parameters():
            if "layers." in name and name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                tensor.mul_(0.1)


def draft_bigrams(hf, mtp) -> None:
    """Random weights draft nothing right, which leaves accept-and-commit untested. With the target
    nearly a bigram model, an MTP layer that reads mostly the embedding half of its input
    (`eh_proj` ~ [I, small]) through the target's final-norm weights predicts the bigram of
    t_{i+1}, which is t_{i+2}: its drafts are often accepted, and every path still contributes."""
    layer = mtp.layers[0]
    dim = layer.eh_proj.weight.shape[0]
    with torch.no_grad():
        layer.eh_proj.weight[:, :dim] = torch.eye(dim)
        layer.eh_proj.weight[:, dim:] *= 0.1
        layer.enorm.weight.fill_(1.0)
        layer.post_norm.weight.copy_(hf.model.norm.weight)


def mtp_tensors(mtp: MtpModel, layer: int) -> dict[str, np.ndarray]:
    """transformers' MtpModel weights under DeepSeek's names (model.layers.{N}., per-expert experts)."""
    prefix, out = f"model.layers.{layer}.", {}
    for name, tensor in mtp.state_dict().items():
        value = tensor.detach().numpy()
        if name == "embed_tokens.weight":
            out[prefix + "embed_tokens.weight"] = value
        elif name == "shared_head.weight":
            out[prefix + "shared_head.head.weight"] = value
        elif name == "layers.0.post_norm.weight":
            out[prefix + "shared_head.norm.weight"] = value
        elif name.endswith("mlp.experts.gate_up_proj"):
            half = value.shape[1] // 2
            block = prefix + name.removeprefix("layers.0.mtp_block.").removesuffix("gate_up_proj")
            for e in range(value.shape[0]):
                out[f"{block}{e}.gate_proj.weight"] = value[e, :half]
                out[f"{block}{e}.up_proj.weight"] = value[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            block = prefix + name.removeprefix("layers.0.mtp_block.").removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{block}{e}.down_proj.weight"] = value[e]
        else:
            out[prefix + name.removeprefix("layers.0.").removeprefix("mtp_block.")] = value
    return out


def add_mtp_shard(directory, tensors: dict[str, np.ndarray]) -> None:
    """Write the MTP layer as its own shard and list it in the index (creating one if needed)."""
    write(directory / "mtp.safetensors", tensors)
    index_path = directory / INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        index = {"metadata": {}, "weight_map": dict.fromkeys(read_header(str(directory / "model.safetensors")),
                                                              "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    index_path.write_text(json.dumps(index))


def rewrite_as_released(directory) -> None:
    """config.json in the form DeepSeek ships (rope_theta + rope_scaling, their routing fields)."""
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rope.items() if k not in ("rope_type", "type")}}
    for key in ("head_dim", "qk_head_dim"):
        raw.pop(key, None)
    raw.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, ep_size=1, seq_aux=True)
    path.write_text(json.dumps(raw))


@dataclasses.dataclass
class Built:
    hf: object       # the transformers CausalLM
    mtp: MtpModel    # transformers' MTP module on the same weights as the checkpoint's MTP layer
    model: object    # jaxspec's model loaded from the directory


def build(case: Case, directory) -> Built:
    if case.kind == "v3":
        config = transformers.DeepseekV3Config(**{**BASE, **case.fields})
        hf = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.DeepseekV32Config(**{**BASE, **case.fields})
        hf = transformers.DeepseekV32ForCausalLM(config)
    hf.eval()
    randomize(hf, seed=0)
    if case.predictable:
        shrink_block_outputs(hf)
    hf.save_pretrained(directory, save_original_format=not case.fused,
                       **({"max_shard_size": "40KB"} if case.sharded else {}))
    if case.released:
        rewrite_as_released(directory)
    if case.kind == "v32":  # transformers' V3.2 config has no MTP fields: give MtpModel what it reads
        hf.config.num_mtp_layers = 1
        hf.config.mtp_mlp_layer_types = ["sparse"]
        hf.config.mtp_layer_types = ["indexed_attention"]
    mtp = MtpModel(hf, 1).eval()
    randomize(mtp, seed=1, prefix="layers.")
    if case.predictable:
        shrink_block_outputs(mtp)
        draft_bigrams(hf, mtp)
    add_mtp_shard(directory, mtp_tensors(mtp, config.num_hidden_layers))
    return Built(hf, mtp, load_hf_checkpoint(directory, log=lambda line: None))


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.name)
def built(request, tmp_path_factory) -> tuple[Case, Built]:
    return request.param, build(request.param, tmp_path_factory.mktemp(request.param.name))


PROMPTS = [[5, 17, 33, 2, 90, 61, 7, 7, 40], [11, 3, 58, 21, 9], [70, 6, 6, 44, 13, 88, 27, 31, 50, 2, 19, 64]]


def _hf_logits(hf, ids, **kwargs):
    with torch.no_grad():
        return hf(torch.tensor([ids]), **kwargs)


def _vis(prefix_len, query_len):
    return Visibility(jnp.asarray(prefix_len, jnp.int32), jnp.asarray(query_len, jnp.int32))


def test_config_loads_as_transformers_reads_it(built):
    case, b = built
    config = b.model.config
    hf = b.hf.config
    assert config.model_type == hf.model_type
    assert (config.q_lora_rank, config.norm_topk_prob, config.n_group, config.topk_group, config.n_shared_experts) == \
           (hf.q_lora_rank, hf.norm_topk_prob, hf.n_group, hf.topk_group, hf.n_shared_experts)
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rope_scaling.factor == hf.rope_parameters["factor"]
    assert config.num_nextn_predict_layers == 1 and b.model.mtp is not None


def test_prefill_and_cached_decode_logits(built):
    """A batch of prompts of different lengths (prefill, expanded MLA), then cached windows of 1 and
    3 tokens (absorbed MLA, paged cache) against transformers row by row with its own KV cache."""
    case, b = built
    model = b.model
    rng = np.random.default_rng(3)
    lengths = [len(p) for p in PROMPTS]
    width = max(lengths)
    tokens = np.zeros((len(PROMPTS), width), np.int32)
    for row, prompt in enumerate(PROMPTS):
        tokens[row, :len(prompt)] = prompt
    cache = model.init_cache(len(PROMPTS), width + 8, page_size=4)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
    logits, _, cache = model(jnp.asarray(tokens), positions, cache, _vis([0] * 3, lengths), form="expanded",
                             backend="xla")
    reference = [_hf_logits(b.hf, p, use_cache=True) for p in PROMPTS]
    for row, length in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[row, :length]), reference[row].logits[0].numpy(),
                                   rtol=1e-4, atol=1e-4, err_msg=f"prefill row {row}")

    past = [r.cache for r in reference]
    for window in (1, 3, 1):
        step = rng.integers(0, VOCAB, (len(PROMPTS), window)).astype(np.int32)
        positions = jnp.asarray(np.asarray(lengths)[:, None] + np.arange(window)[None, :], jnp.int32)
        logits, _, cache = model(jnp.asarray(step), positions, cache, _vis(lengths, [window] * 3), form="absorbed",
                                 backend="xla")
        for row in range(len(PROMPTS)):
            out = _hf_logits(b.hf, step[row].tolist(), cache=past[row], use_cache=True)
            past[row] = out.cache
            np.testing.assert_allclose(np.asarray(logits[row]), out.logits[0].numpy(), rtol=1e-4, atol=1e-4,
                                       err_msg=f"decode window {window} row {row} at {lengths[row]}")
        lengths = [n + window for n in lengths]


def test_speculative_greedy_equals_transformers_greedy(built):
    """jaxspec's MTP speculative decoding (k = case.num_draft) emits transformers' greedy tokens."""
    case, b = built
    new_tokens = 10
    config = DecodeConfig(num_draft=case.num_draft, max_new_tokens=new_tokens, eos_token_id=b.model.config.eos_token_id,
                          page_size=8, backend="xla")
    result = generate(b.model, PROMPTS, config)
    assert not case.predictable or int(np.sum(result.accepted)) > 0, "no draft accepted: accept path untested"
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = b.hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=new_tokens, do_sample=False, pad_token_id=b.hf.config.eos_token_id)
        assert result.row_tokens(row) == out[0, len(prompt):].tolist(), f"row {row}"


def _transformers_mtp(b: Built, ids: list[int], hidden: torch.Tensor):
    """transformers' MTP layer (`MtpModel.layers[0]`, the `MtpLayer` that `generate(use_mtp=True)`
    runs, with the model's embedding, rotary and head) over the pairs (hidden_i, t_{i+1}) for
    i < len(ids) - 1, all at once under a causal mask. Returns (logits, the hidden it chains on).

    The layer is called directly rather than through `MtpModel.forward_layer`, whose mask plumbing
    does not know V3.2's `indexed_attention` layers; its positions are the tokens' (i + 1), as
    transformers gives them, ours are i: RoPE only sees differences, so both agree."""
    count = len(ids) - 1
    with torch.no_grad():
        embeds = b.mtp.embed_tokens(torch.tensor([ids[1:]]))
        positions = torch.arange(1, count + 1)[None]
        causal = torch.full((count, count), float("-inf")).triu(1)[None, None]
        out_hidden = b.mtp.layers[0](embeds, hidden[:, :count], position_embeddings=b.mtp.rotary_emb(embeds, positions),
                                     attention_mask=causal, position_ids=positions, cache=None)
        return b.mtp._project_to_logits(out_hidden)[0].numpy(), out_hidden[0].numpy()


def test_mtp_drafts_equal_transformers_mtp(built):
    """The MTP module on a checkpoint written in DeepSeek's layout drafts what transformers' MtpModel
    drafts on the same weights, fed the target's hidden state AFTER the final norm (what
    `MTPCandidateGenerator` takes from `hidden_states[-1]`); and that choice matters: the pre-norm
    hidden drafts differently. The MTP's own output hidden (what a chain feeds back) matches too."""
    case, b = built
    model, ids = b.model, PROMPTS[2]
    length = len(ids)
    cache = model.init_cache(1, length, page_size=4)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    _, hidden, _ = model(jnp.asarray([ids], jnp.int32), positions, cache, _vis([0], [length]), form="expanded",
                         backend="xla")
    mtp_cache = model.init_cache(1, length, page_size=4, mtp=True)
    draft_logits, draft_hidden, _ = model.draft(jnp.asarray([ids[1:]], jnp.int32), hidden[:, :-1], positions[:, :-1],
                                                mtp_cache, _vis([0], [length - 1]), form="expanded", backend="xla")

    captured = {}
    handle = b.hf.model.layers[-1].register_forward_hook(lambda module, args, out: captured.update(pre_norm=out))
    hf_out = _hf_logits(b.hf, ids, output_hidden_states=True)
    handle.remove()
    post_norm = hf_out.hidden_states[-1]
    np.testing.assert_allclose(np.asarray(hidden[0]), post_norm[0].numpy(), rtol=1e-4, atol=1e-4)

    reference_logits, reference_hidden = _transformers_mtp(b, ids, post_norm)
    np.testing.assert_allclose(np.asarray(draft_logits[0]), reference_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.argmax(np.asarray(draft_logits[0]), -1), np.argmax(reference_logits, -1))
    np.testing.assert_allclose(np.asarray(draft_hidden[0]), reference_hidden, rtol=1e-4, atol=1e-4)

    # Fed the pre-norm hidden, transformers' MTP drafts something else: far (100x) outside the
    # tolerance the post-norm feed meets, so this test tells the two apart.
    pre_norm_logits, _ = _transformers_mtp(b, ids, captured["pre_norm"])
    assert np.abs(pre_norm_logits - reference_logits).max() > 1e-2


def test_transformers_config_json_forms(tmp_path):
    """What transformers 5 writes for both model types reads back as the config it describes."""
    for config in (transformers.DeepseekV3Config(**BASE, rope_parameters=yarn(4.0, 1.0, 0.5)),
                   transformers.DeepseekV32Config(**BASE, index_topk=4, **V32)):
        config.save_pretrained(tmp_path / config.model_type)
        ours = ModelConfig.from_hf(tmp_path / config.model_type)
        assert ours.model_type == config.model_type
        assert ours.first_k_dense_replace == min(config.first_k_dense_replace, config.num_hidden_layers)
        assert ours.softmax_scale == pytest.approx(
            transformers.models.deepseek_v3.modeling_deepseek_v3.yarn_apply_mscale(
                config.rope_parameters, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5))
