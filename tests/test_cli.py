"""run_main: input errors become one line and exit code 2; bugs keep their traceback."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import fedreid
from fedreid.errors import FedReIDError
from fedreid.utils.cli import run_main


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


@pytest.mark.parametrize("exc_type", [FileNotFoundError, FileExistsError])
def test_missing_or_existing_files_print_one_line(exc_type, capsys):
    def main() -> int:
        raise exc_type("runs/demo already exists")

    with pytest.raises(SystemExit) as exc:
        run_main(main)
    assert exc.value.code == 2 and capsys.readouterr().err == "error: runs/demo already exists\n"


def test_bugs_are_not_hidden():
    def main() -> int:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        run_main(main)


def test_success_exit_code():
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: 0)
    assert exc.value.code == 0
