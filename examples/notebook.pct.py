# ---
# jupyter:
#   jupytext:
#     formats: ipynb,.pct.py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # jaxspec in a notebook
#
# Lossless speculative decoding with the model this repository ships, `examples/checkpoints/tiny-stdlib`: a
# 12-layer DeepSeek-V3.2 (MLA, DSA indexer, MoE, one MTP module) trained byte by byte on the Python standard
# library's source. Its MTP module drafts the next tokens, the model verifies them in one call, and greedy
# output is plain greedy decoding's, token for token.
#
# This notebook restores the model, decodes with `generate`, drives the same loop one step at a time with
# `init_state` / `step`, plots the acceptance of a chain and of a draft tree, times plain against speculative
# decoding, and shows JAX's persistent compilation cache.
#
# `examples/notebook.pct.py` (Jupytext percent format) is the source; `examples/notebook.ipynb` is generated
# from it with `jupytext --sync examples/notebook.pct.py`. (Not `notebook.py`: a kernel started in this folder
# would import that file as Jupyter's own `notebook` package.) The test suite executes the notebook with the
# parameters below made small (`tests/test_notebook.py`).

# %% tags=["parameters"]
CHECKPOINT = "checkpoints/tiny-stdlib"  # relative to this notebook's folder, where Jupyter starts the kernel
MAX_NEW_TOKENS = 64  # tokens generated per row
NUM_DRAFT = 3  # k: draft tokens per step from the MTP module
TREE = "small"  # a static draft tree ("small", "eagle") or a dynamic one, "top_k,depth,budget"
STEPS_SHOWN = 5  # speculative steps printed one by one
TIMING_RUNS = 5  # runs per timing; the fastest counts (other processes share the machine)
CACHE_DIR = None  # the persistent compilation cache; None: a new temporary directory

# %% [markdown]
# ## Set up
#
# JAX reads two settings before its first computation. `use_cpu_without_nvidia_driver` picks the CPU when
# JAX's CUDA plugin is installed but no NVIDIA driver answers, so a CPU-only host prints no plugin traceback
# (it does nothing where a GPU is, or where `JAX_PLATFORMS` is set). The compilation cache directory makes
# JAX store every compiled program on disk and load it, instead of compiling, whenever the same program is
# compiled again, in this process or a later one.

# %%
import os
import tempfile
import time

import jax
import matplotlib.pyplot as plt
import numpy as np

from jaxspec import DecodeConfig, compile_generate, generate, init_state, restore_model, step
from jaxspec.platforms import use_cpu_without_nvidia_driver
from jaxspec.tokenizer import ByteTokenizer

use_cpu_without_nvidia_driver()
CACHE_DIR = CACHE_DIR or tempfile.mkdtemp(prefix="jaxspec-compile-cache-")
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache every program, however quick
print("devices", jax.devices())
print("compilation cache", CACHE_DIR, f"({len(os.listdir(CACHE_DIR))} entries)")

# %% [markdown]
# ## Restore the shipped model

# %%
model = restore_model(CHECKPOINT)
tokenizer = ByteTokenizer()
print(f"{model.config.model_type}: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
      f"{model.config.n_routed_experts} routed experts, MTP module: {model.mtp is not None}")

PROMPTS = ["import os\nimport sys\n\n\ndef ", "    def __repr__(self):\n        return "]
prompt_ids = [tokenizer.encode(p) for p in PROMPTS]


def show(result):
    """Print each row's prompt and decoded text."""
    for prompt, tokens, n in zip(PROMPTS, np.asarray(result.tokens), np.asarray(result.num_tokens)):
        print(repr(prompt), "->", repr(tokenizer.decode(tokens[:n])))


# %% [markdown]
# ## `generate` with MTP drafts
#
# One compiled program: the prefill, then a `jax.lax.while_loop` of speculative steps (draft k tokens, verify
# them in one call, accept the longest prefix that matches the target's greedy choice, commit) with no host
# round trip until every row is done.

