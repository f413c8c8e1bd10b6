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
