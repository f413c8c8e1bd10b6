"""run_main: input errors become one line and exit code 2; bugs keep their traceback."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import fedreid
from fedreid.config import load_config
from fedreid.errors import FedReIDError
from fedreid.utils.cli import literal_override, run_main


def _all_input_errors() -> list[type]:
    for module in pkgutil.walk_packages(fedreid.__path__, "fedreid."):
        importlib.import_module(module.name)
    found, todo = [], [FedReIDError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_input_error_prints_one_line(capsys):
    errors = _all_input_errors()
    names = {cls.__name__ for cls in errors}
    # the errors users meet first, from config to checkpoints
    assert {"ConfigError", "RawLayoutError", "PreparedDatasetError", "ScenarioError", "ClientError",
            "CheckpointError", "PretrainedWeightsError", "IndexFileError", "ImageReadError",
            "RoundFailedError", "CodecError", "LaunchError"} <= names
    for cls in errors:
        def main(cls=cls) -> int:
            raise cls(f"/data/x.yaml: bad value ({cls.__name__})")

        with pytest.raises(SystemExit) as exc:
            run_main(main)
        assert exc.value.code == 2
        assert capsys.readouterr().err == f"error: /data/x.yaml: bad value ({cls.__name__})\n"


@pytest.mark.parametrize(
    "exc_type", [FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError]
)
def test_errors_about_user_paths_print_one_line(exc_type, capsys):
    def main() -> int:
        raise exc_type("runs/demo already exists")

    with pytest.raises(SystemExit) as exc:
        run_main(main)
    assert exc.value.code == 2 and capsys.readouterr().err == "error: runs/demo already exists\n"


def test_unreadable_folder_prints_one_line(tmp_path, capsys):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads every folder")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        with pytest.raises(SystemExit) as exc:
            run_main(lambda: len(list(locked.iterdir())))
    finally:
        locked.chmod(0o700)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and str(locked) in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("exc", [ZeroDivisionError("a bug"), OSError(28, "No space left on device")])
def test_bugs_and_other_os_errors_are_not_hidden(exc):
    def main() -> int:
        raise exc

    with pytest.raises(type(exc)):
        run_main(main)


@pytest.mark.parametrize("path", ["/tmp/run #2", "/x/my: out", "null", "true", "3", "[a, b]", "a\"b\\c", "é #1"])
def test_literal_override_keeps_the_string(path):
    # Overrides are YAML: a bare "/tmp/run #2" would silently become "/tmp/run".
    cfg = load_config(None, [literal_override("run.out_dir", path)])
    assert cfg.run.out_dir == path


def test_success_exit_code():
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: 0)
    assert exc.value.code == 0


# ----------------------------------------------------------------- overrides among the options


def _parser_with_overrides():
    import argparse

    from fedreid.utils.cli import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--rounds", type=int)
    return parser


def test_overrides_may_stand_between_options():
    args = _parser_with_overrides().parse_args(["fl.rounds=1", "--no-progress", "seed=2", "--rounds", "3", "a.b=c"])
    assert args.overrides == ["fl.rounds=1", "seed=2", "a.b=c"] and args.no_progress and args.rounds == 3
    args = _parser_with_overrides().parse_args(["--no-progress", "seed=2"])
    assert args.overrides == ["seed=2"]
    with pytest.raises(SystemExit):  # unknown options are still refused
        _parser_with_overrides().parse_args(["seed=2", "--bogus"])


def test_every_tool_with_overrides_takes_them_between_flags():
    import importlib

    def load(name):
        return importlib.import_module(f"fedreid.commands.{name}")

    args = load("train_fed").build_parser().parse_args(["fl.rounds=1", "--no-progress", "seed=2"])
    assert args.overrides == ["fl.rounds=1", "seed=2"] and args.no_progress
    args = load("flower_fed").build_parser().parse_args(
        ["local", "--config", "c.yaml", "fl.rounds=1", "--out", "runs/x", "seed=2", "--tls"])
    assert args.overrides == ["fl.rounds=1", "seed=2"] and args.out == "runs/x" and args.tls


# ----------------------------------------------------------------------------- broken pipes


def _tool_with_closed_stdout(*argv: str):
    """Run a tool whose reader closes the pipe before the tool writes (``tool | head -0``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    read, write = os.pipe()
    os.close(read)  # no reader any more: the tool's first real write breaks the pipe
    try:
        done = subprocess.run([sys.executable, str(root / "tools" / argv[0]), *argv[1:]], stdout=write,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=root, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.close(write)
    return done


def test_a_closed_pipe_ends_a_tool_quietly():
    from fedreid.utils.cli import BROKEN_PIPE_EXIT

    done = _tool_with_closed_stdout("reproduce.py", "--list")  # `tools/reproduce.py --list | head -1`
    assert done.stderr.decode() == "" and done.returncode == BROKEN_PIPE_EXIT


@pytest.mark.parametrize("tool", ["train_fed.py", "prepare_datasets.py", "eval_reid.py", "flower_fed.py"])
def test_help_into_a_closed_pipe_is_quiet(tool):
    from fedreid.utils.cli import BROKEN_PIPE_EXIT

    done = _tool_with_closed_stdout(tool, "--help")  # argparse drops what it cannot write, and exits 0
    assert done.stderr.decode() == "" and done.returncode in (0, BROKEN_PIPE_EXIT)


def test_a_pipe_closed_while_printing_ends_quietly(capsys, monkeypatch):
    import io
    import os
    import sys

    from fedreid.utils.cli import BROKEN_PIPE_EXIT

    class Broken(io.TextIOWrapper):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    read, write = os.pipe()
    stream = Broken(os.fdopen(os.dup(write), "wb"))
    monkeypatch.setattr(sys, "stdout", stream)
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: print("a line") or 0)
    os.close(read)
    os.close(write)
    assert exc.value.code == BROKEN_PIPE_EXIT
