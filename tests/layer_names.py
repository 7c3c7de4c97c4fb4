"""Stacked decoder parameters (`jaxspec.models.stack`) seen per layer, as checkpoints name them:
flat dicts {dotted path: array} converted between `layer_groups.1.0.mlp.gate_weight` [n, ...] and
one `layers.{i}.mlp.gate_weight` per layer (row r of the stack is layer `start + r * period + j`)."""

from __future__ import annotations

import numpy as np

from jaxspec.models import layer_runs


def layer_rows(path: str, config) -> tuple[list[int], str]:
    """The decoder layers whose rows stacked parameter `path` holds, in row order, and its path
    within the block; ([], path) for a parameter outside the stacks."""
    for run in layer_runs(config):
        for offset in range(run.period):
            prefix = run.locate(run.start + offset)[0]
            if path.startswith(prefix):
                return list(range(run.start + offset, run.stop, run.period)), path.removeprefix(prefix)
    return [], path


def per_layer_names(paths, config) -> list[str]:
    """The names `unstacked` gives the parameters `paths`."""
    names = []
    for path in paths:
        layers, rest = layer_rows(path, config)
        names += [f"layers.{layer}.{rest}" for layer in layers] if layers else [path]
    return names


def unstacked(params: dict, config) -> dict:
    """{path: value} -> each stacked parameter's rows as `layers.{i}.<path in the block>`, the rest as given."""
    out = {}
    for path, value in params.items():
        layers, rest = layer_rows(path, config)
        out.update({f"layers.{layer}.{rest}": value[row] for row, layer in enumerate(layers)} if layers
                   else {path: value})
    return out


def restacked(paths, per_layer: dict, config) -> dict:
    """`unstacked` inverted for the parameters `paths`: each stacked one from its layers' entries."""
    out = {}
    for path in paths:
        layers, rest = layer_rows(path, config)
        out[path] = np.stack([np.asarray(per_layer[f"layers.{layer}.{rest}"]) for layer in layers]) if layers \
            else per_layer[path]
    return out
