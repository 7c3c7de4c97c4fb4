"""The `jaxspec` command line.

    jaxspec convert SRC DST [--dtype bfloat16|float32|fp8]

    jaxspec aot --target h100|h200 [--devices N] (--preset NAME | --config config.json)
                --batch B --context C [--mtp K | --tree SPEC] [--phase prefill|decode] [--layers L]
                [--prefill-chunk C] [--cache-dtype fp8] [--unroll-layers]
                [--backend pallas|mosaic|xla|auto] [--tiles VARIANT] [--auto OP=IMPL ...]

`aot` compiles the model's prefill or one decode step for an NVIDIA GPU target without a GPU
(`jaxspec.aot`) and prints per-device memory, flops and bytes (XLA ops plus the Pallas kernels'),
the collectives, each Pallas kernel's launch resources and the compile time. `--tiles` compiles
the grouped matmul under another tile variant and `--auto` with another kernel for an op under
`--backend auto`, as `benchmarks/e2e_step.py` times them: what a GPU run of a variant will
launch, checked without one.

`convert` reads the Hugging Face checkpoint directory SRC tensor by tensor (FP8 weights
dequantized, or kept with --dtype fp8; progress on stderr), writes DST with
`jaxspec.orbax_io.save_model` (config.json plus an orbax params/ directory) and copies SRC's
tokenizer files, so that DST runs on its own: `examples/generate.py --checkpoint DST --dtype
bfloat16` restores it much faster than SRC converts. SRC may also be an orbax directory
(`jaxspec.checkpoint.load_model`): `jaxspec convert OLD NEW` rewrites a save from before the
decoder layers were stacked (one array per layer) in today's stacked layout, in the dtype it was
saved in unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import jax.numpy as jnp

from jaxspec import progress
from jaxspec.checkpoint import is_orbax_checkpoint, load_model
from jaxspec.flags import add_cache_dtype_flag, add_kernel_choice_flags, add_prefill_flag, checkpoint_dir
from jaxspec.orbax_io import save_model, saved_dtype
from jaxspec.platforms import use_cpu_without_nvidia_driver

# --dtype choices. "fp8" keeps a checkpoint's float8_e4m3fn weights and their 128 x 128 block scales
# as they are, computing in bfloat16 (`jaxspec.fp8`); "bfloat16" / "float32" dequantize them.
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8": jnp.float8_e4m3fn}
FP8_HELP = "fp8 keeps the checkpoint's float8_e4m3fn weights and 128x128 block scales (computing in bfloat16)"
# Everything a tokenizer or `generate` reads besides config.json (which save_model writes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def convert(src: str, dst: str, *, dtype=None) -> None:
    """Convert the Hugging Face checkpoint, or orbax save, `src` into the orbax directory `dst`
    (parameters in `dtype`, layers stacked as the model holds them). dtype None: bfloat16 from a
    Hugging Face checkpoint; an orbax save keeps the dtype it was saved in (`saved_dtype`), so
    rewriting an old save in today's layout, as `restore_model`'s message suggests, changes no bit."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"convert: SRC and DST are the same directory ({src}); choose a new DST")
    if dtype is None:
        dtype = saved_dtype(src) if is_orbax_checkpoint(src) else jnp.bfloat16
    start = time.perf_counter()
    model = load_model(src, dtype=dtype, log=_log)
    loaded = time.perf_counter()
    with progress.elapsed(f"writing {dst}"):
        save_model(model, dst)
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    for name in copied:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    _log(f"wrote {dst} in {time.perf_counter() - loaded:.1f} s (conversion {loaded - start:.1f} s)"
         f"{'; copied ' + ', '.join(copied) if copied else '; no tokenizer files to copy'}")


def mesh_shape(text: str) -> tuple[int, int]:
    """argparse type: `DATAxMODEL`, e.g. `1x8`."""
    try:
        data, model = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DATAxMODEL like 1x8, got {text!r}") from None
    if data < 1 or model < 1:
        raise argparse.ArgumentTypeError(f"both mesh sizes must be >= 1, got {text!r}")
    return data, model


