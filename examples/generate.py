"""Generate text with MTP speculative decoding, and report speed and acceptance.

    python examples/generate.py                       # the shipped trained model, MTP k = 3
    python examples/generate.py --random              # random weights of the tiny preset (debugging)
    python examples/generate.py --mtp 0               # plain greedy decoding: the same text
    python examples/generate.py --tree eagle          # a static draft tree; --tree 4,4,12 a dynamic one
    python examples/generate.py --temperature 0.8 --top-p 0.95 --sample-seed 1   # lossless sampling
    python examples/generate.py --prompt "Hello" --prompt "Once upon" --batch 8 --max-new-tokens 128
    python examples/generate.py --random --preset tiny-v4 --prefill-chunk 16   # prompts run 16 tokens per call
    python examples/generate.py --checkpoint DeepSeek-V3.2-Exp/ --dtype bfloat16 --prompt "Hello"
    python examples/generate.py --checkpoint DeepSeek-V3.2-Exp/ --dtype fp8 --prompt "Hello"   # FP8 weights kept
    python examples/generate.py --checkpoint DIR --prompt-ids 1,2,3 --print-ids   # no tokenizer.json in DIR
    python examples/generate.py --checkpoint DIR --mesh 2x8 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
                                                      # host 0 of 2 (docs/multi-host.md); --distributed: auto-detected

Greedy speculative decoding is lossless: for one seed, every --mtp and --tree prints the same text;
only the speed and the acceptance statistics change. Sampling (--temperature > 0) is lossless in
distribution: the text is distributed as plain sampling's, drawn from one stream per row seeded by
--sample-seed (a runtime input, as are the temperature, top-k and top-p: changing them does not
recompile). --relaxed accepts close runners-up too, which is lossy: it changes the text. By default
the model is the shipped checkpoint `examples/checkpoints/tiny-stdlib`: a small DeepSeek-V3.2 (MLA,
DSA, MoE, MTP) that `examples/train_tiny.py` trained on the Python standard library's source, byte
by byte, so Python prompts get Python-flavoured text and most drafts are accepted. --random uses the
`tiny` preset (or `tiny-v3`) with random weights drawn from --seed instead: the text is noise and
few drafts are accepted. `generate` is compiled ahead of time and run once to warm up, so the decode
time excludes both. Prompts of at most 64 tokens run through the decoding loop's own calls
(`--prefill auto`), so the compiled program holds no prefill calls: it compiles in about 60% of the
time (docs/aot.md).

--checkpoint runs a real model instead: a Hugging Face DeepSeek-V3 / V3.2 / V4 directory (safetensors
as DeepSeek releases them or as transformers' `save_pretrained` writes them, FP8 or not; loaded
tensor by tensor) or one written by `jaxspec convert` (orbax, fast to restore).
Its `tokenizer.json` encodes --prompt; a directory without one takes --prompt-ids and prints ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import distributed, progress, sharding
from jaxspec.batch import budget_bucket, prompt_bucket
from jaxspec.checkpoint import load_model
from jaxspec.cli import DTYPES, FP8_HELP, mesh_shape
from jaxspec.decode_config import MAX_DRAFT_TOKENS, DecodeConfig
from jaxspec.flags import (TREE_HELP, add_cache_dtype_flag, add_model_flags, add_prefill_flag, checkpoint_dir,
                           positive_int, relaxed_spec, tree_spec)
from jaxspec.generation import compile_generate
from jaxspec.memory_plan import device_memory, plan_memory, readable
from jaxspec.model_config import ModelConfig
from jaxspec.models import DeepseekV3, model_class
from jaxspec.orbax_io import restore_model
from jaxspec.platforms import use_cpu_without_nvidia_driver
from jaxspec.pallas_kernels.backend import resolve_backend
from jaxspec.presets import preset
from jaxspec.tokenizer import Tokenizer, has_hf_tokenizer, load_tokenizer

DEFAULT_PROMPTS = ("import os\nimport sys\n\n\ndef ", "    def __repr__(self):\n        return ")
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "tiny-stdlib")
PREFILL_MODES = ("auto", "loop", "call")
# A prompt fed through the loop costs ceil(P / (k + 1)) steps. Up to this length (the examples'
# prompts, a notebook's) those steps cost less than compiling a prefill program; past it a long
# prompt would take many steps on a GPU, where one prefill call reads the weights once.
LOOP_PREFILL_MAX = 64


def token_ids(text: str) -> list[int]:
    """argparse type: comma-separated token ids, e.g. `1,2,3`."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help=f"a prompt; repeat for several (default: {' / '.join(DEFAULT_PROMPTS)})")
    parser.add_argument("--batch", type=positive_int,
                        help="rows to decode together; the prompts are cycled to fill them (default: one per prompt)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per row")
    parser.add_argument("--mtp", type=int, default=3,
                        help=f"k, draft tokens per step from the MTP module, 0..{MAX_DRAFT_TOKENS} (0 = plain decoding)")
    parser.add_argument("--tree", type=tree_spec, help=f"{TREE_HELP}; replaces the chain of --mtp drafts")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the most likely tokens holding this probability (1 = off)")
    parser.add_argument("--relaxed", type=relaxed_spec, metavar="TOP_K,DELTA",
                        help="LOSSY relaxed acceptance: also accept a draft among the target's TOP_K tokens "
                             "within DELTA of the top-1 probability (greedy only)")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the sampling streams (one per row)")
    parser.add_argument("--random", action="store_true",
                        help="random weights of --preset (seeded by --seed) instead of the shipped trained model")
    parser.add_argument("--seed", type=int, help="seed of the random model weights (with --random; default 0)")
    add_model_flags(parser, default_preset="tiny")
    parser.set_defaults(preset=None)  # given without --random it would be ignored: refused below
    parser.add_argument("--page-size", type=positive_int, default=64, help="cache slots per page")
    add_prefill_flag(parser)
    parser.add_argument("--prefill", choices=PREFILL_MODES, default="auto",
                        help="loop: feed the prompts through the decoding loop's own calls, k + 1 tokens per step "
                             "(no prefill program to compile: about 40%% of the tiny model's compile); call: a "
                             "prefill program (in --prefill-chunk chunks when given); auto (default): loop for "
                             f"prompts of at most {LOOP_PREFILL_MAX} tokens without --prefill-chunk, else call")
    add_cache_dtype_flag(parser)
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="keep compiled programs in DIR (JAX's persistent compilation cache): a later run "
                             "with the same model and settings loads them instead of compiling (the XLA compile "
                             "is nearly all of a full-depth model's compile time); a --max-new-tokens or prompts "
                             "in the same bucket, or another --temperature or --sample-seed, count as the same")
    parser.add_argument("--mesh", type=mesh_shape, metavar="DATAxMODEL",
                        help="run on a DATA x MODEL device mesh (jaxspec.sharding), e.g. 1x8 on an 8-GPU node, "
                             "2x8 over two with --distributed (default: one device)")
    parser.add_argument("--plan", choices=sharding.PLANS, default=sharding.DEFAULT_PLAN,
                        help="how --mesh splits the model: dp = attention data-parallel over rows, tp = attention "
                             "heads over MODEL; the routed experts are split over every device in both")
    parser.add_argument("--distributed", action="store_true",
                        help="several hosts, auto-detected: run the same command on every host; the coordinator "
                             "and process ids come from the cluster's environment (SLURM, Open MPI, or "
                             "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="several hosts, explicitly: process 0's address, the same on every host "
                             "(with --num-processes and --process-id)")
    parser.add_argument("--num-processes", type=positive_int, metavar="N", help="processes in all (with --coordinator)")
    parser.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (with --coordinator)")
    parser.add_argument("--peer-timeout", type=positive_int, default=100, metavar="S",
                        help="several hosts: a process silent for S seconds is lost and the others exit with an "
                             "error naming it; a finishing process waits at most S seconds for the others")
    parser.add_argument("--init-timeout", type=positive_int, default=300, metavar="S",
                        help="several hosts: seconds to wait for every process to join")
    parser.add_argument("--checkpoint", metavar="DIR", type=checkpoint_dir,
                        help="run this checkpoint (Hugging Face safetensors, or a `jaxspec convert` output) "
                             "instead of the shipped model")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help=f"parameter dtype of --checkpoint (default float32); {FP8_HELP}")
    parser.add_argument("--prompt-ids", action="append", type=token_ids, metavar="IDS",
                        help="a prompt as token ids, e.g. 1,2,3; repeat for several (instead of --prompt)")
    parser.add_argument("--print-ids", action="store_true", help="print token ids instead of text")
    args = parser.parse_args(argv)

    if args.random and args.checkpoint is not None:
        parser.error("--random and --checkpoint: choose one model")
    ignored = [flag for flag, value in (("--preset", args.preset), ("--seed", args.seed)) if value is not None]
    if ignored and not args.random:
        parser.error(f"{' and '.join(ignored)}: the random model's shape and weights; add --random "
                     "(without it the shipped trained model runs, or --checkpoint's)")
    if args.dtype is not None and args.checkpoint is None:
        parser.error("--dtype: the dtype --checkpoint's weights are loaded in; the shipped and random models run "
                     "in float32")
    args.preset, args.seed, args.dtype = args.preset or "tiny", args.seed or 0, args.dtype or "float32"
    if args.prefill == "loop" and args.prefill_chunk is not None:
        parser.error(f"--prefill loop feeds the prompts through the decoding loop, --prefill-chunk "
                     f"{args.prefill_chunk} runs a prefill program in chunks: choose one")
    if args.prompts and args.prompt_ids:
        parser.error("--prompt and --prompt-ids: give one kind of prompt")
    if args.checkpoint is not None and not has_hf_tokenizer(args.checkpoint):
        if not args.prompt_ids:
            parser.error(f"--checkpoint {args.checkpoint}: no tokenizer.json there; give --prompt-ids (e.g. 1,2,3)")
        args.print_ids = True
    args.prompts = args.prompt_ids or args.prompts or list(DEFAULT_PROMPTS)
    vocab = model_vocab(args) if args.prompt_ids else None
    outside = [] if vocab is None else sorted({i for ids in args.prompt_ids for i in ids if i >= vocab})
    if outside:
        parser.error(f"--prompt-ids: token ids must be in [0, {vocab}), the model's vocabulary; got {outside[:5]}")
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in explicit) and (None in explicit or args.distributed):
        parser.error("--coordinator, --num-processes, --process-id: give all three (or --distributed alone)")
    if args.coordinator is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id}: must be in [0, {args.num_processes - 1}]")
    if any(not p for p in args.prompts):
        parser.error("--prompt: prompts must not be empty")
    if args.batch is None:
        args.batch = len(args.prompts)
    elif args.batch < len(args.prompts):
        parser.error(f"--batch {args.batch}: smaller than the number of prompts ({len(args.prompts)})")
    if not 0 <= args.mtp <= MAX_DRAFT_TOKENS:
        parser.error(f"--mtp {args.mtp}: must be in [0, {MAX_DRAFT_TOKENS}]")
    try:
        DecodeConfig(**draft_options(args))
    except ValueError as error:
        parser.error(str(error))
    return args


