"""`jaxspec.aot`: the Pallas kernels and a reduced-depth DeepSeek-V3.2 decode step compiled for an
H100 (sm_90a) on this CPU host, and the facts the compiler reports about them.

The compiles need JAX's CUDA plugin and a process whose JAX platforms exclude CUDA
(`JAX_PLATFORMS=cpu`, as `.ci/run` sets); without either, they skip and say which is missing.
Kernel resources are facts of the compiled program: shared memory within the 227 KB a block may
opt into on sm_90, no register spills (the compile itself fails on one, or names it), and the
stated cost the program counts for each kernel equals the kernel's arithmetic.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec import aot
from jaxspec.aot.model import compile_model, reduced_depth
from jaxspec.decode_config import DecodeConfig
from jaxspec.pallas_kernels import Visibility
from jaxspec.pallas_kernels.indexer_pallas import indexer_scores_pallas, indexer_topk_pallas
from jaxspec.pallas_kernels.mla_attention_pallas import mla_attention_pallas
from jaxspec.pallas_kernels.sparse_mla_attention_pallas import sparse_mla_attention_pallas
from jaxspec.presets import preset

V32 = preset("deepseek-v3.2")
SHARED_MEMORY_LIMIT = 232448  # bytes a block may opt into on sm_90 (227 KB), the H100 spec's value
Spec = jax.ShapeDtypeStruct


def test_device_memory_must_be_positive():
    with pytest.raises(ValueError, match=r"device_memory=0: must be >= 1"):
        aot.gpu_devices("h100", device_memory=0)


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match=r"target='a100': must be one of \['h100', 'h200'\]"):
        aot.gpu_devices("a100")
    with pytest.raises(ValueError, match=r"num_devices=0: must be >= 1"):
        aot.gpu_devices("h200", 0)
    with pytest.raises(ValueError, match=r"hosts=3: must be >= 1 and divide num_devices=16"):
        aot.gpu_devices("h100", 16, hosts=3)


def test_cli_compiles_under_the_tile_variant_and_auto_choices_it_is_given(monkeypatch, capsys):
    """`jaxspec aot --backend auto --tiles k64-split --auto grouped_matmul=mosaic` traces the step
    with that tile variant and "auto" choosing the Mosaic grouped matmul on the target (the
    settings a GPU run of the variant has), names them in the report's title and leaves both as
    they were; an --auto naming no Mosaic kernel is refused before compiling. Spills are reported,
    not refused, unless --fail-on-spills."""
    from jaxspec import cli
    from jaxspec.pallas_kernels import backend, grouped_matmul_pallas

    seen = {}

    def compile_model(config, decode, **options):  # what tracing the step would read
        with backend.gpu_lowering():
            seen.update(tiles=grouped_matmul_pallas.current_tiles(), backend=decode.backend,
                        fail_on_spill=options["fail_on_spill"],
                        gmm=backend.resolve_backend(decode.backend, "grouped_matmul"),
                        attention=backend.resolve_backend(decode.backend, "sparse_mla_attention"))
        return "compiled"

    monkeypatch.setattr("jaxspec.aot.model.compile_model", compile_model)
    monkeypatch.setattr(aot, "report", lambda compiled, title: f"{compiled}: {title}")
    argv = ["aot", "--preset", "tiny", "--batch", "2", "--context", "64", "--mtp", "3", "--backend", "auto"]
    assert cli.main([*argv, "--tiles", "k64-split", "--auto", "grouped_matmul=mosaic"]) == 0
    assert seen == dict(tiles=grouped_matmul_pallas.VARIANTS["k64-split"], backend="auto", gmm="mosaic",
                        attention="pallas", fail_on_spill=False)
    title = capsys.readouterr().out
    assert "backend auto, auto grouped_matmul=mosaic, grouped matmul tiles k64-split" in title
    assert cli.main([*argv, "--fail-on-spills"]) == 0 and seen["fail_on_spill"]
    variants = grouped_matmul_pallas.VARIANTS
    assert grouped_matmul_pallas.current_tiles() == variants[grouped_matmul_pallas.DEFAULT_VARIANT]
    with backend.gpu_lowering():
        assert backend.resolve_backend("auto", "grouped_matmul") == "pallas"
    with pytest.raises(SystemExit):
        cli.main([*argv, "--auto", "grouped_matmul=cuda"])
    assert "the implementation 'pallas' or 'mosaic'" in capsys.readouterr().err


def test_missing_plugin_says_what_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(RuntimeError, match=rf"pip install 'jax\[cuda12\]=={jax.__version__}'"):
        aot.gpu_devices("h100")


def test_shape_bytes_reads_hlo_shapes():
    assert aot.shape_bytes("bf16[2,3]{1,0}") == 12
    assert aot.shape_bytes("(f32[4]{0}, s32[], pred[8]{0})") == 16 + 4 + 8
    assert aot.shape_bytes("f8e4m3fn[16]{0}") == 16


def _visibility(batch: int, num_queries: int, tree: bool) -> Visibility:
    mask = Spec((batch, num_queries, num_queries), jnp.bool_) if tree else None
    return Visibility(Spec((batch,), jnp.int32), Spec((batch,), jnp.int32), mask)


BATCH, CONTEXT = 32, 4096
PAGES = CONTEXT // 64
LATENT, ROPE, HEADS = V32.kv_lora_rank, V32.qk_rope_head_dim, V32.num_attention_heads


def _mla(num_queries, tree):
    args = (Spec((BATCH, num_queries, HEADS, LATENT), jnp.bfloat16), Spec((BATCH, num_queries, HEADS, ROPE), jnp.bfloat16),
            Spec((BATCH * PAGES, 64, LATENT + ROPE), jnp.bfloat16), Spec((BATCH, PAGES), jnp.int32),
            _visibility(BATCH, num_queries, tree))
    # Each query row scores Dl + Dr features and averages Dl per slot, over every slot of its row.
    flops = 2 * BATCH * num_queries * HEADS * CONTEXT * (2 * LATENT + ROPE)
    return mla_attention_pallas, args, flops


def _sparse_mla(num_queries, tree):
    args = (Spec((BATCH, num_queries, HEADS, LATENT), jnp.bfloat16), Spec((BATCH, num_queries, HEADS, ROPE), jnp.bfloat16),
            Spec((BATCH * PAGES, 64, LATENT + ROPE), jnp.bfloat16), Spec((BATCH, PAGES), jnp.int32),
            Spec((BATCH, num_queries, V32.index_topk), jnp.int32))
    flops = 2 * BATCH * num_queries * HEADS * V32.index_topk * (2 * LATENT + ROPE)
    return sparse_mla_attention_pallas, args, flops


def _indexer(num_queries, tree):
    heads, dim = V32.index_n_heads, V32.index_head_dim
    args = (Spec((BATCH, num_queries, heads, dim), jnp.bfloat16), Spec((BATCH, num_queries, heads), jnp.float32),
            Spec((BATCH * PAGES, 64, dim), jnp.bfloat16), Spec((BATCH, PAGES), jnp.int32),
            _visibility(BATCH, num_queries, tree))
    # A Di-long dot per (token, head, slot), then ReLU, weight and sum.
    flops = BATCH * num_queries * heads * CONTEXT * (2 * dim + 3)
    return indexer_topk_pallas, args, flops


# Sparse MLA takes each token's index list, not visibility: a tree window is its chain case.
KERNEL_CASES = [(kernel, q, False) for kernel in (_mla, _sparse_mla, _indexer) for q in (1, 4, 8)]
KERNEL_CASES += [(_mla, 8, True), (_indexer, 8, True)]


@pytest.mark.parametrize("kernel, num_queries, tree", KERNEL_CASES,
                         ids=[f"{k.__name__[1:]}-q{q}{'-tree' if t else ''}" for k, q, t in KERNEL_CASES])
def test_kernel_compiles_for_h100_at_v32_shapes(h100, kernel, num_queries, tree):
    """Real DeepSeek-V3.2 widths, B = 32, a 4096-slot context; the compile fails on any spill."""
    fn, args, flops = kernel(num_queries, tree)
    static = {"softmax_scale": V32.softmax_scale} if kernel is not _indexer else {"topk": V32.index_topk}
    compiled = aot.compile_gpu(fn, *args, devices=h100, interpret=False, static_argnames=(*static, "interpret"),
                               **static)
    (launch,) = aot.kernel_launches(compiled)
    assert 0 < launch.shared_memory <= SHARED_MEMORY_LIMIT
    assert launch.spill_stores == launch.spill_loads == 0
    assert launch.registers <= 255
    (call,) = aot.pallas_calls(compiled)
    assert call.flops == flops
    cost = aot.program_cost(compiled)
    assert cost.kernel_flops == flops and cost.flops >= flops and not cost.uncounted


@pytest.mark.parametrize("num_queries", [1, 4])
def test_a_chain_windows_visibility_takes_no_kernel_before_the_indexer(h100, num_queries):
    """The Triton indexer's scores for a chain window compile to its one launch: it takes the
    window's prefix and query lengths as they are and computes its tokens' bounds itself
    (`tiling.token_bounds`), where bounds passed in took a kernel of XLA's before it, at every
    layer of a decode step."""
    _, args, _ = _indexer(num_queries, False)
    compiled = aot.compile_gpu(indexer_scores_pallas, *args, devices=h100, interpret=False,
                               static_argnames=("interpret",))
    assert aot.launch_counts(compiled) == {"indexer_scores": 1}


def holds_a_block(x):
    """A Triton kernel that spills: one warp holds a [128, 128] float32 block (512 values a thread)
    across the reduction over its rows."""

    def kernel(x_ref, o_ref):
        block = x_ref[...]
        o_ref[...] = block - jnp.max(block, axis=0, keepdims=True)

    return pl.pallas_call(kernel, out_shape=Spec(x.shape, x.dtype), name="holds_a_block",
                          compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1))(x)


def test_spills_are_reported_by_kernel_or_refused(h100):
    """A compile that allows spills names each kernel of XLA's PTX that spills, with ptxas' bytes
    (the same figures as its launch row); one that refuses them (`fail_on_spill`, the default)
    fails on that kernel, and its report says that none spills."""
    block = Spec((128, 128), jnp.float32)
    compiled = aot.compile_gpu(holds_a_block, block, fail_on_spill=False)
    (launch,) = aot.kernel_launches(compiled)
    assert launch.spill_stores > 0 and launch.spill_loads > 0
    assert aot.register_spills(compiled) == {"holds_a_block": (launch.spill_stores, launch.spill_loads)}
    assert (f"register spills (ptxas, bytes stored + loaded): holds_a_block {launch.spill_stores + launch.spill_loads}"
            in aot.report(compiled, "spills").splitlines())
    with pytest.raises(jax.errors.JaxRuntimeError, match="register spilling"):
        aot.compile_gpu(holds_a_block, block)
    refused = aot.compile_gpu(lambda x: jnp.sin(x) * 2, block)
    assert aot.register_spills(refused) == {}
    assert "register spills: none (the compile refuses a kernel that spills)" in aot.report(refused, "none")


def test_collectives_of_a_two_device_program(h100):
    devices = aot.gpu_devices("h100", 2)
    mesh = jax.sharding.Mesh(devices, ("rows",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    compiled = aot.compile_gpu(lambda x: x.sum(axis=0), Spec((1024, 512), jnp.float32, sharding=rows), devices=devices)
    (collective,) = aot.collectives(compiled)
    assert (collective.op, collective.bytes) == ("all-reduce", 512 * 4)


# In a process of its own, with a persistent compilation cache of its own: JAX decides once per
# process whether the cache is used, and this suite's CPU run shares one cache between its workers.
CACHE_PROBE = textwrap.dedent("""
    import os, warnings
    import jax, jax.numpy as jnp
    from jaxspec import aot
    # Programs only: on a GPU host XLA's autotuning results share the directory.
    entries = lambda: sum(name.endswith("-cache") for name in os.listdir(os.environ["JAX_COMPILATION_CACHE_DIR"]))
    devices = aot.gpu_devices("h100")
    fn = lambda x: jnp.sin(x @ x.T).sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled = aot.compile_gpu(fn, jax.ShapeDtypeStruct((256, 256), jnp.float32), devices=devices)
            print("deviceless", entries(), any(name.endswith(".ptx") for name in os.listdir(compiled.dump_dir)))
    print("warnings", sum("compilation cache" in str(w.message) for w in caught))
    jax.jit(fn).lower(jax.ShapeDtypeStruct((256, 256), jnp.float32)).compile()
    print("jit", entries())
