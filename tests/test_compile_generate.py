"""`compile_generate`: ahead-of-time compiled `generate` returns what `generate` returns."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import compile_generate, generate
from jaxspec.models import DeepseekV3
from jaxspec.presets import preset


def test_compiled_run_equals_generate():
    model = DeepseekV3(preset("tiny-v3"), rngs=nnx.Rngs(3))
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    config = DecodeConfig(num_draft=2, max_new_tokens=6, backend="xla")
    run = compile_generate(model, prompts, config)
    expected = generate(model, prompts, config)
    for result in (run(), run()):  # each run donates new empty caches: the prepared batch stays reusable
        np.testing.assert_array_equal(result.tokens, expected.tokens)
        np.testing.assert_array_equal(result.num_tokens, expected.num_tokens)
        np.testing.assert_array_equal(result.position_accepts, expected.position_accepts)


def test_donated_caches_leave_the_callers_page_table_alone():
    """generate and compile_generate donate their caches, never the caller's page table."""
    model = DeepseekV3(preset("tiny-v3"), rngs=nnx.Rngs(3))
    prompts = [[5, 6, 7], [10, 11]]
    config = DecodeConfig(num_draft=1, max_new_tokens=4, backend="xla")
    page_table = jnp.arange(4, dtype=jnp.int32)[::-1].reshape(2, 2)  # rows own pages in reverse order
    run = compile_generate(model, prompts, config, page_table=page_table)
    first, second = run(), run()
    result = generate(model, prompts, config, page_table=page_table)
    np.testing.assert_array_equal(first.tokens, result.tokens)
    np.testing.assert_array_equal(second.tokens, result.tokens)
    np.testing.assert_array_equal(np.asarray(page_table), [[3, 2], [1, 0]])


def test_bad_input_fails_before_compiling():
    model = DeepseekV3(preset("tiny-v3"), rngs=nnx.Rngs(3))
    with pytest.raises(ValueError, match="empty"):
        compile_generate(model, [[1, 2], []], DecodeConfig(num_draft=1, max_new_tokens=4))
