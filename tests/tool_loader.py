"""Import a tool (``fedreid/commands/<name>.py``, run by ``tools/<name>.py``) as a fresh module, so tests
call its ``main`` and parser in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

COMMANDS = Path(__file__).resolve().parents[1] / "fedreid" / "commands"


def load_tool(name: str, module_name: str) -> ModuleType:
    """The tool ``<name>`` as the module ``module_name`` (registered in ``sys.modules`` for dataclasses)."""
    spec = importlib.util.spec_from_file_location(module_name, COMMANDS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def cli_error(tool: ModuleType, argv: list, capsys) -> str:
    """The one-line ``error: ...`` a tool's ``main(argv)`` ends with (exit code 2, no traceback)."""
    import pytest

    from fedreid.utils.cli import run_main

    with pytest.raises(SystemExit) as exc:
        run_main(lambda: tool.main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err
