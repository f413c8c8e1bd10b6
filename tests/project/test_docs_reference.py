"""The generated configuration reference, the ``#:`` comments it is made from, and the manual's links.

* ``docs/configuration.md`` is exactly what ``fedreid.docs_reference`` renders
  now (regenerate with ``python -m fedreid.docs_reference --write docs/configuration.md``);
* the page has a row for every field of every config dataclass and of every
  registered ``Options`` class, and a section for every registered name;
* every such field has a ``#:`` comment, except the listed ones;
* the README stays a front door (at most 220 lines), and every relative link
  of ``README.md`` and ``docs/*.md`` points to an existing file.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from fedreid import docs_reference as ref
from fedreid.config import Config

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"

# ---------------------------------------------------------------------------
# The committed page is the generated one
# ---------------------------------------------------------------------------


def test_committed_page_is_current():
    problem = ref.check(PAGE)
    assert problem is None, (
        f"docs/configuration.md is stale; regenerate it with `{ref.REGENERATE}` (from the repository root)\n"
        f"{problem}"
    )


def test_render_is_deterministic():
    assert ref.render_reference() == ref.render_reference()


# ---------------------------------------------------------------------------
# Everything is on the page
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


def test_every_config_key_has_a_row_and_no_other():
    text = ref.render_config()
    rows = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.M))
    actual = _config_keys()
    assert actual - rows == set(), "config keys missing from the generated reference"
    assert rows - actual == set(), "the generated reference lists keys that do not exist"


def test_every_registered_options_field_is_on_the_page():
    page = ref.render_reference()
    missing = []
    for label, cls in ref.documented_classes():
        if " " not in label:
            continue  # a config section ("data", "fl"): checked key by key above
        table = ref.options_table(cls)
        if table not in page:
            missing.append(f"{label}: {cls.__qualname__}")
        for f in dataclasses.fields(cls):
            if f"| `{f.name}` |" not in table:
                missing.append(f"{label}: {cls.__qualname__}.{f.name}")
    assert not missing, f"options not rendered on the page: {missing}"


def test_every_registered_name_has_a_section():
    from fedreid.data.raw import list_raw_datasets
    from fedreid.fl.local.objectives import OBJECTIVES
    from fedreid.fl.server_hooks import SERVER_HOOKS

    sections = {
        "objectives": (ref.render_objectives(), OBJECTIVES),
        "server hooks": (ref.render_hooks(), SERVER_HOOKS),
        "parsers": (ref.render_parsers(), list_raw_datasets()),
    }
    for what, (text, names) in sections.items():
        headings = re.findall(r"^### `([^`]+)`$", text, flags=re.M)
        assert headings == sorted(names), f"{what}: the page's sections {headings} are not the registry {sorted(names)}"


def test_registries_are_covered_by_the_options_check():
    from fedreid.fl.local.objectives import OBJECTIVES
    from fedreid.fl.server_hooks import SERVER_HOOKS

    classes = {cls for _, cls in ref.documented_classes()}
    for registry in (OBJECTIVES, SERVER_HOOKS):
        for name, cls in registry.items():
            options = getattr(cls, "Options", None)
            if options is not None and dataclasses.fields(options):
                assert options in classes, f"{name}: its Options {options.__qualname__} is not checked"


# ---------------------------------------------------------------------------
# Every field has a #: comment (with a known, shrinking list of exceptions)
# ---------------------------------------------------------------------------


def test_every_field_has_a_doc_comment():
    missing = sorted(ref.undocumented_fields())
    assert not missing, (
        "fields without a `#:` comment above them (write one; it becomes their description in "
        f"docs/configuration.md, then run `{ref.REGENERATE}`): {missing}"
    )


# ---------------------------------------------------------------------------
# The generator on a small example
# ---------------------------------------------------------------------------


@dataclass
class _Example:
    """An example options class."""

    #: How many (``n``) -- with a | pipe.
    count: int = 3
    #: One of two modes,
    #: on two lines.
    mode: Literal["a", "b"] = "a"
    limit: Optional[float] = None
    names: list[str] = field(default_factory=lambda: ["x", "y"])


def test_options_table_renders_types_defaults_and_comments():
    table = ref.options_table(_Example, "ex.")
    lines = table.splitlines()
    assert lines[0] == "| key | type | default | meaning |"
    assert lines[2] == "| `ex.count` | `int` | `3` | How many (`n`) -- with a \\| pipe. |"
    assert lines[3] == "| `ex.mode` | `'a' \\| 'b'` | `a` | One of two modes, on two lines. |"
    assert lines[4] == "| `ex.limit` | `float \\| null` | `null` |  |"
    assert lines[5] == "| `ex.names` | `list[str]` | `[x, y]` |  |"


def test_cli_write_and_check(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("# stale\n")
    assert ref.main(["--check", str(page)]) == 1
    err = capsys.readouterr().err
    assert ref.REGENERATE in err and "out of date" in err
    assert ref.main(["--write", str(page)]) == 0
    assert page.read_text() == ref.render_reference()
    assert ref.main(["--check", str(page)]) == 0
    assert ref.main(["--check", str(tmp_path / "missing.md")]) == 1


# ---------------------------------------------------------------------------
# The README is a front door; every relative link of the manual resolves
# ---------------------------------------------------------------------------


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 220, f"README.md has {lines} lines; keep it at most 220 and move details into docs/"


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img[^>]*\ssrc=\"([^\"]+)\"")


def _relative_links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor inline code
    links = [a or b for a, b in _LINK.findall(text)]
    return [link for link in links if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", link)]


def test_relative_links_resolve():
    pages = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
    broken = []
    for page in pages:
        for link in _relative_links(page.read_text()):
            target = (page.parent / link.split("#", 1)[0]).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(REPO)}: {link}")
    assert not broken, f"relative links to missing files: {broken}"


def test_readme_links_every_manual_page():
    readme = (REPO / "README.md").read_text()
    linked = {Path(link.split("#", 1)[0]).as_posix() for link in _relative_links(readme)}
    mine = ["docs/configuration.md", "docs/preparing.md", "docs/training.md", "docs/evaluation-tools.md",
            "docs/classification.md", "docs/flower.md", "docs/results.md", "docs/benchmarks.md",
            "docs/reproducing.md", "docs/retrieval-safety.md", "docs/extending.md"]
    assert [p for p in mine if p not in linked] == []
    assert len(_relative_links(readme)) >= len(mine)
