"""The public API as a user meets it: `from jaxspec import ...`, `help(jaxspec)`, the docs.

Every Python block of README.md and of docs/*.md runs here exactly as written, every command their
shell blocks show for a script (`python path/to/script.py ...`, `jaxspec ...`) starts and answers
`--help`, and every link between them names a file (and heading) that exists, so an edit that
breaks an example or moves a page fails a test. README.md stays short enough to read on a screen.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import os
import pydoc
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.batch import budget_bucket, prompt_bucket

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
PAGES = [README, *sorted(glob.glob(os.path.join(DOCS, "*.md")))]
README_MAX_CHARS = 12_000


def page_id(path: str) -> str:
    return os.path.relpath(path, REPO)


def code_blocks(path: str, language: str) -> list[str]:
    with open(path) as f:
        text = f.read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (a first import of jaxspec, as a new user has)."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("order", [jaxspec.__all__, list(reversed(jaxspec.__all__))])
def test_from_import_gives_the_objects_in_any_order(order):
    """`from jaxspec import generate` once returned the submodule `jaxspec/generate.py`: the second
    lookup of a `from` import found the module the first lookup had bound."""
    names = ", ".join(order)
    code = (f"import types, jaxspec\nfrom jaxspec import {names}\n"
            f"objs = [{names}]\n"
            "assert not any(isinstance(o, types.ModuleType) for o in objs), objs\n"
            "assert all(callable(o) for o in objs), objs\n"
            # A second `from` import and attribute access give the very same objects.
            f"from jaxspec import {names}\n"
            f"assert [{names}] == objs\n"
            f"assert [getattr(jaxspec, n) for n in {list(order)!r}] == objs\n"
            "import jaxspec.generation, jaxspec.loop\n"
            "assert jaxspec.generate is jaxspec.generation.generate and jaxspec.step is jaxspec.loop.step\n"
            "print('ok')")
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_import_is_cheap():
    """`import jaxspec` and its leaf modules load neither flax nor the engine."""
    proc = run_python("import sys, jaxspec, jaxspec.model_config, jaxspec.decode_config, jaxspec.presets, jaxspec.cache\n"
                      "print(sorted(m for m in ('flax', 'jaxspec.loop', 'jaxspec.generation') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'genrate'"):
        jaxspec.genrate  # noqa: B018


def test_help_lists_every_public_name():
    text = pydoc.render_doc(jaxspec, renderer=pydoc.plaintext)
    missing = [name for name in jaxspec.__all__ if not re.search(rf"\b{name}\b", text)]
    assert not missing, f"help(jaxspec) does not list {missing}"


@pytest.mark.parametrize("name", jaxspec.__all__)
def test_docstring_names_every_argument(name):
    obj = getattr(jaxspec, name)
    doc = inspect.getdoc(obj) or ""
    signature = inspect.signature(obj.__init__ if inspect.isclass(obj) and not hasattr(obj, "_fields")
                                  and not hasattr(obj, "__dataclass_fields__") else obj)
    params = [p for p in signature.parameters if p != "self"]
    missing = [p for p in params if not re.search(rf"\b{p}\b", doc)]
    assert len(doc) > 80, f"{name} has no real docstring"
    assert not missing, f"the docstring of {name} does not say what {missing} are"


def test_readme_fits_on_a_screen():
    """What jaxspec is, setting it up, using it and its guarantees; the rest lives in docs/."""
    with open(README) as f:
        size = len(f.read())
    assert size <= README_MAX_CHARS, f"README.md has {size:,} characters (at most {README_MAX_CHARS:,}): move detail to docs/"


def test_readme_and_docs_have_python_blocks():
    assert code_blocks(README, "python"), "README.md has no python block"
    assert len(PAGES) > 1, "docs/ has no page"


@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks(p, "python")], ids=page_id)
def test_python_blocks_run_as_written(page):
    for block in code_blocks(page, "python"):
        exec(compile(block, page, "exec"), {"__name__": "docs"})


def shell_commands(page: str) -> dict[str, set[str]]:
    """The script commands of a page's shell blocks (```bash and ```sh; a line ending in `\\`
    continues): `python <file>.py ...` and `jaxspec <subcommand> ...`, each with the --flags the
    page gives it (a `--flag=value` counted as --flag)."""
    commands: dict[str, set[str]] = {}
    for block in code_blocks(page, "bash") + code_blocks(page, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("#")[0].split("&&"):
                words = command.split()
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                    words = words[1:]
                if words[:1] in (["python"], ["python3"]) and len(words) > 1 and words[1].endswith(".py"):
                    name = f"python {words[1]}"
                elif words[:1] == ["jaxspec"]:
                    name = " ".join(w for w in words[:2] if not w.startswith("-"))
                else:
                    continue
                flags = {w.split("=")[0] for w in words[2:] if w.startswith("--") and w != "--help"}
                commands.setdefault(name, set()).update(flags)
    return commands


ALL_COMMANDS: dict[str, set[str]] = {}
for _page in PAGES:
    for _name, _flags in shell_commands(_page).items():
        ALL_COMMANDS.setdefault(_name, set()).update(_flags)


def test_readme_shows_the_main_job_and_docs_the_benchmarks():
    assert "python examples/generate.py" in shell_commands(README)
    assert any(c.startswith("python benchmarks/") for c in shell_commands(os.path.join(DOCS, "benchmarks.md")))


@pytest.mark.parametrize("command", sorted(ALL_COMMANDS))
def test_command_answers_help(command, monkeypatch, capsys):
    """Every script command the pages show answers `--help`, and its help names every --flag the
    pages give it (a renamed or dropped flag fails here, not in a reader's shell). Run as `python`
    would run it (`runpy`: the script as __main__, its directory first on the path; `jaxspec` as its
    console script calls `jaxspec.cli.main`), in this process: a subprocess per command cost ~4 s of
    CPU each, mostly importing JAX again."""
    words = command.split()
    if words[0] == "python":
        script = os.path.join(REPO, words[1])
        monkeypatch.syspath_prepend(os.path.dirname(script))
        monkeypatch.setattr(sys, "argv", [script, "--help"])
        run = lambda: runpy.run_path(script, run_name="__main__")
    else:
        monkeypatch.setattr(sys, "argv", ["jaxspec", *words[1:], "--help"])
        run = lambda: sys.exit(cli.main())  # what the console script runs
    with pytest.raises(SystemExit) as exited:
        run()
    captured = capsys.readouterr()
    assert exited.value.code in (0, None), captured.err[-2000:]
    assert "usage:" in captured.out
    known = set(re.findall(r"--[\w-]+", captured.out))
    assert not ALL_COMMANDS[command] - known, f"{command}: the docs give {sorted(ALL_COMMANDS[command] - known)}"


def heading_anchors(path: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces -> '-'."""
    with open(path) as f:
        headings = re.findall(r"^#+ (.+)$", f.read(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def links(page: str) -> list[tuple[str, str]]:
    """(file, anchor) of each relative markdown link of a page, and of each `docs/NAME.md` it names;
    the file relative to the repository, anchor '' where none."""
    with open(page) as f:
        text = f.read()
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        path = os.path.join(os.path.dirname(page), path) if path else page
        found.append((os.path.relpath(os.path.normpath(path), REPO), anchor))
    found += [(name, "") for name in re.findall(r"(?<![\w/.])docs/[\w.-]+\.md", text)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_name_pages_that_exist(page):
    """A link to a page (or heading) that does not exist, or not yet, is a broken promise."""
    broken = [f"{path}#{anchor}" if anchor else path for path, anchor in links(page)
              if not os.path.exists(os.path.join(REPO, path))
              or anchor and anchor not in heading_anchors(os.path.join(REPO, path))]
    assert not broken, f"{page_id(page)} links to {broken}"


def test_every_docs_page_is_in_the_index():
    index = {path for path, _ in links(os.path.join(DOCS, "README.md"))}
    missing = [page_id(p) for p in PAGES[1:] if page_id(p) not in index and not p.endswith("README.md")]
    assert not missing, f"docs/README.md does not list {missing}"


# "name [dims]" in a docstring: a field and its documented shape (dims are names or small expressions).
DOCUMENTED_SHAPE = re.compile(r"\b([a-z_][a-z0-9_]*) \[([A-Za-z0-9_ ,+\-]*)\]")


def documented_shapes(cls) -> dict[str, str]:
    """field -> the shape its class docstring gives it, for the fields the class has."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return {name: dims for name, dims in DOCUMENTED_SHAPE.findall(inspect.getdoc(cls)) if name in fields}


def test_result_and_state_docstrings_give_the_shapes_they_hold():
    """Every shape that GenerateResult's and DecodeState's docstrings state is the shape a real run
    holds, dimension by dimension (B rows, D the draft depth, N window nodes, T the token buffer,
    V the vocabulary, H the hidden width, P the prompt width; the budget in T and P as padded to
    their buckets). The state comes from a loop-mode prefill, the one that fills every field
    (prompts and prompt_lens are None otherwise)."""
    from flax import nnx

    config = jaxspec.preset("tiny")
    model = jaxspec.DeepseekV3(config, rngs=nnx.Rngs(0))
    decode = jaxspec.DecodeConfig(num_draft=3, max_new_tokens=6)
    prompts = [[3, 5, 7], [11, 13]]
    sizes = dict(B=len(prompts), D=decode.num_draft, N=decode.num_draft + 1, V=config.vocab_size,
                 H=config.hidden_size, max_new_tokens=decode.max_new_tokens,
                 P=prompt_bucket(max(map(len, prompts)), decode, max_positions=config.max_position_embeddings))
    sizes["T"] = budget_bucket(sizes["P"], decode, max_positions=config.max_position_embeddings) + sizes["D"] + 1
    results = {jaxspec.GenerateResult: jaxspec.generate(model, prompts, decode),
               jaxspec.DecodeState: jaxspec.init_state(model, prompts, dataclasses.replace(decode, prefill_in_loop=True))}
    for cls, value in results.items():
        shapes = documented_shapes(cls)
        assert len(shapes) >= 3, f"{cls.__name__}'s docstring states too few shapes to check: {shapes}"
        for name, dims in shapes.items():
            want = tuple(eval(dim, {}, sizes) for dim in dims.split(",") if dim.strip())
            assert np.shape(getattr(value, name)) == want, (
                f"{cls.__name__}.{name}: documented [{dims}] = {want}, holds {np.shape(getattr(value, name))}")
