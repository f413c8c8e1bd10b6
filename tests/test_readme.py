"""The README's configuration reference documents every config key, and no key that does not exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from fedreid.config import Config

README = Path(__file__).resolve().parents[1] / "README.md"


def _config_keys(cls: type = Config, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name) if prefix == "" else None
        if dataclasses.is_dataclass(default):
            keys |= _config_keys(type(default), f"{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def _documented_keys() -> set[str]:
    text = README.read_text()
    reference = text[text.index("## Configuration reference"):]
    reference = reference[: reference.index("\n## ", 1)]
    keys = set()
    for line in reference.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            keys |= set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)?)`", first_cell))
    return keys


def test_every_config_key_is_documented():
    documented, actual = _documented_keys(), _config_keys()
    assert actual - documented == set(), "undocumented config keys"
    assert documented - actual == set(), "README documents keys that do not exist"
