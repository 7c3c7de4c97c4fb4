"""End to end through the Pallas kernels (interpret mode on CPU): the same greedy tokens as XLA."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate

PROMPTS = [list(b"the quick"), list(b"fox jumps over the lazy"), list(b"zq")]


@pytest.mark.parametrize("model_name", ["trained_v32", "trained_v3"])
def test_generate_pallas_equals_xla(model_name, request):
    """MTP k = 3: V3.2 runs the indexer and sparse-MLA kernels, V3 the dense MLA kernel."""
    model = request.getfixturevalue(model_name)
    results = {backend: generate(model, PROMPTS, DecodeConfig(num_draft=3, max_new_tokens=16, page_size=8,
                                                              backend=backend))
               for backend in ("xla", "pallas")}
    np.testing.assert_array_equal(np.asarray(results["pallas"].tokens), np.asarray(results["xla"].tokens))
    np.testing.assert_array_equal(np.asarray(results["pallas"].accepted), np.asarray(results["xla"].accepted))
    assert results["xla"].mean_accepted_length > 1.5
