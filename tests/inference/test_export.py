"""Exported extractors (fedreid.inference.export, tools/eval_reid.py export): parity, dynamic batch, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from tiny_runs import save_tiny_run
from tool_loader import cli_error, load_tool

from fedreid.inference.errors import EvalInputError
from fedreid.inference.export import (
    ExportError,
    OnnxExtractor,
    TorchScriptExtractor,
    export_model,
    load_exported_model,
    load_extractor,
    read_sidecar,
    sidecar_path,
)
from fedreid.inference.model_io import load_model, model_features
from fedreid.models.reid import create_reid_model

tool = load_tool("eval_reid", "eval_reid_tool")

HEIGHT, WIDTH = 64, 32
TOLERANCE = 1e-4  # max abs difference of the L2-normalised features (the bar)


def _has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


needs_ort = pytest.mark.skipif(
    not _has_onnxruntime(), reason="onnxruntime cannot be imported (install the [onnx] or [test] extra)"
)
FORMATS = [pytest.param("onnx", marks=needs_ort), "torchscript"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A run folder (resnet18, 64x32, bottleneck 32) and seven PNG person-like pictures, loaded as a batch."""
    root = tmp_path_factory.mktemp("export")
    run = save_tiny_run(root / "run", HEIGHT, WIDTH)
    rng = np.random.default_rng(0)
    paths = []
    for k in range(7):  # different sizes than the model input: the test transform resizes
        h, w = 90 + 7 * k, 40 + 3 * k
        img = np.full((h, w, 3), rng.integers(0, 256, 3), dtype=np.uint8)
        cv2.rectangle(img, (w // 4, h // 6), (3 * w // 4, h // 2), [int(v) for v in rng.integers(0, 256, 3)], -1)
        img = np.clip(img.astype(np.int16) + rng.integers(-25, 26, img.shape), 0, 255).astype(np.uint8)
        paths.append(root / "images" / f"{k:04d}_c1s1_000001_00.png")
        paths[-1].parent.mkdir(exist_ok=True)
        cv2.imwrite(str(paths[-1]), img)

    from fedreid.data.datasets import read_image
    from fedreid.data.transforms import build_test_transform

    transform = build_test_transform(HEIGHT, WIDTH)
    images = torch.stack([transform(read_image(p)) for p in paths])
    loaded = load_model(run)
    reference = model_features(loaded, [(images,)], torch.device("cpu")).features
    return {"root": root, "run": run, "images": images, "reference": reference, "loaded": loaded}


def _out(world, name: str) -> Path:
    folder = world["root"] / "out"
    folder.mkdir(exist_ok=True)
    return folder / name


@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_with_pytorch_on_real_images_and_dynamic_batch(world, fmt):
    path = export_model(world["loaded"], _out(world, f"parity.{fmt}"), fmt, (HEIGHT, WIDTH))
    extractor = load_extractor(path)
    assert isinstance(extractor, OnnxExtractor if fmt == "onnx" else TorchScriptExtractor)
    images, reference = world["images"], world["reference"]
    full = extractor(images)
    assert full.dtype == np.float32 and full.shape == reference.shape == (7, 32)
    assert np.abs(full - reference).max() <= TOLERANCE
    np.testing.assert_allclose(np.linalg.norm(full, axis=1), 1.0, atol=1e-5)
    for rows in (slice(0, 1), slice(1, 6)):  # batch 1 and batch 5, numpy input this time
        part = extractor(images[rows].numpy())
        assert part.shape[0] == rows.stop - rows.start
        assert np.abs(part - reference[rows]).max() <= TOLERANCE
    # the exported graph does not change the model: train flags and device stay as they were
    assert not any(m.training for m in world["loaded"].model.modules())


def test_an_exported_model_without_the_flip_is_refused(world):
    """The exported file averages with the flip itself: features without it need the model file (eval.flip)."""
    path = export_model(world["loaded"], _out(world, "noflip.torchscript"), "torchscript", (HEIGHT, WIDTH))
    exported = load_exported_model(path)
    with pytest.raises(EvalInputError, match="eval.flip=false needs the model file it was exported from"):
        model_features(exported, [(world["images"],)], torch.device("cpu"), flip=False)
    alone = model_features(world["loaded"], [(world["images"],)], torch.device("cpu"), flip=False).features
    assert np.abs(alone - world["reference"]).max() > 1e-3  # the model file gives the image's feature alone
    np.testing.assert_allclose(np.linalg.norm(alone, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sidecar_records_the_model(world, fmt):
    path = export_model(world["loaded"], _out(world, f"side.{fmt}"), fmt, (HEIGHT, WIDTH))
    meta = read_sidecar(path)
    assert meta["backend"] == fmt and meta["input"]["height"] == HEIGHT and meta["input"]["width"] == WIDTH
    assert meta["model_fingerprint"] == world["loaded"].fingerprint
    assert meta["output"]["shape"] == ["batch", 32]
    extractor = load_extractor(path)
    assert extractor.fingerprint == world["loaded"].fingerprint and len(extractor.file_sha256) == 64


def _preprocess_by_hand(spec: dict, path: Path) -> np.ndarray:
    """One image file as the recorded preprocessing says, with OpenCV and numpy only: [3, H, W] float32."""
    assert spec["color"] == "RGB" and spec["layout"] == "NCHW" and spec["dtype"] == "float32"
    assert spec["resize"]["antialias"] is False
    bgr = cv2.imdecode(np.fromfile(str(path), dtype=np.uint8), cv2.IMREAD_COLOR)
    rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    interpolation = getattr(cv2, spec["resize"]["interpolation"].removeprefix("cv2."))
    size = (spec["resize"]["width"], spec["resize"]["height"])
    x = cv2.resize(rgb, size, interpolation=interpolation).astype(np.float32) * np.float32(spec["scale"])
    x = (x - np.array(spec["mean"], np.float32)) / np.array(spec["std"], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_recorded_preprocessing_fed_by_hand_gives_the_pytorch_feature(world, fmt):
    from fedreid.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    path = export_model(world["loaded"], _out(world, f"spec.{fmt}"), fmt, (HEIGHT, WIDTH))
    meta = read_sidecar(path)
    spec = meta["input"]["preprocessing_spec"]
    assert meta["input"]["preprocessing"].startswith("RGB, resize")  # the prose stays for older readers
    assert spec["resize"] == {"height": HEIGHT, "width": WIDTH, "interpolation": "cv2.INTER_CUBIC",
                              "antialias": False}
    assert spec["scale"] == 1 / 255 and spec["mean"] == list(IMAGENET_MEAN) and spec["std"] == list(IMAGENET_STD)
    paths = sorted((world["root"] / "images").glob("*.png"))
    batch = np.stack([_preprocess_by_hand(spec, p) for p in paths])
    features = load_extractor(path)(batch)
    assert np.abs(features - world["reference"]).max() <= 1e-5
    if fmt == "onnx":  # the ONNX file carries the same record itself
        onnx = pytest.importorskip("onnx")
        props = {e.key: e.value for e in onnx.load(str(path)).metadata_props}
        assert json.loads(props["fedreid.preprocessing"]) == spec


@pytest.mark.parametrize("fmt", FORMATS)
def test_raw_integer_pixels_are_refused_naming_the_file_and_the_expected_input(world, fmt):
    path = export_model(world["loaded"], _out(world, f"dtype.{fmt}"), fmt, (HEIGHT, WIDTH))
    extractor = load_extractor(path)
    pixels = np.random.default_rng(0).integers(0, 256, (2, 3, HEIGHT, WIDTH), dtype=np.uint8)
    for raw in (pixels, torch.from_numpy(pixels), pixels.astype(np.int64)):
        with pytest.raises(ExportError) as exc:
            extractor(raw)
        text = _one_line(exc)
        assert str(path) in text and f"float32 images [batch, 3, {HEIGHT}, {WIDTH}] (NCHW)" in text
        assert "RGB" in text and "cv2.INTER_CUBIC" in text and "[0.485, 0.456, 0.406]" in text
        assert str(np.asarray(raw).dtype) in text
    # floating input of another width is still accepted (cast to float32)
    images = world["images"][:2].numpy()
    np.testing.assert_array_equal(extractor(images.astype(np.float64)), extractor(images))


def test_export_restores_training_flags(tmp_path):
    model = create_reid_model("resnet18", 0, bottleneck_dim=8, seed=1)
    model.train()
    model.bottleneck.eval()
    before = {name: m.training for name, m in model.named_modules()}
    path = tmp_path / "m.ts"
    export_model(model, path, "torchscript", (32, 16))
    assert {name: m.training for name, m in model.named_modules()} == before
    assert read_sidecar(path)["model_fingerprint"] == {}


def _cli_error(argv, capsys) -> str:
    return cli_error(tool, argv, capsys)


def test_help_shows_export_examples(capsys):
    with pytest.raises(SystemExit):
        tool.main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--format" in out and "tools/eval_reid.py export --model runs/fedpav --format onnx" in out


@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_writes_replaces_its_own_and_refuses_other_files(world, fmt, capsys):
    out = _out(world, f"cli.{fmt}")
    argv = ["export", "--model", str(world["run"]), "--format", fmt, "--out", str(out)]
    assert tool.main(argv) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and out.is_file() and sidecar_path(out).is_file()
    assert np.abs(load_extractor(out)(world["images"]) - world["reference"]).max() <= TOLERANCE
    assert tool.main(argv) == 0  # an earlier export of this tool is replaced
    capsys.readouterr()

    other = _out(world, f"notes.{fmt}")
    other.write_text("my notes\n")
    err = _cli_error(["export", "--model", str(world["run"]), "--format", fmt, "--out", str(other)], capsys)
    assert "refusing to overwrite" in err and str(other) in err
    assert other.read_text() == "my notes\n" and not sidecar_path(other).exists()

    # a smaller input size is recorded in the sidecar and its fingerprint
    small = _out(world, f"small.{fmt}")
    assert tool.main(["export", "--model", str(world["run"]), "--format", fmt, "--out", str(small),
                      "--height", "32", "--width", "16"]) == 0
    meta = read_sidecar(small)
    assert (meta["input"]["height"], meta["model_fingerprint"]["height"], meta["model_fingerprint"]["width"]) == (
        32, 32, 16)
    assert load_extractor(small)(torch.zeros(2, 3, 32, 16)).shape == (2, 32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_stopped_before_its_sidecar_is_written_can_be_redone(world, fmt, tmp_path):
    out = tmp_path / f"pair.{fmt}"
    export_model(world["loaded"], out, fmt, (HEIGHT, WIDTH))
    out.write_bytes(out.read_bytes() + b"\0")  # the file replaced, its sidecar still the previous one's

    with pytest.raises(ExportError, match="changed, damaged or replaced; export it again"):
        load_extractor(out)
    export_model(world["loaded"], out, fmt, (HEIGHT, WIDTH))  # the tool's own name: written again
    assert np.abs(load_extractor(out)(world["images"]) - world["reference"]).max() <= TOLERANCE


def test_a_zero_size_or_batch_is_refused_not_replaced_by_the_default(world, capsys):
    for argv, flag in ((["export", "--model", str(world["run"]), "--format", "torchscript", "--out", "x.pt",
                         "--height", "0"], "--height"),
                       (["evaluate", "--model", str(world["run"]), "--batch-size", "0"], "--batch-size"),
                       (["index", "--model", str(world["run"]), "--gallery", str(world["root"] / "images"),
                         "--index", str(world["root"] / "never"), "--batch-size", "0"], "--batch-size"),
                       (["query", "--model", str(world["run"]), "--index", str(world["root"] / "never"),
                         "--images", str(world["root"] / "images"), "--batch-size", "0"], "--batch-size")):
        with pytest.raises(SystemExit):
            tool.main(argv)
        assert f"argument {flag}: expected an integer >= 1, got '0'" in capsys.readouterr().err
    assert not (world["root"] / "never").exists()  # refused before the index folder was made
    with pytest.raises(SystemExit):
        tool.main(["evaluate", "--model", str(world["run"]), "--pictures", "-1"])
    assert "argument --pictures: expected an integer >= 0, got '-1'" in capsys.readouterr().err


@needs_ort
def test_an_opset_the_exporter_refuses_is_one_line(world, tmp_path):
    with pytest.raises(ExportError, match="ONNX export at --opset 99 failed") as info:
        export_model(world["loaded"], tmp_path / "m.onnx", "onnx", (HEIGHT, WIDTH), opset=99)
    assert "\n" not in str(info.value) and not (tmp_path / "m.onnx").exists()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_or_foreign_files_are_refused(world, fmt, tmp_path):
    good = export_model(world["loaded"], tmp_path / f"good.{fmt}", fmt, (HEIGHT, WIDTH))
    cls = OnnxExtractor if fmt == "onnx" else TorchScriptExtractor

    foreign = tmp_path / f"foreign.{fmt}"  # a file of another origin: no sidecar
    foreign.write_bytes(good.read_bytes())
    with pytest.raises(ExportError) as exc:
        cls(foreign)
    assert "no sidecar" in _one_line(exc)

    damaged = tmp_path / f"damaged.{fmt}"  # bytes changed after export
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    sidecar_path(damaged).write_text(sidecar_path(good).read_text())
    with pytest.raises(ExportError) as exc:
        load_extractor(damaged)
    assert "not the file its sidecar" in _one_line(exc)

    garbage = tmp_path / f"garbage.{fmt}"  # a sidecar that matches, over a file that is no model at all
    garbage.write_bytes(b"\x00garbage" * 64)
    meta = json.loads(sidecar_path(good).read_text())
    from fedreid.utils.filecheck import sha256_file

    meta.update(file_bytes=garbage.stat().st_size, file_sha256=sha256_file(garbage))
    sidecar_path(garbage).write_text(json.dumps(meta))
    with pytest.raises(ExportError) as exc:
        cls(garbage)
    assert "not a readable" in _one_line(exc)

    sidecar_path(foreign).write_text("{not json")
    with pytest.raises(ExportError) as exc:
        load_extractor(foreign)
    assert "unreadable" in _one_line(exc)

    with pytest.raises(ExportError) as exc:  # wrong input size in words
        load_extractor(good)(np.zeros((1, 3, 10, 10), np.float32))
    assert f"[batch, 3, {HEIGHT}, {WIDTH}]" in _one_line(exc)

    other = "torchscript" if fmt == "onnx" else "onnx"
    wrong_cls = TorchScriptExtractor if fmt == "onnx" else OnnxExtractor
    with pytest.raises(ExportError) as exc:
        wrong_cls(good)
    assert f"not {other}" in _one_line(exc)


@pytest.mark.parametrize("fmt", FORMATS)
def test_index_and_query_with_an_exported_model(world, fmt, tmp_path):
    from fedreid.inference.export import load_exported_model
    from fedreid.inference.images import image_features
    from fedreid.inference.model_io import ModelMismatchError
    from fedreid.retrieval.folders import build_gallery_index, query_index

    gallery = world["root"] / "images"
    path = export_model(world["loaded"], tmp_path / f"m.{fmt}", fmt, (HEIGHT, WIDTH))
    exported = load_exported_model(path)
    assert exported.fingerprint["backend"] == fmt and exported.fingerprint["export_sha256"] == read_sidecar(path)[
        "file_sha256"]
    paths = sorted(gallery.glob("*.png"))
    fs = image_features(exported, paths)
    ref = image_features(world["loaded"], paths)
    assert np.abs(fs.features - ref.features).max() <= TOLERANCE

    index = tmp_path / "index"
    build_gallery_index(exported, gallery, index)
    results = query_index(load_exported_model(path), index, gallery, top_k=2)
    assert len(results) == 7 and all(r.matches[0]["score"] == pytest.approx(1.0, abs=1e-4) for r in results)
    assert all(Path(r.matches[0]["path"]).name == Path(r.path).name for r in results)

    # the PyTorch model of the same weights: the same features, accepted; and the reverse
    assert len(query_index(world["loaded"], index, gallery, top_k=2)) == 7
    torch_index = tmp_path / "torch-index"
    build_gallery_index(world["loaded"], gallery, torch_index)
    assert len(query_index(load_exported_model(path), torch_index, gallery, top_k=2)) == 7
    resized = export_model(world["loaded"], tmp_path / f"r.{fmt}", fmt, (HEIGHT * 2, WIDTH * 2))
    with pytest.raises(ModelMismatchError, match="height"):  # same weights, another input size
        query_index(load_exported_model(resized), torch_index, gallery)
    other = create_reid_model("resnet18", 0, bottleneck_dim=32, seed=5)
    other_path = export_model(other, tmp_path / f"other.{fmt}", fmt, (HEIGHT, WIDTH))
    with pytest.raises(ModelMismatchError) as exc:  # another exported file (no weights digest recorded)
        query_index(load_exported_model(other_path), index, gallery)
    assert "export_sha256" in str(exc.value)


@needs_ort
def test_cli_index_and_query_with_backend_onnx(world, tmp_path, capsys):
    model = tmp_path / "m.onnx"
    assert tool.main(["export", "--model", str(world["run"]), "--format", "onnx", "--out", str(model)]) == 0
    gallery, index = world["root"] / "images", tmp_path / "index"
    assert tool.main(["index", "--backend", "onnx", "--model", str(model), "--gallery", str(gallery),
                      "--index", str(index), "--device", "cpu"]) == 0
    assert "indexed 7 images" in capsys.readouterr().out
    query = sorted(gallery.glob("*.png"))[2]
    assert tool.main(["query", "--backend", "onnx", "--model", str(model), "--index", str(index),
                      "--images", str(query), "--top-k", "3", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rank, score, path = lines[1].split()[:3]
    assert rank == "1" and abs(float(score) - 1.0) < 1e-4 and Path(path).name == query.name

    # the run folder's model has the export's weights: it queries the export's index
    assert tool.main(["query", "--model", str(world["run"]), "--index", str(index), "--images", str(query),
                      "--top-k", "3", "--device", "cpu"]) == 0
    assert Path(capsys.readouterr().out.splitlines()[1].split()[2]).name == query.name
    err = _cli_error(["query", "--backend", "torchscript", "--model", str(model), "--index", str(index),
                      "--images", str(query), "--device", "cpu"], capsys)
    assert "was exported as onnx" in err
    err = _cli_error(["index", "--backend", "onnx", "--model", str(world["run"] / "model_final.pt"),
                      "--gallery", str(gallery), "--index", str(tmp_path / "i2"), "--device", "cpu"], capsys)
    assert "no sidecar" in err


@pytest.mark.parametrize("flags,words", [
    (["--device", "cuda"], "--device cuda: --backend torchscript runs the exported file on the CPU"),
    (["--amp"], "--amp: --backend torchscript runs the exported file in float32 on the CPU"),
    (["--channels-last"], "--channels-last: --backend torchscript runs the exported file in float32 on the CPU"),
])
def test_gpu_options_an_exported_file_cannot_honour_are_refused_before_any_folder(world, tmp_path, capsys, flags,
                                                                                  words):
    model = export_model(world["loaded"], _out(world, "flags.ts"), "torchscript", (HEIGHT, WIDTH))
    index = tmp_path / "index"
    err = _cli_error(["index", "--backend", "torchscript", "--model", str(model), "--gallery",
                      str(world["root"] / "images"), "--index", str(index), *flags], capsys)
    assert words in err and not index.exists()


class _MeanColour(torch.nn.Module):
    """A stand-in for a foreign ONNX graph: each image's mean colour, L2-normalised ([B, 3]); ``flat``: one row [3]."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.flat = flat

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        feats = torch.nn.functional.normalize(images.mean(dim=(2, 3)), dim=1)
        return feats.mean(0) if self.flat else feats


def _foreign_onnx(path: Path, *, output: str = "features", batch: int | None = None, flat: bool = False,
                  declare: bool = True) -> Path:
    """An ONNX file of :class:`_MeanColour` with a matching sidecar: another output name, a fixed ``batch``,
    or a 1-D output (``flat``); ``declare``: the sidecar states that shape/name (else it claims the usual ones)."""
    import warnings

    from fedreid.utils.filecheck import sha256_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _MeanColour(flat), (torch.zeros(batch or 2, 3, HEIGHT, WIDTH),), str(path), input_names=["images"],
            output_names=[output], dynamic_axes=None if batch else {"images": {0: "batch"}, output: {0: "batch"}},
            dynamo=False,
        )
    in_shape = [batch if declare and batch else "batch", 3, HEIGHT, WIDTH]
    out_shape = [3] if declare and flat else [batch if declare and batch else "batch", 3]
    meta = {
        "format": "fedreid.export", "version": 1, "backend": "onnx", "file": path.name,
        "file_bytes": path.stat().st_size, "file_sha256": sha256_file(path),
        "input": {"name": "images", "shape": in_shape, "dtype": "float32", "height": HEIGHT, "width": WIDTH},
        "output": {"name": output if declare else "features", "shape": out_shape, "dtype": "float32"},
        "opset": 17, "model_fingerprint": {}, "source": None,
    }
    sidecar_path(path).write_text(json.dumps(meta))
    return path


@needs_ort
@pytest.mark.parametrize("case, kwargs, words", [
    ("fixed-batch", {"batch": 1}, ["declares input 'images' [1, 3, 64, 32]", "dynamic batch axis"]),
    ("other-output", {"output": "embedding"}, ["declares output 'embedding'", "expected output 'features'"]),
    ("one-d-output", {"flat": True}, ["declares output 'features' [3]", "[batch, d]"]),
    ("fixed-batch-graph", {"batch": 1, "declare": False}, ["takes inputs 'images'", "[1, 3, 64, 32]",
                                                           "dynamic batch axis"]),
    ("other-output-graph", {"output": "embedding", "declare": False}, ["gives outputs 'embedding'",
                                                                       "expected an output 'features'"]),
    ("one-d-output-graph", {"flat": True, "declare": False}, ["gives outputs 'features' tensor(float) [3]",
                                                              "[batch, 3]"]),
])
def test_an_onnx_file_of_another_contract_is_one_line_at_load(world, tmp_path, case, kwargs, words):
    path = _foreign_onnx(tmp_path / f"{case}.onnx", **kwargs)
    with pytest.raises(ExportError) as exc:
        load_extractor(path)
    text = _one_line(exc)
    assert str(path) in text and all(w in text for w in words), text


@needs_ort
def test_an_exported_model_giving_misaligned_rows_is_one_line(world, tmp_path, capsys):
    extractor = load_extractor(export_model(world["loaded"], tmp_path / "m.onnx", "onnx", (HEIGHT, WIDTH)))
    extractor._run = lambda x: np.zeros((32,), np.float32)  # a graph whose shapes are not declared: caught at run time
    with pytest.raises(ExportError) as exc:
        extractor(world["images"][:5])
    assert "gave output 'features' of shape [32] for 5 images: expected [5, 32]" in _one_line(exc)

    flat = _foreign_onnx(tmp_path / "flat.onnx", flat=True)  # the reported case: index over five images
    err = _cli_error(["index", "--backend", "onnx", "--model", str(flat), "--gallery", str(world["root"] / "images"),
                      "--index", str(tmp_path / "index"), "--device", "cpu"], capsys)
    assert str(flat) in err and "[batch, d]" in err and "pids" not in err


@pytest.mark.parametrize("step, value", [("mean", [0.0, 0.0, 0.0]), ("scale", 1.0),
                                         ("resize", {"height": HEIGHT, "width": WIDTH,
                                                     "interpolation": "cv2.INTER_AREA", "antialias": False})])
def test_an_export_recording_other_preprocessing_is_refused_by_the_tools(world, tmp_path, step, value):
    from fedreid.inference.export import load_exported_model

    path = export_model(world["loaded"], tmp_path / "m.pt", "torchscript", (HEIGHT, WIDTH))
    assert load_exported_model(path).extractor is not None  # this version's own record loads
    meta = read_sidecar(path)
    meta["input"]["preprocessing_spec"][step] = value  # as a version preparing images otherwise would record
    sidecar_path(path).write_text(json.dumps(meta))
    with pytest.raises(ExportError) as exc:
        load_exported_model(path)
    assert str(path) in _one_line(exc) and f"with {step} {value!r}" in _one_line(exc) and "export it again" in str(
        exc.value)
    load_extractor(path)  # a caller preparing its own images may still read the record and run the file
    del meta["input"]["preprocessing_spec"]  # an older export records prose only: nothing to compare
    sidecar_path(path).write_text(json.dumps(meta))
    assert load_exported_model(path).extractor is not None
