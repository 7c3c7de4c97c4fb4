"""`tests/mosaic_native_probe.py`, the by-hand check that every shape the Mosaic tests interpret
also compiles for sm_90a: its wrapper compiles an interpreted call's shapes as the native kernel
(here a stand-in with the kernels' calling convention), once per shape, records a compile that
fails, and leaves the argument checks' own cases alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mosaic_native_probe as probe
from jaxspec import aot


def kernel(x, weights, *, scale: float, interpret: bool):
    """A stand-in: arrays positional and by keyword, static floats and the interpret flag."""
    if x.dtype != jnp.bfloat16:
        raise ValueError("kernel: bfloat16 only")
    return (x.astype(jnp.float32) * weights).sum(axis=-1) * scale


def test_an_interpreted_call_is_compiled_natively_once_and_a_failure_recorded(h100, monkeypatch):
    monkeypatch.setattr(probe, "_compiled", {})
    wrapped = probe._probed(kernel)
    x, weights = jnp.ones((4, 8), jnp.bfloat16), jnp.arange(8, dtype=jnp.float32)
    np.testing.assert_array_equal(wrapped(x, weights=weights, scale=0.5, interpret=True),
                                  kernel(x, weights=weights, scale=0.5, interpret=True))
    assert list(probe._compiled.values()) == [None]
    wrapped(x + 1, weights=weights, scale=0.5, interpret=True)  # the same shapes: not compiled again
    wrapped(x, weights=weights, scale=0.5, interpret=False)  # a native call: nothing to probe
    assert len(probe._compiled) == 1

    def refuse(*_, **__):
        raise RuntimeError("refused")

    monkeypatch.setattr(aot, "compile_gpu", refuse)
    wrapped(x[:2], weights=weights, scale=0.5, interpret=True)
    assert sorted(map(str, probe._compiled.values())) == ["None", "RuntimeError: refused"]


def test_a_refused_call_raises_and_is_not_compiled(monkeypatch):
    monkeypatch.setattr(probe, "_compiled", {})
    with pytest.raises(ValueError, match="bfloat16 only"):
        probe._probed(kernel)(jnp.ones((4, 8)), weights=jnp.ones(8), scale=1.0, interpret=True)
    assert probe._compiled == {}
