"""Command-line flags shared by the example and benchmark scripts."""

from __future__ import annotations

import argparse

from jaxspec.pallas_kernels.backend import BACKENDS

# The presets small enough to build and run on a CPU, with the byte tokenizer's vocabulary.
CPU_PRESETS = ("tiny", "tiny-v3")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag in its error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_flags(parser: argparse.ArgumentParser, *, default_preset: str) -> None:
    """--preset (the model's shape) and --backend (its attention kernels)."""
    parser.add_argument("--preset", choices=CPU_PRESETS, default=default_preset,
                        help="model shape: tiny is DeepSeek-V3.2 (DSA), tiny-v3 the same without the indexer "
                             f"(default: {default_preset})")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="attention kernels: xla (pure-jnp references), pallas, or auto (pallas on GPU)")
