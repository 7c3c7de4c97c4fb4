"""The public API as a user meets it: `from jaxspec import ...`, `help(jaxspec)`, the README.

Every Python block of README.md runs here exactly as written, and every command its shell blocks
show for a script (`python path/to/script.py ...`, `jaxspec ...`) starts and answers `--help`, so
an edit that breaks an example fails a test.
"""

from __future__ import annotations

import inspect
import os
import pydoc
import re
import runpy
import subprocess
import sys

import pytest

import jaxspec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def readme_blocks(language: str) -> list[str]:
    with open(README) as f:
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


def test_readme_python_blocks_run_as_written():
    blocks = readme_blocks("python")
    assert blocks, "README.md has no python block"
    for block in blocks:
        exec(compile(block, README, "exec"), {"__name__": "readme"})


def readme_commands() -> list[str]:
    """The script commands of README.md's shell blocks: `python <file>.py ...` and `jaxspec ...`."""
    commands = []
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            for command in line.split("#")[0].split("&&"):
                words = command.split()
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                    words = words[1:]
                if words[:1] == ["python"] and len(words) > 1 and words[1].endswith(".py"):
                    commands.append(" ".join(words[:2]))
                elif words[:1] == ["jaxspec"]:
                    commands.append(" ".join(w for w in words[:2] if not w.startswith("-")))
    return commands


def test_readme_shows_the_main_job_and_benchmarks():
    commands = readme_commands()
    assert "python examples/generate.py" in commands
    assert any(c.startswith("python benchmarks/") for c in commands)


@pytest.mark.parametrize("command", sorted(set(readme_commands())))
def test_readme_command_answers_help(command, monkeypatch, capsys):
    """Run as `python` would run it (`runpy`: the script as __main__, its directory first on the
    path; `jaxspec` is the console script's module), in this process: a subprocess per command
    cost ~4 s of CPU each, mostly importing JAX again."""
    words = command.split()
    if words[0] == "python":
        script = os.path.join(REPO, words[1])
        monkeypatch.syspath_prepend(os.path.dirname(script))
        monkeypatch.setattr(sys, "argv", [script, "--help"])
        run = lambda: runpy.run_path(script, run_name="__main__")
    else:
        monkeypatch.setattr(sys, "argv", ["jaxspec", *words[1:], "--help"])
        run = lambda: runpy.run_module("jaxspec.cli", run_name="__main__")
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code in (0, None), capsys.readouterr().err[-2000:]
    assert "usage:" in capsys.readouterr().out
