"""`jaxspec.progress`: bars and clocks on stderr only when it is a terminal, and stdout's lines intact
either way; and the command-line errors that name what is wrong with a directory."""

from __future__ import annotations

import importlib.util
import io
import os
import pty
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxspec import progress

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as a user's stderr does."""

    def isatty(self) -> bool:
        return True


def work(items: int = 3) -> None:
    """A loop that prints a row per item (a benchmark's table), a line on stderr, then a long call."""
    for i in progress.bar(range(items), "grid", unit="point"):
        print("row", i, flush=True)
        progress.write(f"note {i}")
        time.sleep(0.12)  # past tqdm's 0.1 s between redraws
    with progress.elapsed("compiling", every=0.02):
        time.sleep(0.2)


def clocks() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == progress.CLOCK_THREAD]


def test_quiet_when_stderr_is_not_a_terminal(capsys):
    work()
    out = capsys.readouterr()
    assert out.out == "row 0\nrow 1\nrow 2\n"
    assert out.err == "note 0\nnote 1\nnote 2\n"  # the written lines only: no bar, no clock
    assert not clocks()


def test_bar_and_clock_when_stderr_is_a_terminal(monkeypatch):
    err, out = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    work()
    assert out.getvalue() == "row 0\nrow 1\nrow 2\n"  # the rows intact, each on its own line
    drawn = err.getvalue()
    assert "grid:  67%" in drawn and "| 2/3 [" in drawn
    assert "\nnote 0\n" in drawn.replace("\r", "\n")
    assert drawn.count("compiling: 00:00") >= 3  # redrawn while the call blocks, not only at its start and end
    assert not clocks()  # the clock's thread has ended


def test_bar_on_a_real_terminal(tmp_path):
    """The same through a pseudo-terminal (tqdm sizes the bar from it): stdout's rows stay whole lines."""
    script = tmp_path / "work.py"
    script.write_text("import fcntl, struct, sys, termios\n"
                      "fcntl.ioctl(2, termios.TIOCSWINSZ, struct.pack('HHHH', 24, 80, 0, 0))\n"
                      f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "from test_progress import work\nwork()\n")
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the process has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=60) == 0
    screen = b"".join(chunks).decode()
    assert "grid:  67%" in screen and "compiling: 00:00" in screen
    lines = [line.strip() for line in screen.replace("\r", "\n").split("\n")]
    assert [line for line in lines if line.startswith("row")] == ["row 0", "row 1", "row 2"]


# -- errors that name the real problem ------------------------------------------------------------

def generate_script():
    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_checkpoint_directory_errors(tmp_path, capsys):
    """--checkpoint and `jaxspec convert SRC` say that a directory is absent, or has no config.json,
    before anything else is asked of it (a missing directory once read "no tokenizer.json there")."""
    from jaxspec import cli

    script = generate_script()
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    for name, why in (("absent", "no such directory"), ("file", "not a directory"),
                      ("empty", "no config.json in it, so not a checkpoint directory")):
        with pytest.raises(SystemExit):
            script.parse_args(["--checkpoint", str(tmp_path / name), "--prompt-ids", "1,2"])
        err = capsys.readouterr().err
        assert f"--checkpoint: {tmp_path / name}: {why}" in err and "tokenizer" not in err
        with pytest.raises(SystemExit):
            cli.main(["convert", str(tmp_path / name), str(tmp_path / "out")])
        assert f"argument src: {tmp_path / name}: {why}" in capsys.readouterr().err


def test_missing_config_json_is_a_value_error(tmp_path):
    from jaxspec import cli
    from jaxspec.model_config import ModelConfig

    with pytest.raises(ValueError, match=f"config.json: {tmp_path / 'config.json'} does not exist"):
        ModelConfig.from_hf(tmp_path)
    assert cli.main(["aot", "--config", str(tmp_path / "absent.json"), "--batch", "1", "--context", "8"]) == 1
