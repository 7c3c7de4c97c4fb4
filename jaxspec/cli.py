"""The `jaxspec` command line.

    jaxspec convert SRC DST [--dtype bfloat16]

`convert` reads the Hugging Face checkpoint directory SRC tensor by tensor (FP8 weights
dequantized, progress on stderr), writes DST with `jaxspec.orbax_io.save_model` (config.json plus
an orbax params/ directory) and copies SRC's tokenizer files, so that DST runs on its own:
`examples/generate.py --checkpoint DST --dtype bfloat16` restores it much faster than SRC converts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import jax.numpy as jnp

from jaxspec.checkpoint import load_hf_checkpoint
from jaxspec.orbax_io import save_model

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# Everything a tokenizer or `generate` reads besides config.json (which save_model writes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def convert(src: str, dst: str, *, dtype=jnp.bfloat16) -> None:
    """Convert the Hugging Face checkpoint `src` into the orbax directory `dst` (parameters in `dtype`)."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"convert: SRC and DST are the same directory ({src}); choose a new DST")
    start = time.perf_counter()
    model = load_hf_checkpoint(src, dtype=dtype, log=_log)
    loaded = time.perf_counter()
    save_model(model, dst)
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    for name in copied:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    _log(f"wrote {dst} in {time.perf_counter() - loaded:.1f} s (conversion {loaded - start:.1f} s)"
         f"{'; copied ' + ', '.join(copied) if copied else '; no tokenizer files to copy'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec", description="jaxspec tools")
    commands = parser.add_subparsers(dest="command", required=True)
    convert_parser = commands.add_parser(
        "convert", help="Hugging Face checkpoint directory -> orbax directory (fast to restore)",
        description="Convert a Hugging Face DeepSeek-V3/V3.2 checkpoint (safetensors, FP8 or not) "
                    "into an orbax directory that restores quickly.")
    convert_parser.add_argument("src", help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    convert_parser.add_argument("dst", help="output directory (config.json + params/ + tokenizer files)")
    convert_parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                                help="parameter dtype of the converted model (default: bfloat16)")
    args = parser.parse_args(argv)
    try:
        convert(args.src, args.dst, dtype=DTYPES[args.dtype])
    except ValueError as error:
        _log(f"jaxspec convert: error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
