"""Prompts fed through the decoding loop (`DecodeConfig.prefill_in_loop`): with window_invariant
the tokens equal those after a prefill program in chunks of the same width (greedy, a tree,
plain sampling; V3.2 and V4), rows in their prompts share the loop's calls with rows already
decoding, the step-by-step API gives `generate`'s result, the compiled program holds no prefill
calls, and the settings that conflict are refused. (On a mesh: tests/sharding_checks.py.)

The prompts (test_v4_loop's, 2 .. 31 tokens) end in different steps: the 2-token rows decode
while the 31-token row is still in its prompt.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxspec.batch import prepare
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import _generate, generate
from jaxspec.loop import _step, init_state, row_sampling, step
from jaxspec.memory_plan import plan_memory
from jaxspec.models import DeepseekV3
from jaxspec.presets import preset
from jaxspec.sampling import base_key
from test_tree_decoding import equation_count
from test_v4_loop import PROMPTS, config

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.mark.parametrize("model_name, changes", [
    ("trained_v32", dict(num_draft=3)),
    ("trained_v32", dict(num_draft=3, tree="small")),
    ("trained_v32", dict(num_draft=0, temperature=0.8)),
    ("trained_v4", dict(num_draft=2)),
], ids=["v32-k3", "v32-tree", "v32-sampled-plain", "v4-k2"])
def test_prompts_through_the_loop_emit_what_a_prefill_program_does(model_name, changes, request):
    """window_invariant: the target computes each prompt token as if alone, so the first token
    and every later token equal those of a prefill program in chunks of D + 1 (the
    loop's prompt width, and V4's ring width in both), bit for bit; plain sampling draws with the
    same keys (a row's own step count). (Speculative sampling's draws depend on the drafts too,
    and the MTP's calls are not window-invariant.) The rows' prompts end in different steps, and
    no prompt step counts as a verification step (the k = 0 rows make exactly one call per token
    after the first)."""
    model = request.getfixturevalue(model_name)
    base = config(**changes, window_invariant=True)
    chunked = generate(model, PROMPTS, base.replace(prefill_chunk=base.max_depth + 1), key=5)
    looped = generate(model, PROMPTS, base.replace(prefill_in_loop=True), key=5)
    np.testing.assert_array_equal(np.asarray(looped.tokens), np.asarray(chunked.tokens))
    np.testing.assert_array_equal(np.asarray(looped.num_tokens), np.asarray(chunked.num_tokens))
    if base.draft_tree is None:
        np.testing.assert_array_equal(np.asarray(looped.target_calls), np.asarray(looped.num_tokens) - 1)
    else:
        assert looped.mean_accepted_length > 1.5


def test_step_by_step_runs_the_prompts_first(trained_v32):
    """`init_state` runs no model call and emits nothing; `step` feeds each row D + 1 prompt tokens
    until its prompt is cached, then the first token appears (after ceil(len / (D + 1)) steps),
    and stepping to the end gives `generate`'s tokens."""
    cfg = config(3, prefill_in_loop=True)
    state = init_state(trained_v32, PROMPTS, cfg)
    assert int(np.max(state.num_generated)) == 0 and int(np.max(state.target_cache.lengths)) == 0
    steps = 0
    lens = np.array([len(p) for p in PROMPTS])
    while not bool(state.done.all()):
        state = step(trained_v32, state, cfg)
        steps += 1
        cached = np.asarray(state.target_cache.lengths)
        in_prompt = steps < -(-lens // 4)
        np.testing.assert_array_equal(cached[in_prompt], 4 * steps)
        np.testing.assert_array_equal(np.asarray(state.num_generated)[in_prompt], 0)
        assert (np.asarray(state.num_generated)[~in_prompt] >= 1).all()
    expected = generate(trained_v32, PROMPTS, cfg)
    np.testing.assert_array_equal(np.asarray(state.tokens[:, :cfg.max_new_tokens]), np.asarray(expected.tokens))


def test_the_program_holds_no_prefill_calls():
    """The traced `generate` with prompts fed through the loop is the step plus a few equations:
    what the prefill adds is under a tenth of the prefill program it replaces (whose target and
    MTP calls are about as large as the step's; each call is a copy of the layers in the compiled
    program, which is what its compile time pays for)."""
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))  # the trace needs no trained weights
    graphdef, params = nnx.split(model)
    sizes = {}
    for in_loop in (False, True):
        cfg = config(3, prefill_in_loop=in_loop)
        batch = prepare(model, PROMPTS, cfg)
        args = (batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache, base_key(0),
                row_sampling(cfg, len(PROMPTS)))
        whole = jax.make_jaxpr(lambda p, *a: _generate(graphdef, p, *a, cfg))(params, *args)
        state = jax.eval_shape(lambda: init_state(model, PROMPTS, cfg))
        alone = jax.make_jaxpr(lambda p, s: _step(graphdef, p, s, cfg))(params, state)
        sizes[in_loop] = equation_count(whole.jaxpr), equation_count(alone.jaxpr)
    (program, program_step), (looped, looped_step) = sizes[False], sizes[True]
    prefill_program = program - program_step
    assert prefill_program > 1000, sizes
    assert looped - program_step < prefill_program / 10, sizes


def test_settings():
    """The flag conflicts with a prefill program in chunks and takes booleans only; its memory plan
    has no prefill temporaries and carries the prompts in the loop state; a loop call feeds at
    most D + 1 prompt tokens."""
    with pytest.raises(ValueError, match="prefill_in_loop=True.*prefill_chunk=8"):
        DecodeConfig(prefill_in_loop=True, prefill_chunk=8)
    with pytest.raises(ValueError, match="prefill_in_loop=1"):
        DecodeConfig(prefill_in_loop=1)
    cfg = DecodeConfig(num_draft=3, prefill_in_loop=True)
    assert cfg.prefill_width(100) == 4 and cfg.prefill_width(2) == 2
    assert DecodeConfig(num_draft=0, prefill_in_loop=True).prefill_width(100) == 1
    plans = {in_loop: plan_memory(preset("tiny"), cfg.replace(prefill_in_loop=in_loop), batch=4, prompt_len=48)
             for in_loop in (False, True)}
    assert plans[True].prefill_temp == 0 < plans[False].prefill_temp
    assert plans[True].state == plans[False].state + 4 * (48 + 1) * 4
