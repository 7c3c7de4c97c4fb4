"""`jaxspec.aot.program_cost` counts a while loop's body as many times as it runs: programs that
loop over layers (`lax.scan`, a `lax.map` inside one) cost what their unrolled twins cost, XLA's
own ops and the Pallas kernels' stated costs alike, compiled for an H100 on this host.

The compiles need JAX's CUDA plugin and `JAX_PLATFORMS=cpu` (the `h100` fixture skips without).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from jaxspec import aot
from jaxspec.aot import analysis, hlo_loops
from jaxspec.aot.analysis import _cost_analysis
from jaxspec.pallas_kernels.tiling import launch

Spec = jax.ShapeDtypeStruct
# One token's layers, as in a decode step: each layer reads its weights once. (Wider activations
# make the programs differ: a scan copies its carry and the weight slice a matmul takes, real
# traffic an unrolled program does not have.)
WIDTH, CHUNKS = 1024, 4


def scanned(w, x):
    """x [1, WIDTH] through layers tanh(x @ w[i]), w [L, WIDTH, WIDTH], as a lax.scan."""
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0]


def unrolled(w, x):
    for i in range(w.shape[0]):
        x = jnp.tanh(x @ w[i])
    return x


def _join(parts):
    """[CHUNKS, 1, WIDTH / CHUNKS] column blocks -> [1, WIDTH]."""
    return parts.transpose(1, 0, 2).reshape(1, WIDTH)


def scanned_map(scales, blocks, x):
    """Layers tanh((x @ W) * scales[i]), scales [L, WIDTH], with x @ W a lax.map over W's column
    blocks [CHUNKS, WIDTH, WIDTH / CHUNKS], as a lax.scan."""
    layer = lambda x, scale: (jnp.tanh(_join(jax.lax.map(lambda block: x @ block, blocks)) * scale), None)
    return jax.lax.scan(layer, x, scales)[0]


def unrolled_map(scales, blocks, x):
    for i in range(scales.shape[0]):
        x = jnp.tanh(_join(jnp.stack([x @ block for block in blocks])) * scales[i])
    return x


def _args(looped, layers: int):
    if looped is scanned:
        return Spec((layers, WIDTH, WIDTH), jnp.float32), Spec((1, WIDTH), jnp.float32)
    return (Spec((layers, WIDTH), jnp.float32), Spec((CHUNKS, WIDTH, WIDTH // CHUNKS), jnp.float32),
            Spec((1, WIDTH), jnp.float32))


def _close(a, b, rtol=0.01):
    return abs(a - b) <= rtol * abs(b)


@pytest.mark.parametrize("looped, flat", [(scanned, unrolled), (scanned_map, unrolled_map)], ids=["scan", "scan-of-map"])
@pytest.mark.parametrize("layers", [1, 4, 16])
def test_a_scanned_program_costs_what_its_unrolled_twin_costs(h100, looped, flat, layers):
    args = _args(looped, layers)
    loop, twin = (aot.compile_gpu(fn, *args, devices=h100) for fn in (looped, flat))
    cost, expected = aot.program_cost(loop), aot.program_cost(twin)
    assert cost.loops_counted_once == expected.loops_counted_once == 0
    assert _close(cost.flops, expected.flops) and _close(cost.bytes_accessed, expected.bytes_accessed)
    assert _close(cost.transcendentals, expected.transcendentals)
    # XLA alone counts a body once: the scan's layers as one, the map's blocks as one (the count
    # program_cost corrects; should XLA ever count trips itself, this fails first).
    trips = layers * (CHUNKS if looped is scanned_map else 1)
    xla = _cost_analysis(loop.runtime_executable().hlo_modules()[0])
    assert _close(xla["flops"] * trips, expected.flops)
    assert _close(jax.jit(looped).lower(*args).compile().cost_analysis()["flops"] * trips, expected.flops)


def test_a_collective_in_a_scan_counts_once_per_trip(h100):
    """Layers whose contraction is split over two devices reduce their partial sums in the loop's
    body: as many bytes of collectives per step as the unrolled twin's, however XLA splits them."""
    mesh = jax.sharding.Mesh(aot.gpu_devices("h100", 2), ("model",))
    split = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    layers = 4
    args = (Spec((layers, WIDTH, WIDTH), jnp.float32, sharding=split(None, "model", None)),
            Spec((8, WIDTH), jnp.float32, sharding=split(None, "model")))
    loop, twin = (aot.compile_gpu(fn, *args, devices=mesh.devices.tolist()) for fn in (scanned, unrolled))
    found = aot.collectives(loop)
    assert max(c.runs for c in found) == layers
    assert sum(c.bytes * c.runs for c in found) == sum(c.bytes * c.runs for c in aot.collectives(twin))
    assert _close(aot.program_cost(loop).flops, aot.program_cost(twin).flops)