def model_vocab(args: argparse.Namespace) -> int | None:
    """The vocabulary size of the model the flags choose, read from its config alone, so that bad
    --prompt-ids are refused before any weights load. None where the config does not read: loading
    the checkpoint then says what is wrong with it."""
    if args.random:
        return preset(args.preset).vocab_size
    try:
        return ModelConfig.from_hf(os.path.join(args.checkpoint or DEFAULT_CHECKPOINT, "config.json")).vocab_size
    except (OSError, ValueError):
        return None


def draft_options(args: argparse.Namespace) -> dict:
    """The DecodeConfig fields that choose the drafts and the acceptance rule."""
    return dict(num_draft=args.mtp, tree=args.tree, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, relaxed=args.relaxed)


def describe_decoding(args: argparse.Namespace) -> str:
    """E.g. `MTP tree eagle, sampling (temperature 0.8, top-k 0, top-p 0.95, seed 1)`."""
    drafts = f"MTP tree {args.tree}" if args.tree else f"MTP k={args.mtp}"
    if args.temperature > 0:
        return (f"{drafts}, sampling (temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
                f"seed {args.sample_seed})")
    if args.relaxed:
        return f"{drafts}, greedy with relaxed acceptance top-k {args.relaxed[0]}, delta {args.relaxed[1]} (LOSSY)"
    return f"{drafts}, greedy"