""")


def test_deviceless_compiles_stay_out_of_the_persistent_compilation_cache(h100, tmp_path):
    """Under a user's JAX_COMPILATION_CACHE_DIR, `compile_gpu` writes no entry, so compiling the
    same program again neither warns about an unreadable entry nor loads one in place of the dump
    it reads (each compile dumps its PTX); a program compiled after it in the same process is
    cached as before (the write threshold is restored)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    done = subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:4] == ["deviceless 0 True", "deviceless 0 True", "warnings 0", "jit 1"], done.stdout


@pytest.mark.slow
def test_reduced_depth_v32_decode_step_aliases_its_caches(h100):
    """Real widths, 3 layers (one dense, then a stack of two MoE layers run as a scan) plus the MTP
    block, MTP chain k = 3, B = 32, 4096 tokens of context: the compiled step updates its stacked
    caches in place (donated, aliased, through the scan), and its temporaries hold activations, not
    expert weights (a scan that sliced a layer's experts out of the stack would copy all of them)."""
    config = V32.replace(num_hidden_layers=3, first_k_dense_replace=1)
    compiled = compile_model(config, DecodeConfig(num_draft=3, backend="pallas"), phase="decode", batch=BATCH,
                             context=CONTEXT, devices=h100)
    mem = aot.memory(compiled)
    slots = BATCH * -(-(CONTEXT + 3) // 64) * 64  # the context plus the verification window, in whole pages
    cache_bytes = 2 * slots * (config.latent_dim * (config.num_hidden_layers + 1)
                               + config.index_head_dim * (config.num_hidden_layers + 1))
    assert mem.alias >= cache_bytes
    assert mem.output - mem.alias < cache_bytes / 100  # no second copy of the cache
    expert_bytes = 2 * 3 * config.hidden_size * config.moe_intermediate_size
    assert mem.temp < config.num_experts_per_tok * expert_bytes  # less than one token's routed experts
    launches = aot.kernel_launches(compiled)
    assert len(launches) == len(aot.pallas_calls(compiled))  # every kernel launch found in the dump
    assert {aot.kernel_name(k.name) for k in launches} >= {"indexer_scores", "sparse_mla_attention"}
    assert all(k.shared_memory <= SHARED_MEMORY_LIMIT and k.spill_stores == 0 for k in launches)


@pytest.mark.slow
def test_window_invariant_step_makes_no_float32_copy_of_the_head(h100):
    """One full-width V3.2 layer, window-invariant k = 3 step: the logits run per position (a
    loop), and the float32 head they multiply is cast inside each product, where XLA fuses the cast
    into the GEMM. Cast once before the loop, it was a float32 copy of the [7168, 129280] head in
    the step's temporaries (3.73 GB of them)."""
    compiled = compile_model(reduced_depth(V32, 1), DecodeConfig(num_draft=3, backend="pallas", window_invariant=True),
                             phase="decode", batch=8, context=CONTEXT, devices=h100)
    head_float32 = V32.hidden_size * V32.vocab_size * 4
    assert aot.memory(compiled).temp < head_float32 / 4
