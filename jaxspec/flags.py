"""Command-line flags shared by the example and benchmark scripts."""

from __future__ import annotations

import argparse
import os

from jaxspec.pallas_kernels.backend import BACKENDS, check_auto_choices
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT, VARIANTS
from jaxspec.trees import STATIC_TREES, parse_tree

# The presets small enough to build and run on a CPU, with the byte tokenizer's vocabulary.
CPU_PRESETS = ("tiny", "tiny-v3", "tiny-v4")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag in its error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def checkpoint_dir(text: str) -> str:
    """argparse type: a checkpoint directory, one that holds `config.json` (Hugging Face safetensors or
    a `jaxspec convert` output); the error says which of the two it is not."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: {'not a directory' if os.path.exists(text) else 'no such directory'}")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text}: no config.json in it, so not a checkpoint directory (Hugging Face "
                                         "safetensors or a `jaxspec convert` output)")
    return text


def tree_spec(text: str) -> str:
    """argparse type: a named static tree or `top_k,depth,budget` (checked, returned as given)."""
    try:
        parse_tree(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def relaxed_spec(text: str) -> tuple[int, float]:
    """argparse type: `top_k,delta` for relaxed acceptance, e.g. `3,0.1` (ranges checked by DecodeConfig)."""
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected top_k,delta like 3,0.1, got {text!r}") from None


def auto_choice(text: str) -> tuple[str, str]:
    """argparse type: `OP=IMPL`, what backend "auto" runs for OP on a GPU as an `AUTO_KERNELS` entry
    would (checked by `backend.check_auto_choices`)."""
    op, _, implementation = text.partition("=")
    try:
        check_auto_choices({op: implementation})
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return op, implementation


def add_kernel_choice_flags(parser: argparse.ArgumentParser) -> None:
    """--tiles (the grouped matmul's tile variant: `grouped_matmul_pallas.tile_variant`) and --auto
    OP=IMPL (`backend.auto_kernels`): a step compiled or timed as another variant or a flipped
    `AUTO_KERNELS` entry would run it."""
    parser.add_argument("--tiles", choices=VARIANTS, default=DEFAULT_VARIANT,
                        help=f"the grouped matmul's tile variant (default {DEFAULT_VARIANT})")
    parser.add_argument("--auto", type=auto_choice, nargs="+", default=[], metavar="OP=IMPL",
                        help="what backend auto runs for OP, as an AUTO_KERNELS entry would "
                             "(e.g. grouped_matmul=mosaic)")


TREE_HELP = (f"draft tree: one of {', '.join(sorted(STATIC_TREES))} (static), or top_k,depth,budget for a dynamic "
             "EAGLE-2 tree (e.g. 4,4,12)")


def add_model_flags(parser: argparse.ArgumentParser, *, default_preset: str) -> None:
    """--preset (the model's shape) and --backend (its attention kernels)."""
    parser.add_argument("--preset", choices=CPU_PRESETS, default=default_preset,
                        help="model shape: tiny is DeepSeek-V3.2 (DSA), tiny-v3 the same without the indexer, tiny-v4 "
                             "DeepSeek-V4 (sliding, CSA and HCA layers, mHC, hash routing) "
                             f"(default: {default_preset})")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="the kernels: xla (pure-jnp references), pallas (Triton), mosaic (Mosaic GPU where "
                             "the op has one, else Triton), or auto (on a GPU the kernel measured fastest on its "
                             "kind, backend.AUTO_KERNELS; the references elsewhere)")


def add_cache_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """--cache-dtype: `DecodeConfig.cache_dtype` (None when absent: the model's compute dtype)."""
    parser.add_argument("--cache-dtype", choices=("fp8",),
                        help="store the caches as DeepSeek serves V3.2: the MLA latent in FlashMLA's FP8 token "
                             "(656 bytes at DeepSeek's widths), the indexer keys rotated and in FP8; for DeepSeek-V4 "
                             "the window and compressed entries in FlashMLA's V4 token (584 bytes packed) (default: "
                             "the model's compute dtype)")


def add_prefill_flag(parser: argparse.ArgumentParser) -> None:
    """--prefill-chunk: `DecodeConfig.prefill_chunk` (None when absent: the one-call prefill)."""
    parser.add_argument("--prefill-chunk", type=positive_int, metavar="C",
                        help="run the prompt through the model C tokens per call (a loop inside the compiled "
                             "prefill) instead of in one call: the prefill's activations and DeepSeek-V4's rings "
                             "are then sized by C, not by the prompt (default: one call)")