def prefill_in_loop(args: argparse.Namespace, longest_prompt: int) -> bool:
    """`DecodeConfig.prefill_in_loop` for --prefill (auto: prompts up to LOOP_PREFILL_MAX tokens
    without --prefill-chunk; `parse_args` refuses loop with --prefill-chunk)."""
    if args.prefill == "auto":
        return args.prefill_chunk is None and longest_prompt <= LOOP_PREFILL_MAX
    return args.prefill == "loop"


def build_model(args: argparse.Namespace, mesh) -> tuple[DeepseekV3, Tokenizer | None, str]:
    """The model (a checkpoint loaded straight onto `mesh` when there is one), its tokenizer (None:
    token ids only), and a line saying where the weights came from."""
    if args.checkpoint is not None:
        try:
            model = load_model(args.checkpoint, dtype=DTYPES[args.dtype], mesh=mesh, plan=args.plan)
        except ValueError as error:  # e.g. --dtype fp8 and a checkpoint without FP8 weights
            raise SystemExit(f"--checkpoint {args.checkpoint} --dtype {args.dtype}: {error}") from None
        if has_hf_tokenizer(args.checkpoint):
            return model, load_tokenizer(args.checkpoint), f"{args.dtype} weights, its tokenizer.json"
        return model, None, f"{args.dtype} weights, token ids (no tokenizer.json)"
    if not args.random:
        return (restore_model(DEFAULT_CHECKPOINT, mesh=mesh, plan=args.plan), load_tokenizer(None),
                f"trained weights ({os.path.relpath(DEFAULT_CHECKPOINT)}), byte tokenizer")
    config = preset(args.preset)
    model = model_class(config)(config, rngs=nnx.Rngs(args.seed))
    return model, load_tokenizer(None), f"random weights (seed {args.seed}), byte tokenizer"