# %%
chain = DecodeConfig(num_draft=NUM_DRAFT, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
result = generate(model, prompt_ids, chain)
show(result)
print(f"{result.steps} steps for {MAX_NEW_TOKENS} tokens per row; "
      f"mean accepted length {result.mean_accepted_length:.2f} tokens per target call")
print("acceptance per draft position", np.round(result.acceptance_per_position, 2))

# %% [markdown]
# ## One step at a time
#
# `init_state` runs the prefill and returns the loop's state, which holds its config; each `step` is one
# iteration of the loop. Between steps the state is on the host's side of the loop, so it can be read:
# `state.drafts` holds the drafts the latest step verified, `state.num_generated` how many tokens each row
# has. The state is donated to `step` (its arrays are consumed), so read what you need before the next step.

# %%
state = init_state(model, prompt_ids, chain)
emitted, accepted = np.asarray(state.num_generated), np.asarray(state.accepted)
print("after the prefill:", [tokenizer.decode(np.asarray(state.tokens)[b, :n]) for b, n in enumerate(emitted)])
while not bool(np.all(state.done)):
    state = step(model, state)
    now, accepted_now = np.asarray(state.num_generated), np.asarray(state.accepted)
    if int(state.steps) <= STEPS_SHOWN:
        tokens, drafts = np.asarray(state.tokens), np.asarray(state.drafts)
        for row in range(len(PROMPTS)):
            print(f"step {int(state.steps)} row {row}: drafted {tokenizer.decode(drafts[row])!r:12} "
                  f"accepted {accepted_now[row] - accepted[row]} of {NUM_DRAFT}, "
                  f"emitted {tokenizer.decode(tokens[row, emitted[row]:now[row]])!r}")
    emitted, accepted = now, accepted_now

stepped = np.asarray(state.tokens)[:, :MAX_NEW_TOKENS]
assert np.array_equal(stepped, np.asarray(result.tokens)), "stepping by hand must equal generate"
print(f"... {int(state.steps)} steps in all: the same tokens as generate")

# %% [markdown]
# ## Acceptance per draft position, and a tree's per depth
#
# For a chain, position j's acceptance is the fraction of steps whose j-th draft was accepted (so it can only
# fall with j). A draft tree verifies several branches in one call; its acceptance at depth j is the fraction
# of steps whose accepted path reached depth j.

# %%
tree = DecodeConfig(tree=TREE, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
tree_result = generate(model, prompt_ids, tree)
assert np.array_equal(np.asarray(tree_result.tokens), np.asarray(result.tokens)), "a tree is lossless too"
print(f"tree {TREE!r}: mean accepted length {tree_result.mean_accepted_length:.2f} "
      f"(chain of {NUM_DRAFT}: {result.mean_accepted_length:.2f})")

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
for axis, res, title, label in ((left, result, f"MTP chain, k = {NUM_DRAFT}", "draft position"),
                                (right, tree_result, f"draft tree {TREE!r}", "depth")):
    rates = res.acceptance_per_position
    axis.bar(np.arange(1, len(rates) + 1), rates)
    axis.set(title=f"{title}: {res.mean_accepted_length:.2f} tokens / call", xlabel=label,
             xticks=np.arange(1, len(rates) + 1), ylim=(0, 1))
left.set_ylabel("fraction of steps accepted")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Plain against speculative decoding
#
# `compile_generate` compiles ahead of time and returns a runner, so compilation and decoding are timed apart.
# On a CPU a verification call of k + 1 tokens costs about twice a plain step's, so speculation gains little
# there; on a GPU a step is bound by launches and memory reads, and verifying k + 1 tokens costs little more
# than one (`docs/performance.md` has measured figures).

# %% [markdown]
# ## What compiles again, and what does not
#
# `generate` compiles one program per model, batch size, prompt width, budget and `DecodeConfig`. The width
# and the budget (`max_new_tokens`) are padded up to buckets (16, 32, 64, ..., 1024, then multiples of 1024:
# `DecodeConfig.buckets`), and each row's budget and a sampled run's seed, temperature, top-k and top-p are
# values the program reads at run time, so new prompts of similar lengths, a similar budget or another
# temperature run the program already compiled. JAX reports every compile to `jax.monitoring`:

# %%
compiled = []


def on_compile(event, seconds, **info):
    if event == "/jax/core/compile/backend_compile_duration":
        compiled.append(info.get("fun_name"))


jax.monitoring.register_event_duration_secs_listener(on_compile)
other_prompts = ["from collections import ", "    def __init__(self, name):\n        self."]
start = time.perf_counter()
shorter = chain.replace(max_new_tokens=MAX_NEW_TOKENS - 8)  # the same budget bucket
generate(model, [tokenizer.encode(p) for p in other_prompts], shorter).tokens.block_until_ready()
jax.monitoring.unregister_event_duration_listener(on_compile)
print(f"two new prompts, 8 fewer tokens: {time.perf_counter() - start:.2f} s, programs compiled: {compiled}")
assert "jit(_generate)" not in compiled, "the prompts' width and budget buckets already had their program"

# %%
def timed(config):
    """Compile, then decode TIMING_RUNS times: (result, compile seconds, fastest run in seconds)."""
    start = time.perf_counter()
    run = compile_generate(model, prompt_ids, config)
    compiled = time.perf_counter() - start
    best = float("inf")
    for _ in range(TIMING_RUNS):
        start = time.perf_counter()
        out = run()
        jax.block_until_ready(out.tokens)
        best = min(best, time.perf_counter() - start)
    return out, compiled, best


plain = DecodeConfig(num_draft=0, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
(plain_out, plain_compile, plain_time), (spec_out, _, spec_time) = timed(plain), timed(chain)
total = len(PROMPTS) * MAX_NEW_TOKENS
for name, out, seconds in (("plain", plain_out, plain_time), (f"MTP k = {NUM_DRAFT}", spec_out, spec_time)):
    print(f"{name:10} {seconds * 1e3:7.1f} ms for {total} tokens (prefill included): {total / seconds:6.0f} tokens/s, "
          f"{out.steps} steps")
assert np.array_equal(np.asarray(plain_out.tokens), np.asarray(spec_out.tokens)), "lossless: the same tokens"
print(f"speedup {plain_time / spec_time:.2f}x, the same text")

# %% [markdown]
# ## The persistent compilation cache
#
# Every program compiled above is now a file in `CACHE_DIR` (JAX opens the cache at its first compile, so a
# later change of the directory in the same process is not seen). `jax.clear_caches()` drops the programs held in
# memory, as a new Python process would start without them; compiling plain decoding again then loads the
# program from disk. What remains is tracing and lowering the model, which the cache cannot skip. A later
# process (a restarted kernel, `python examples/generate.py --compile-cache DIR`) with the same shapes and the
# same `CACHE_DIR` loads every program the same way. Only programs for a real device are cached: a
# deviceless GPU compile (`jaxspec aot`) cannot use it.

# %%
entries = sorted(os.listdir(CACHE_DIR))
print(f"{len(entries)} programs in {CACHE_DIR}, {sum(os.path.getsize(os.path.join(CACHE_DIR, e)) for e in entries) / 2**20:.1f} MiB")
jax.clear_caches()
_, recompiled, _ = timed(plain)
print(f"plain decoding: compiled in {plain_compile:.2f} s the first time, {recompiled:.2f} s from the cache")
