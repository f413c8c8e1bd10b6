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


def _malformed_files(tmp_path):
    """Files torch loads (weights only) whose one entry is of the wrong kind: (file name, payload, words)."""
    run = save_tiny_run(tmp_path / "run", 64, 32)
    good = torch.load(run / "model_final.pt", weights_only=True)
    state, model = good["state"], good["model"]

    def with_model(**entries):
        return {"format": "fedreid.model", "model": {**model, **entries}, "round": 1, "state": state}

    def checkpoint(config, server):
        return {"format": "fedreid.fl.checkpoint", "config": config, "server": {"global_state": state, **server}}

    local = {"model": model, "fl": {"mode": "local"}}
    return [
        ("height_text", with_model(height="abc"), "model config height is 'abc', expected a whole number >= 1"),
        ("height_none", with_model(height=None), "model config height is None, expected a whole number >= 1"),
        ("height_zero", with_model(height=0), "model config height is 0, expected a whole number >= 1"),
        ("height_float", with_model(height=32.7), "model config height is 32.7, expected a whole number >= 1"),
        ("backbone_empty", with_model(backbone=""), "model config backbone is '', expected a model name"),
        ("round_text", {**with_model(), "round": "abc"}, "its round is 'abc', expected a whole number >= 0"),
        ("model_text", {"format": "fedreid.model", "model": "resnet18", "state": state},
         "its model config is a str, not a mapping"),
        ("top_list", [1, 2, 3], "it holds a list"),
        ("checkpoint_config_list", checkpoint(["x"], {}), "its config is a list, not a mapping"),
        ("checkpoint_fl_text", checkpoint({"model": model, "fl": "local"}, {}), "is malformed: AttributeError"),
        ("checkpoint_client_key", checkpoint(local, {"local_states": {"a": state}, "client_names": ["c0"]}),
         "is malformed: ValueError"),
        ("checkpoint_client_index", checkpoint(local, {"local_states": {3: state}, "client_names": ["c0"]}),
         "is malformed: IndexError"),
    ]


def test_a_model_file_with_an_entry_of_the_wrong_kind_is_one_line_naming_the_file(tmp_path):
    for name, payload, words in _malformed_files(tmp_path):
        path = tmp_path / f"{name}.pt"
        torch.save(payload, path)
        with pytest.raises(EvalInputError) as info:
            load_model(path, client="c0" if name.startswith("checkpoint_client") else None)
        text = _line(info)
        assert str(path) in text and words in text, (name, text)


def test_loading_a_model_leaves_the_callers_random_stream_alone(tmp_path):
    run = save_tiny_run(tmp_path / "run", 64, 32)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    load_model(run)
    assert torch.equal(torch.get_rng_state(), before)
