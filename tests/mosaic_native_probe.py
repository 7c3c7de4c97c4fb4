"""A pytest plugin, run by hand: every Mosaic GPU kernel call a test makes interpreted is compiled
again, without a GPU, as the native kernel at the same shapes (`jaxspec.aot.compile_gpu`, sm_90a).

On a GPU host the Mosaic tests run their kernels compiled (`conftest.MOSAIC_INTERPRET`), so each
shape they interpret must also lower and compile for the GPU: the simulator does not model every
constraint of the real lowering (TMA boxes, tiling, shared memory). This checks that on a CPU host:

    PYTHONPATH=tests JAX_PLATFORMS=cpu python -m pytest -p mosaic_native_probe \\
        tests/test_mla_mosaic.py tests/test_sparse_mosaic.py tests/test_v4_mosaic.py tests/test_fp8_cache_v4.py \\
        tests/test_grouped_matmul_mosaic.py tests/test_grouped_matmul_mosaic_swapped.py

(5 minutes on this 2-core host, the grouped matmul's 30 s more; one process, no `-n`). A call
whose interpreted run raises (the argument checks' own cases) is not compiled. The summary lists
each shape that failed to compile; the run fails if one did. Not part of the suite: each compile
costs seconds, and the shapes change only with the tests.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxspec.pallas_kernels.grouped_matmul_mosaic as gmm
import jaxspec.pallas_kernels.grouped_matmul_mosaic_swapped as gmm_swapped
import jaxspec.pallas_kernels.indexer_mosaic as indexer
import jaxspec.pallas_kernels.mla_attention_mosaic as mla
import jaxspec.pallas_kernels.sliding_compressed_attention_mosaic as sliding
import jaxspec.pallas_kernels.sparse_mla_attention_mosaic as sparse
from jaxspec import aot

KERNELS = [(mla, "mla_attention_mosaic"), (sparse, "sparse_mla_attention_mosaic"), (indexer, "indexer_scores_mosaic"),
           (indexer, "indexer_topk_mosaic"), (sliding, "sliding_compressed_attention_mosaic"),
           (gmm, "grouped_matmul_mosaic"), (gmm_swapped, "grouped_matmul_mosaic_swapped")]
_compiled: dict[tuple, str | None] = {}  # call signature -> None (compiled) or the error


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x, tree)


def _probed(kernel):
    @functools.wraps(kernel)
    def call(*args, **kwargs):
        result = kernel(*args, **kwargs)  # raises first for the argument checks' cases
        if kwargs.get("interpret"):
            static = {k: v for k, v in kwargs.items() if not any(map(_is_array, jax.tree.leaves(v)))}
            arrays = {k: v for k, v in kwargs.items() if k not in static}
            key = (kernel.__name__, repr(_abstract(args)), repr(_abstract(arrays)), repr(sorted(static.items())))
            if key not in _compiled:
                native = {**static, "interpret": False}
                try:
                    aot.compile_gpu(lambda a, k: kernel(*a, **k, **native), _abstract(args), _abstract(arrays),
                                    devices=aot.gpu_devices("h100"))
                    _compiled[key] = None
                except Exception as error:  # noqa: BLE001 - every failure is the finding
                    _compiled[key] = f"{type(error).__name__}: {str(error)[:300]}"
        return result

    return call


def pytest_configure(config):
    # Before the test modules import the kernels by name.
    for module, name in KERNELS:
        setattr(module, name, _probed(getattr(module, name)))


def pytest_terminal_summary(terminalreporter):
    failed = {key: error for key, error in _compiled.items() if error}
    terminalreporter.write_line(f"mosaic_native_probe: {len(_compiled)} interpreted shapes compiled for sm_90a, "
                                f"{len(failed)} failed")
    for (name, args, arrays, static), error in failed.items():
        terminalreporter.write_line(f"  {name} {args[:400]} {static[:200]}: {error}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if any(_compiled.values()):
        session.exitstatus = 1