def encode(prompt: str | list[int], tokenizer: Tokenizer | None, args: argparse.Namespace) -> list[int]:
    """A prompt's ids: --prompt-ids as given; text through the tokenizer, after the BOS token for a
    checkpoint's own tokenizer (DeepSeek's models expect it; the tiny byte models are trained without)."""
    if isinstance(prompt, list):
        return prompt
    bos = getattr(tokenizer, "bos_token_id", None) if args.checkpoint is not None else None
    return ([bos] if bos is not None else []) + tokenizer.encode(prompt)


def join_processes(args: argparse.Namespace) -> None:
    """Join the multi-process run (`jaxspec.distributed`), refuse to go on unless every process was
    given the same model and settings, and leave printing to process 0."""
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               initialization_timeout=args.init_timeout, heartbeat_timeout=args.peer_timeout,
                               shutdown_timeout=args.peer_timeout)
    except (ValueError, TimeoutError) as error:
        raise SystemExit(f"--coordinator {args.coordinator}: {error}") from None
    if jax.process_index() != 0:  # every process runs the same program; one prints (so does the C++ runtime)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if jax.process_count() > 1 and (args.random or args.mesh is None):
        raise SystemExit(f"{jax.process_count()} processes: give --checkpoint (or the default model) and a --mesh "
                         f"over all {jax.device_count()} devices; each process loads only its devices' shares")
    # The path may differ between hosts; checkpoint_identity stands for it. The rest must agree.
    settings = {k: v for k, v in vars(args).items() if k not in ("process_id", "checkpoint", "compile_cache")}
    try:
        distributed.check_agreement(settings=settings, checkpoint=distributed.checkpoint_identity(
            args.checkpoint or DEFAULT_CHECKPOINT))
    except ValueError as error:
        raise SystemExit(str(error)) from None


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cpu_without_nvidia_driver()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    if args.distributed or args.coordinator is not None:
        join_processes(args)
    try:
        mesh = None if args.mesh is None else sharding.make_mesh(*args.mesh)
    except ValueError as error:
        raise SystemExit(f"--mesh {args.mesh[0]}x{args.mesh[1]}: {error}") from None
    model, tokenizer, weights = build_model(args, mesh)
    prompts = [args.prompts[row % len(args.prompts)] for row in range(args.batch)]
    if args.mtp > 0 and model.mtp is None:
        raise SystemExit(f"--mtp {args.mtp}: {args.checkpoint} has no MTP layer; use --mtp 0")
    eos_token_id = tokenizer.eos_token_id if tokenizer is not None else model.config.eos_token_id
    prompt_ids = [encode(p, tokenizer, args) for p in prompts]
    in_loop = prefill_in_loop(args, max(map(len, prompt_ids)))
    config = DecodeConfig(**draft_options(args), max_new_tokens=args.max_new_tokens,
                          eos_token_id=eos_token_id, page_size=args.page_size, backend=args.backend,
                          prefill_chunk=args.prefill_chunk, prefill_in_loop=in_loop, cache_dtype=args.cache_dtype)
    mconf = model.config
    print(f"model     {args.checkpoint or (args.preset if args.random else 'tiny-stdlib')} ({mconf.model_type}, {mconf.num_hidden_layers} layers"
          f"{', MTP' if model.mtp is not None else ''}), {weights}")
    print(f"decoding  batch {args.batch}, {describe_decoding(args)}, up to {args.max_new_tokens} new tokens per row, "
          f"backend {args.backend} -> {resolve_backend(args.backend)}, page size {args.page_size}"
          f"{f', prefill chunks of {args.prefill_chunk}' if args.prefill_chunk else ''}"
          f"{', prompts fed through the loop' if in_loop else ''}"
          f"{f', {args.cache_dtype} caches' if args.cache_dtype else ''}")

    # the shapes generate compiles for: the prompts' width and the budget, each padded to its bucket
    width = prompt_bucket(max(map(len, prompt_ids)), config, max_positions=mconf.max_position_embeddings)
    budget = budget_bucket(width, config, max_positions=mconf.max_position_embeddings)
    memory = plan_memory(mconf, config.replace(max_new_tokens=budget), batch=args.batch, prompt_len=width, mesh=mesh,
                         plan=args.plan, dtype=DTYPES[args.dtype] if args.checkpoint else jnp.float32,
                         device_memory=device_memory())
    print(f"memory    {readable(memory.total)} per device{f' of {mesh.devices.size}' if mesh else ''} planned "
          f"(weights {readable(memory.weights)}, caches {readable(memory.caches)}, temporaries "
          f"{readable(max(memory.prefill_temp, memory.step_temp))})")
    try:
        memory.check()
    except ValueError as error:
        raise SystemExit(f"--batch {args.batch}, --max-new-tokens {args.max_new_tokens}: {error}") from None

    start = time.perf_counter()
    try:
        with progress.elapsed("compiling generate"):
            run = compile_generate(model, prompt_ids, config, key=args.sample_seed, mesh=mesh, plan=args.plan)
    except ValueError as error:  # e.g. a mesh the model's experts or heads do not split over
        raise SystemExit(f"{error}") from None
    compile_s = time.perf_counter() - start
    # The first execution also pays one-time runtime setup; time the second.
    start = time.perf_counter()
    jax.block_until_ready(run().tokens)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    result = run()
    jax.block_until_ready(result.tokens)
    decode_s = time.perf_counter() - start

    result = distributed.gather(result)  # the rows live on every process's devices
    emitted = int(np.sum(result.num_tokens))
    acceptance = " ".join(f"{a:.2f}" for a in result.acceptance_per_position) or "- (no drafts)"
    print(f"compile   {compile_s:.2f} s ahead of time, then {warmup_s:.3f} s warm-up run (both not counted below)")
    print(f"decode    {decode_s:.3f} s for {emitted} tokens: {emitted / decode_s:,.0f} tokens/s "
          f"(prefill + {result.steps} steps)")
    print(f"mean accepted length {result.mean_accepted_length:.2f} tokens per target call")
    print(f"acceptance per position {acceptance}")
    print()
    for row, prompt in enumerate(prompts):
        if args.print_ids:
            print(f"[{row}] {encode(prompt, tokenizer, args)} -> {result.row_tokens(row)}")
        else:
            print(f"[{row}] {prompt!r} -> {tokenizer.decode(result.row_tokens(row))!r}")


if __name__ == "__main__":
    main()