BLOCK = (16, 128)
KERNEL_COST = pl.CostEstimate(flops=2 * BLOCK[0] * BLOCK[1], transcendentals=0, bytes_accessed=2 * 4 * BLOCK[0] * BLOCK[1])


def _scale_and_shift(x):
    """A one-block Pallas kernel, 2 x + 1, stating its cost (2 flops per element)."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    return launch(kernel, out_shape=Spec(BLOCK, jnp.float32), grid=(1,), num_warps=4, num_stages=1,
                  name="scale_and_shift", interpret=False, cost=KERNEL_COST)(x)


@pytest.mark.parametrize("layers, inner", [(5, None), (3, "map"), (3, "cond")])
def test_a_pallas_kernel_in_a_loop_counts_once_per_run(h100, layers, inner):
    """The kernel in a scan's body, in a lax.map (4 trips) inside it, or in a branch of a lax.cond
    inside it (a branch counts as often as its conditional)."""
    chunks = 4 if inner == "map" else 1

    def body(x, _):
        if inner == "map":
            return jax.lax.map(lambda i: _scale_and_shift(x + i), jnp.arange(chunks, dtype=jnp.float32)).sum(0), None
        if inner == "cond":
            return jax.lax.cond(x[0, 0] > 0, _scale_and_shift, jnp.negative, x), None
        return _scale_and_shift(x), None

    compiled = aot.compile_gpu(lambda x: jax.lax.scan(body, x, length=layers)[0], Spec(BLOCK, jnp.float32),
                               devices=h100)
    (call,) = aot.pallas_calls(compiled)
    assert (call.flops, call.runs) == (KERNEL_COST.flops, layers * chunks)
    cost = aot.program_cost(compiled)
    assert cost.kernel_flops == layers * chunks * KERNEL_COST.flops
    assert cost.kernel_bytes == layers * chunks * KERNEL_COST.bytes_accessed
    assert not cost.uncounted
    assert aot.op_class_costs(compiled)["xla"][0] == cost.flops  # an unnamed kernel is an "xla" op
    assert f"scale_and_shift {layers * chunks}" in aot.report(compiled, "scan")


def _condition_kernels(module, loop) -> set[str]:
    """The kernel names a loop's condition's instructions would launch under (XLA sanitizes an
    instruction's name into its kernel's)."""
    return {re.sub(r"[.-]", "_", name) for name in
            re.findall(r"^\s*(?:ROOT )?%?(\S+) = ", "\n".join(module.computations[loop.condition]), re.M)}


def test_launches_count_each_loop_body_as_often_as_it_runs(h100, monkeypatch):
    """`aot.launch_counts` reads the thunk sequence: in a scan of 5 holding a conditional and a lax.map
    of 3, the Pallas kernel launches as often as the HLO says it runs (a branch as often as its
    conditional, the map's body 15 times), no loop's condition (XLA knows both trip counts, and
    its WhileThunk then never evaluates one), and the report states the total. `op_class_launches`
    gives the kernel's launches to its op class and every other launch to XLA's."""
    def body(x, _):
        x = jax.lax.cond(x[0, 0] > 0, _scale_and_shift, jnp.negative, x)
        return jax.lax.map(lambda i: _scale_and_shift(x + i), jnp.arange(3, dtype=jnp.float32)).sum(0), None

    compiled = aot.compile_gpu(lambda x: jax.lax.scan(body, x, length=5)[0], Spec(BLOCK, jnp.float32), devices=h100)
    launched = aot.launch_counts(compiled)
    assert launched["scale_and_shift"] == sum(call.runs for call in aot.pallas_calls(compiled)) == 5 + 15
    module = hlo_loops.parse_module(compiled.as_text())
    runs = hlo_loops.executions(module)
    assert sorted((loop.trip_count, runs[loop.computation]) for loop in module.loops) == [(3, 5), (5, 1)]
    for loop in module.loops:
        names = _condition_kernels(module, loop)
        assert names and not names & set(launched), (names, launched)
    assert "kWhile" not in launched
    assert launched["kCopy"] > 0
    assert aot.op_class_launches(compiled) == {"attention": 0, "grouped_matmul": 0, "xla": sum(launched.values())}
    monkeypatch.setitem(analysis.KERNEL_CLASSES, "scale_and_shift", "attention")
    assert aot.op_class_launches(compiled) == {"attention": 20, "grouped_matmul": 0, "xla": sum(launched.values()) - 20}
    assert f"launches per execution (loops' bodies as often as they run): {sum(launched.values())}, " in aot.report(
        compiled, "nested")


def test_a_loop_on_data_counts_its_condition_and_the_hosts_read_of_it(h100):
    """A `lax.while_loop` whose trip count XLA cannot know, inside a scan of 4: its body counts once
    a run of the scan (the count is unknown), its condition's kernel once more than that, and as
    often the predicate's copy to the host ("kWhile"); the scan's own condition not at all. The
    report names the host's reads."""
    def body(x, _):
        x = jax.lax.while_loop(lambda x: x[0, 0] < 100.0, _scale_and_shift, x)
        return x, None

    compiled = aot.compile_gpu(lambda x: jax.lax.scan(body, x, length=4)[0], Spec(BLOCK, jnp.float32), devices=h100)
    module = hlo_loops.parse_module(compiled.as_text())
    assert sorted(loop.trip_count or 0 for loop in module.loops) == [0, 4]
    launched = aot.launch_counts(compiled)
    assert launched["scale_and_shift"] == 4
    (data_loop,) = [loop for loop in module.loops if loop.trip_count is None]
    names = _condition_kernels(module, data_loop)
    assert [launched[name] for name in names if name in launched] == [4 + 4]
    assert launched["kWhile"] == 4 + 4
    assert "8 loop predicate read by the host" in aot.report(compiled, "data loop")


def test_an_async_wrapper_is_no_launch_but_what_it_holds_is(h100, tmp_path, monkeypatch):
    """jax 0.11's XLA runs some thunks (a dynamic slice's copy) on another stream between an async
    start and an async done: the copy is a launch, the start and the done are not (a thunk
    sequence as jax 0.11.2 prints it, for a program whose entry holds no loop)."""
    compiled = aot.compile_gpu(lambda x: x * 2.0, Spec(BLOCK, jnp.float32), devices=h100)
    path = tmp_path / "module_0001.async.thunk_sequence.txt"
    path.write_text("\n".join([
        "001: kAsyncStart   [source        | next=004 (1) ] stream=computation_stream[0], async_id=1",
        "    003: kDynamicSliceFusion [source | sink] params=1, results=1",
        "        002: kCopy [source | sink] kCopy",
        "004: kAsyncDone    [prev=001 (1)  | sink         ] ",
        "005: kCustomKernel [source        | sink         ] loop_multiply_fusion grid: [1, 1, 1] threads: [128, 1, 1]"
        "  shared_memory: 0 bytes"]) + "\n")
    monkeypatch.setattr(analysis, "_dump_files", lambda compiled, suffix: [str(path)])
    assert aot.launch_counts(compiled) == {"kCopy": 1, "loop_multiply_fusion": 1}


def test_launches_of_two_loops_sharing_their_kernels(h100):
    """Two scans of one body, 3 and 7 trips: XLA compiles the body's kernels once and names them
    after the first loop's instructions in both, and each loop's thunks still count its own trips
    (a block is its loop's by position, not by its kernels' names)."""
    def body(x, _):
        return _scale_and_shift(jnp.tanh(x) * 0.5), None

    def two_loops(x):
        return jax.lax.scan(body, jax.lax.scan(body, x, length=3)[0], length=7)[0]

    launched = aot.launch_counts(aot.compile_gpu(two_loops, Spec(BLOCK, jnp.float32), devices=h100))
    assert launched["scale_and_shift"] == 10
    shared = [name for name, n in launched.items() if "tanh" in name or "multiply" in name]
    assert shared and all(launched[name] == 10 for name in shared), launched


def test_a_thunk_block_that_cannot_be_placed_is_refused(tmp_path):
    """A loop whose body printed no thunk would have the thunks after it counted as its body: the
    reader refuses it, at the top level and inside another loop's body, and reads the nested
    blocks of a well-formed sequence."""
    loop = ["001: kWhile [source | sink]", "condition:", "    002: kCustomKernel [source | sink] compare",
            "  body:"]
    nested = ["001: kWhile [source | sink]", "condition:", "    002: kCustomKernel [source | sink] compare",
              "  body:", "    003: kWhile [source | sink]", "condition:",
              "        004: kCustomKernel [source | sink] compare_1", "      body:"]
    for lines in (loop + ["005: kCopy [source | sink] kCopy"], nested + ["    005: kCopy [source | sink] kCopy"]):
        path = tmp_path / "module.thunk_sequence.txt"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(RuntimeError, match="does not follow the loop or conditional before it"):
            analysis._thunk_blocks([str(path)])
    path.write_text("\n".join(nested + ["        005: kCopy [source | sink] kCopy"]) + "\n")
    blocks = analysis._thunk_blocks([str(path)])
    assert [(block.header, block.parent, block.thunks) for block in blocks] == [
        (None, None, [("kWhile", "")]), ("condition", 0, [("kCustomKernel", "compare")]),
        ("body", 0, [("kWhile", "")]), ("condition", 2, [("kCustomKernel", "compare_1")]),
        ("body", 2, [("kCopy", "kCopy")])]


def test_a_loop_of_unknown_trip_count_counts_once_and_says_so(h100):
    """A `lax.while_loop` on data: XLA cannot know its trips, its body (holding a kernel) counts
    once, and the cost says one loop was counted so."""
    def doubling(x):
        return jax.lax.while_loop(lambda x: x.sum() < 1e6, _scale_and_shift, x)

    compiled = aot.compile_gpu(doubling, Spec(BLOCK, jnp.float32), devices=h100)
    cost = aot.program_cost(compiled)
    assert cost.loops_counted_once == 1
    assert [call.runs for call in aot.pallas_calls(compiled)] == [1]
    assert cost.kernel_flops == KERNEL_COST.flops
    assert "per iteration" in aot.report(compiled, "doubling")


HLO = """HloModule m

%body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  ROOT %t = (s32[]) tuple(%p), control-predecessors={%p}
}

%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: (s32[])) -> (s32[]) {
  %a = (s32[]) parameter(0)
  ROOT %w = (s32[]) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
}
"""


def test_the_loop_parser_reads_trip_counts_and_refuses_what_it_cannot_read():
    module = hlo_loops.parse_module(HLO)
    (loop,) = module.loops
    assert (loop.computation, loop.body, loop.condition, loop.trip_count) == ("main", "body", "cond", 7)
    assert hlo_loops.executions(module) == {"body": 7, "cond": 1, "main": 1}
    assert "ENTRY %body" in hlo_loops.module_with_entry(module, "body")
    with pytest.raises(RuntimeError, match="calls 'nowhere', which the module does not define"):
        hlo_loops.parse_module(HLO.replace("body=%body", "body=%nowhere"))
    with pytest.raises(RuntimeError, match="without an ENTRY"):
        hlo_loops.parse_module(HLO.replace("ENTRY ", ""))


def test_a_scatter_counts_the_rows_it_touches(h100):
    """A paged cache's write: 8 rows scattered into a donated [4096, 64, 128] pool, once and inside
    a 6-layer scan over a stacked pool. XLA's analysis counts the whole pool read and written per
    scatter; program_cost counts the rows (indices, updates read and written) plus what else runs,
    far below one pool, and the scan's six writes six times one write."""
    pages, rows, width = 4096, 8, 128
    update_bytes = rows * 64 * width * 2

    def write(pool, index, values):  # pool [P, 64, W] bf16, index [8] int32, values [8, 64, W]
        return pool.at[index].set(values)

    def write_stacked(pool, index, values):  # pool [6, P, 64, W]: each layer writes its own rows
        flat = pool.reshape(-1, *pool.shape[2:])
        def layer(flat, l):
            return flat.at[index + l * pages].set(values), None
        return jax.lax.scan(layer, flat, jnp.arange(6))[0].reshape(pool.shape)

    args = (Spec((rows,), jnp.int32), Spec((rows, 64, width), jnp.bfloat16))
    one = aot.program_cost(aot.compile_gpu(write, Spec((pages, 64, width), jnp.bfloat16), *args, devices=h100,
                                           donate_argnums=(0,)))
    six = aot.program_cost(aot.compile_gpu(write_stacked, Spec((6, pages, 64, width), jnp.bfloat16), *args,
                                           devices=h100, donate_argnums=(0,)))
    pool_bytes = pages * 64 * width * 2
    assert 2 * update_bytes <= one.bytes_accessed < 4 * update_bytes < pool_bytes / 100
    assert six.bytes_accessed == pytest.approx(6 * one.bytes_accessed, rel=0.05)


@pytest.mark.parametrize("layers", [4, 16])
def test_one_slot_read_and_written_in_place_counts_the_slot(h100, layers):
    """A decode step at one row reads and writes single cache slots: a dynamic slice and an
    in-place dynamic update of the layers' stacked cache [L, P, 64, W], each through a bitcast to
    [L * P, 64, W] inside its fusion, as the model's paged reads and writes are. XLA's analysis
    counts such a fusion as reading the whole cache, so a step's bytes grew with depth squared;
    program_cost counts what each touches: a layer costs a few slots, not a page, at 4 layers as
    at 16 (the uncorrected count is at least the cache a layer)."""
    from jaxspec.aot.analysis import _parsed, _sliced_fusion_overcount

    pages, width = 65, 576

    def step(cache, x, position):  # cache [L, P, 64, W] bf16, donated
        def layer(cache, l):
            flat, row = cache.reshape(layers * pages, 64, width), l * pages + position // 64
            old = jax.lax.optimization_barrier(jax.lax.dynamic_slice(flat, (row, position % 64, 0), (1, 1, width)))
            new = jax.lax.optimization_barrier((x + old.reshape(width)).astype(flat.dtype))
            return jax.lax.dynamic_update_slice(flat, new[None, None], (row, position % 64, 0)).reshape(cache.shape), None
        return jax.lax.scan(layer, cache, jnp.arange(layers))[0]

    compiled = aot.compile_gpu(step, Spec((layers, pages, 64, width), jnp.bfloat16), Spec((width,), jnp.bfloat16),
                               Spec((), jnp.int32), devices=h100, donate_argnums=(0,))
    per_layer = aot.program_cost(compiled).bytes_accessed / layers
    assert 4 * width * 2 <= per_layer < 64 * width * 2  # a few slots, not a page, let alone the cache
    assert _sliced_fusion_overcount(*_parsed(compiled.as_text())) / layers >= layers * pages * 64 * width * 2
