"""The installed tools: ``fedreid <command>``, ``python -m fedreid``, ``fedreid-<command>``, ``tools/*.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedreid.__main__ import main
from fedreid.commands import COMMANDS, command_module

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_every_command_has_a_console_script_and_a_checkout_tool():
    setup = (REPO / "setup.py").read_text()
    scripts = dict(re.findall(r'"([\w-]+)=fedreid\.commands\.(\w+):cli"', setup))
    assert scripts == {f"fedreid-{name}": module for name, (module, _) in COMMANDS.items()}
    assert '"fedreid=fedreid.__main__:cli"' in setup
    tools = {p.stem for p in (REPO / "tools").glob("*.py")}
    assert tools == {module for module, _ in COMMANDS.values()}
    for module in tools:
        assert f"from fedreid.commands.{module} import cli" in (REPO / "tools" / f"{module}.py").read_text()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_module_has_main_and_cli(name):
    module = command_module(name)
    assert callable(module.main) and callable(module.cli)


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, summary) in COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(summary)}$", out, re.M), out


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert capsys.readouterr().out.startswith("usage: fedreid <command>")


def test_unknown_command_is_one_line_with_did_you_mean(capsys):
    assert main(["trian", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown command 'trian' (did you mean train?)") and "\n" not in err


def test_a_command_gets_the_rest_of_the_arguments(capsys):
    # reproduce --list prints the tables without touching data: the arguments reached the tool.
    assert main(["reproduce", "--list"]) == 0
    assert re.search(r"^fedreid-table2: ", capsys.readouterr().out, re.M)


def test_python_dash_m_fedreid_runs_outside_the_checkout(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedreid", "train", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: fedreid train ")


@pytest.mark.skipif(not (BIN / "fedreid-eval").exists(), reason="the package is not pip-installed here")
def test_installed_console_scripts_run_outside_the_checkout(tmp_path):
    out = subprocess.run([str(BIN / "fedreid-eval"), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: fedreid-eval ") and "index" in out.stdout
    out = subprocess.run([str(BIN / "fedreid"), "prepare", "--datasets", "nosuch"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: "), (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
