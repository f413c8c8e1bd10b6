"""What the README (and the manual pages it hands over to) tells users to run and read exists.

* every ``make <target>`` is a target of the Makefile;
* every ``python tools/<tool>.py ...`` command is accepted by that tool's
  argument parser (subcommand and options as written);
* every repository path it names (``tools/``, ``configs/``, ``fedreid/``...)
  exists, brace lists (``fedpav_{e5,e10}.yaml``) expanded;
* every config key it names (```fl.cdw```, ``data.workers=4``) is a real key.

Relative links and the README's length are checked in ``test_docs_reference.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import re
import shlex
import typing
from pathlib import Path

import pytest
from tool_loader import load_tool

from fedreid.config import Config

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

#: The pages whose text moved out of the README; they are held to the same checks.
MOVED_PAGES = (
    "docs/preparing.md",
    "docs/training.md",
    "docs/evaluation-tools.md",
    "docs/classification.md",
    "docs/flower.md",
    "docs/results.md",
    "docs/benchmarks.md",
)

PAGES = [README] + [REPO / p for p in MOVED_PAGES]


def _text(page: Path) -> str:
    return page.read_text()


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


# ---------------------------------------------------------------------------
# make targets
# ---------------------------------------------------------------------------


def _make_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m:
            targets |= set(m.group(1).split())
    return targets


def test_make_targets_exist():
    mentioned = set()
    for page in PAGES:
        mentioned |= set(re.findall(r"(?:^|[`\s])make ([a-z][a-z-]*)", _text(page), flags=re.M))
    assert {"test", "demo"} <= mentioned, "the README must give the two commands"
    missing = sorted(mentioned - _make_targets())
    assert not missing, f"make targets named in the docs but absent from the Makefile: {missing}"


# ---------------------------------------------------------------------------
# tool commands
# ---------------------------------------------------------------------------


def _commands(text: str) -> list[str]:
    """``python tools/...`` command lines: in fenced blocks (continuations joined) and in inline code."""
    out = []
    in_block = False
    pending = ""
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
            pending = ""
            continue
        if in_block:
            stripped = line.strip()
            if pending:
                pending += " " + stripped.rstrip("\\").strip()
            elif re.match(r"^(\$ )?python tools/", stripped):
                pending = stripped.removeprefix("$ ").rstrip("\\").strip()
            else:
                continue
            if not stripped.endswith("\\"):
                out.append(pending)
                pending = ""
        else:
            out += re.findall(r"`(python tools/[^`]+)`", line)
    return out


_PARSERS: dict[str, object] = {}


def _parser(tool: str):
    if tool not in _PARSERS:
        _PARSERS[tool] = load_tool(tool, f"readme_{tool}_tool").build_parser()
    return _PARSERS[tool]


def _all_commands() -> list[tuple[str, str]]:
    return [(_page_id(page), cmd) for page in PAGES for cmd in _commands(_text(page))]


def test_readme_shows_the_tools():
    tools = {re.match(r"python tools/(\w+)\.py", cmd).group(1) for page, cmd in _all_commands() if page == "README.md"}
    assert {"prepare_datasets", "train_fed", "eval_reid"} <= tools


@pytest.mark.parametrize("page,command", _all_commands())
def test_tool_command_parses(page, command):
    argv = shlex.split(command, comments=True)
    tool = re.fullmatch(r"tools/(\w+)\.py", argv[1])
    assert tool and (REPO / argv[1]).is_file(), f"{page}: {command}: no such tool {argv[1]}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser(tool.group(1)).parse_args(argv[2:])
    except SystemExit as exc:
        pytest.fail(f"{page}: `{command}` is refused by {argv[1]} (exit {exc.code}): {err.getvalue().strip()}")


# ---------------------------------------------------------------------------
# repository paths
# ---------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w./-])((?:tools|bench|configs|fedreid|docs|tests|\.ci)/[\w./{},-]*|datasets/README\.md)")


def _expand(path: str) -> list[str]:
    """``a_{x,y}_b{1,2}`` -> every combination."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _paths(text: str) -> set[str]:
    found = set()
    for match in _PATH.finditer(text):
        path = match.group(1).rstrip(".,:;")
        if "{" in path and "}" not in path:  # a brace list cut by the pattern
            continue
        found |= set(_expand(path))
    return found


