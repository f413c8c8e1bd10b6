"""fedreid.inference.model_io.load_model: damaged files and files of another model are one clean line."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_runs import save_tiny_run

from fedreid.config import ModelConfig, to_dict
from fedreid.inference.errors import EvalInputError
from fedreid.inference.model_io import load_model
from fedreid.models.reid import create_reid_model, shared_state


def _line(info: pytest.ExceptionInfo) -> str:
    text = str(info.value)
    assert text and "\n" not in text
    return text


def test_a_truncated_model_file_is_one_sentence_naming_it_without_torchs_words(tmp_path):
    run = save_tiny_run(tmp_path / "run", 64, 32)
    truncated = tmp_path / "truncated.pt"
    data = (run / "model_final.pt").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(EvalInputError) as info:
        load_model(truncated)
    text = _line(info)
    assert text.startswith(f"model file {truncated} is a damaged or truncated PyTorch file: ")
    assert "not a complete file written by torch.save" in text
    assert "PytorchStreamReader" not in text and "miniz" not in text  # torch's words, cut mid-sentence before


def _model_file(tmp_path, name: str, backbone: str, dim: int, state) -> str:
    cfg = ModelConfig(backbone=backbone, bottleneck_dim=dim, height=64, width=32)
    path = tmp_path / name
    torch.save({"format": "fedreid.model", "model": to_dict(cfg), "round": 1, "state": state}, path)
    return path


def _listed_keys(text: str) -> list[str]:
    return re.findall(r"(?:backbone|bottleneck)\.[\w.]+", text.split("): ", 1)[1])


def test_a_file_of_another_model_names_the_configured_one_and_at_most_three_keys(tmp_path):
    state = shared_state(create_reid_model("resnet18", 0, bottleneck_dim=32, seed=0))
    other = _model_file(tmp_path, "r34.pt", "resnet34", 32, state)  # resnet18 weights, config says resnet34
    with pytest.raises(EvalInputError) as info:
        load_model(other)
    text = _line(info)
    assert text.startswith(f"model file {other}: saved state does not fit the model its config describes "
                           "(backbone 'resnet34', bottleneck_dim 32): ")
    assert re.search(r"\b\d+ missing keys \(", text) and re.search(r", \d+ more\)", text)
    assert len(_listed_keys(text)) <= 3

    wide = _model_file(tmp_path, "b64.pt", "resnet18", 64, state)  # bottleneck 32 in the file, 64 configured
    with pytest.raises(EvalInputError) as info:
        load_model(wide)
    text = _line(info)
    assert "(backbone 'resnet18', bottleneck_dim 64): " in text and "shape mismatches" in text
    assert len(_listed_keys(text)) <= 3