def aot(args: argparse.Namespace) -> None:
    """`jaxspec aot`: compile and print the report (see the module docstring)."""
    if "JAX_PLATFORMS" not in os.environ:
        # The CUDA plugin registers without a GPU driver only when CUDA is not a requested platform.
        import jax

        jax.config.update("jax_platforms", "cpu")
    from jaxspec import aot as instrument
    from jaxspec.aot.model import compile_model, reduced_depth
    from jaxspec.decode_config import DecodeConfig
    from jaxspec.model_config import ModelConfig
    from jaxspec.pallas_kernels.backend import auto_kernels
    from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT, tile_variant
    from jaxspec.presets import preset

    config = preset(args.preset) if args.config is None else ModelConfig.from_hf(args.config)
    if args.layers is not None:
        config = reduced_depth(config, args.layers)
    decode = DecodeConfig(num_draft=args.mtp, tree=args.tree, backend=args.backend, prefill_chunk=args.prefill_chunk,
                          cache_dtype=args.cache_dtype, unroll_layers=args.unroll_layers)
    memory = {} if args.device_memory is None else dict(device_memory=int(args.device_memory * 2 ** 30))
    devices = instrument.gpu_devices(args.target, args.devices, hosts=args.hosts, **memory)
    with (progress.elapsed(f"compiling the {args.phase} for {args.devices} x {args.target}"),
          tile_variant(args.tiles), auto_kernels(**dict(args.auto))):  # both read while tracing
        compiled = compile_model(config, decode, phase=args.phase, batch=args.batch, context=args.context,
                                 devices=devices, dtype=DTYPES[args.dtype], dump_dir=args.dump_dir,
                                 fail_on_spill=args.fail_on_spills, mesh_shape=args.mesh, plan=args.plan)
    drafting = f"tree {args.tree}" if args.tree else (f"MTP chain k={args.mtp}" if args.mtp else "plain")
    mesh = f", mesh {args.mesh[0]}x{args.mesh[1]} plan {args.plan}" if args.mesh else ""
    title = (f"{args.phase} of {args.preset or args.config} ({config.num_hidden_layers} layers, {args.dtype}), "
             f"{drafting}, batch {args.batch}, context {args.context}"
             f"{f', prefill chunks of {args.prefill_chunk}' if args.prefill_chunk else ''}"
             f"{f', {args.cache_dtype} caches' if args.cache_dtype else ''}, backend {args.backend}"
             f"{''.join(f', auto {op}={impl}' for op, impl in args.auto)}"
             f"{f', grouped matmul tiles {args.tiles}' if args.tiles != DEFAULT_VARIANT else ''}"
             f"{', layers unrolled' if args.unroll_layers else ''}; "
             f"{args.devices} x {devices[0].device_kind}{f' on {args.hosts} hosts' if args.hosts > 1 else ''}{mesh}")
    print(instrument.report(compiled, title))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec", description="jaxspec tools")
    commands = parser.add_subparsers(dest="command", required=True)
    convert_parser = commands.add_parser(
        "convert", help="Hugging Face checkpoint directory (or older orbax save) -> orbax directory (fast to restore)",
        description="Convert a Hugging Face DeepSeek-V3/V3.2/V4 checkpoint (safetensors, FP8 or not) "
                    "into an orbax directory that restores quickly, or rewrite an orbax save from before "
                    "the decoder layers were stacked in today's layout.")
    convert_parser.add_argument("src", type=checkpoint_dir,
                                help="Hugging Face checkpoint directory (config.json + *.safetensors), or an "
                                     "orbax directory (config.json + params/)")
    convert_parser.add_argument("dst", help="output directory (config.json + params/ + tokenizer files)")
    convert_parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                                help="parameter dtype (default: bfloat16 from a Hugging Face checkpoint; an orbax "
                                     f"save keeps the dtype it was saved in); {FP8_HELP}")
    aot_parser = commands.add_parser(
        "aot", help="compile prefill or a decode step for an H100/H200 without a GPU and report its costs",
        description="Compile the model's prefill or one speculative decode step for NVIDIA GPUs on this host "
                    "(needs pip install 'jax[cuda12]==<jax version>') and print memory, flops, bytes, "
                    "collectives, Pallas kernel resources and the compile time.")
    aot_parser.add_argument("--target", choices=("h100", "h200"), default="h100", help="GPU (default h100: H100 SXM)")
    aot_parser.add_argument("--devices", type=int, default=1, help="devices in all (default 1)")
    aot_parser.add_argument("--hosts", type=int, default=1, help="nodes the devices are spread over (default 1)")
    model_source = aot_parser.add_mutually_exclusive_group(required=True)
    model_source.add_argument("--preset", help="a jaxspec.presets preset, e.g. deepseek-v3.2")
    model_source.add_argument("--config", help="a Hugging Face config.json")
    aot_parser.add_argument("--batch", type=int, required=True, help="rows B")
    aot_parser.add_argument("--context", type=int, required=True, help="cached tokens per row (decode) or prompt length (prefill)")
    drafting = aot_parser.add_mutually_exclusive_group()
    drafting.add_argument("--mtp", type=int, default=0, help="MTP chain length k (default 0: plain decoding)")
    drafting.add_argument("--tree", help="a draft tree: a static tree's name or 'top_k,depth,budget'")
    aot_parser.add_argument("--phase", choices=("prefill", "decode"), default="decode")
    aot_parser.add_argument("--layers", type=int, help="decoder layers (reduced depth, full width; default: all)")
    add_prefill_flag(aot_parser)
    add_cache_dtype_flag(aot_parser)
    aot_parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                            help=f"parameter dtype; {FP8_HELP}")
    aot_parser.add_argument("--backend", choices=("pallas", "mosaic", "xla", "auto"), default="pallas",
                            help="kernels: Triton (pallas), Mosaic GPU where an op has one (mosaic), the references "
                                 "(xla), or what auto runs on the target (backend.AUTO_KERNELS, Triton where it "
                                 "names none; --auto changes an entry)")
    add_kernel_choice_flags(aot_parser)
    aot_parser.add_argument("--dump-dir", help="keep XLA's dump here (default: a temporary directory)")
    aot_parser.add_argument("--fail-on-spills", action="store_true",
                            help="fail when a kernel of XLA's PTX spills registers, as XLA does it: without naming "
                                 "the kernel (default: compile, and the report names every kernel that spills)")
    aot_parser.add_argument("--unroll-layers", action="store_true",
                            help="compile the decoder layers unrolled instead of as scans (DecodeConfig.unroll_layers)")
    aot_parser.add_argument("--mesh", type=mesh_shape, metavar="DATAxMODEL",
                            help="compile generate's sharded programs for a DATA x MODEL mesh of the --devices "
                                 "(jaxspec.sharding; default: one device, nothing sharded)")
    aot_parser.add_argument("--plan", choices=("dp", "tp"), default="dp", help="sharding plan with --mesh (default dp)")
    aot_parser.add_argument("--device-memory", type=float, metavar="GIB",
                            help="compile for devices with this much memory (default: the target's); a large "
                                 "value keeps XLA from recomputing values to fit, for costing")
    args = parser.parse_args(argv)
    use_cpu_without_nvidia_driver()
    try:
        if args.command == "aot":
            if args.tree is not None and args.mtp == 0:
                args.mtp = 1  # a tree drafts with the MTP module; its nodes, not num_draft, decide the drafts
            aot(args)
        else:
            convert(args.src, args.dst, dtype=None if args.dtype is None else DTYPES[args.dtype])
    except (ValueError, RuntimeError) as error:
        # XLA names no kernel when it refuses a spill (--fail-on-spills); the report names them.
        hint = (" (a kernel spills registers: without --fail-on-spills the report names every kernel that spills)"
                if "register spilling" in str(error) else "")
        _log(f"jaxspec {args.command}: error: {error}{hint}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