def _table_configs(text: str) -> set[str]:
    """Config file names in table rows (``| `fedpav_e5.yaml`, `fedpav_e10.yaml` | ...``), brace lists expanded."""
    names = set()
    for line in text.splitlines():
        if line.startswith("|"):
            for name in re.findall(r"(?<![\w/{},.-])([\w{},-]+\.yaml)", line):
                names |= set(_expand(name))
    return names


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_paths_exist(page):
    text = _text(page)
    missing = sorted(p for p in _paths(text) if not (REPO / p).exists())
    assert not missing, f"{_page_id(page)} names files that do not exist: {missing}"
    configs = {p.name for p in (REPO / "configs").rglob("*.yaml")}
    unknown = sorted(_table_configs(text) - configs)
    assert not unknown, f"{_page_id(page)} lists config files that are not under configs/: {unknown}"


# ---------------------------------------------------------------------------
# config keys
# ---------------------------------------------------------------------------


def _config_keys(cls: type = Config, prefix: str = "") -> set[str]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            keys |= _config_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def _mentioned_keys(text: str) -> set[str]:
    hints = typing.get_type_hints(Config)
    sections = "|".join(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name]))
    inline = re.findall(rf"`((?:{sections})\.[a-z][a-z0-9_]*)", text)  # `fl.cdw`, `data.workers=4`, `fl.hooks: [...]`
    overrides = re.findall(rf"(?<![\w./-])((?:{sections})\.[a-z][a-z0-9_]*)=", text)  # data.workers=4 in commands
    return set(inline) | set(overrides)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_config_keys_exist(page):
    actual = _config_keys()
    unknown = sorted(_mentioned_keys(_text(page)) - actual)
    assert not unknown, f"{_page_id(page)} names config keys that do not exist: {unknown}"


def test_checks_find_something():
    """The patterns above still match the README (a reformatting must not make the checks vacuous)."""
    text = _text(README)
    assert len(_commands(text)) >= 4
    assert {"configs/fedreid/demo_synthetic.yaml", "docs/extending.md"} <= _paths(text)
    assert {"data.workers", "run.device"} <= _mentioned_keys(text)
    assert {"fedpav_e10.yaml", "synthetic_local.yaml"} <= _table_configs(_text(REPO / "docs/training.md"))


# ---------------------------------------------------------------------------
# the tour's output blocks (written by docs/tour.py from a real run)
# ---------------------------------------------------------------------------


def _tour_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_tour", REPO / "docs" / "tour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOUR_PAGES = [README] + sorted((REPO / "docs").glob("*.md"))


def _tour_blocks():
    tour = _tour_module()
    for page in TOUR_PAGES:
        for m in tour.BLOCK.finditer(page.read_text()):
            yield page, m.group("name"), m.group(0).split("```\n")[1]


def test_tour_blocks_show_their_step_command_and_its_output():
    tour = _tour_module()
    blocks = list(_tour_blocks())
    assert {name for _, name, _ in blocks} == set(tour.STEPS)  # every step is shown somewhere
    for page, name, body in blocks:
        command = tour.shown(tour.STEPS[name])
        assert body.startswith(command + "\n"), f"{_page_id(page)}: tour block {name!r} was edited by hand"
        assert body[len(command):].strip(), f"{_page_id(page)}: tour block {name!r} has no output"


def test_the_documented_training_summary_is_what_the_code_prints():
    from fedreid.eval.report import format_paper_summary, paper_summary

    tool = load_tool("train_fed", "train_fed_readme")
    metrics = {"rank1": 0.5, "rank5": 0.6, "rank10": 0.7, "mAP": 0.4, "mINP": 0.3, "rank1_official": 0.5,
               "mAP_official": 0.4}
    history = [{"round": r, "eval": {"a": dict(metrics), "b": dict(metrics)}} for r in (1, 2, 3)]
    caption, _, table = format_paper_summary(paper_summary(history)).partition("\n\n")
    caption_re = (re.escape(caption).replace("3", r"\d+").replace(r"1,\ 2,\ \d+", r"[\d, ]+")
                  .replace(r"a,\ b", r"[\w, ]+"))
    header = table.splitlines()[0]
    round_re = re.escape(tool.round_line({"round": 3, "train_loss": 1.5, "time": {"round": 2.0},
                                          "eval": {"a": metrics}}, 9))
    round_re = re.sub(r"\d+(?:\\\.\d+)?", r"[\\d.]+", round_re)  # every number may vary
    shown = [body for _, name, body in _tour_blocks() if name == "train"]
    assert shown
    for body in shown:
        lines = body.splitlines()
        assert any(re.fullmatch(caption_re, ln) for ln in lines), body
        assert header in lines, body
        evaluated = [ln for ln in lines if ln.startswith("round ") and "mean Rank-1" in ln]
        assert evaluated and all(re.fullmatch(round_re, ln) for ln in evaluated), evaluated

