from pathlib import Path

import pytest

from fedreid.config import Config, ConfigError, dump_config, load_config, load_config_text


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_benchmark():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert len(cfg.data.datasets) == 9 and cfg.data.public_dataset == "cuhk02"
    assert cfg.scenario.kind == "by_dataset"


def test_file_then_overrides(tmp_path):
    path = write(tmp_path, "seed: 3\ndata:\n  workers: 4\n  datasets: [market1501]\n")
    cfg = load_config(path, ["data.workers=1", "data.resize=[256,128]", "synthetic.id_scale=0.5"])
    assert cfg.seed == 3
    assert cfg.data.workers == 1
    assert cfg.data.datasets == ["market1501"]
    assert cfg.data.resize == [256, 128]
    assert cfg.synthetic.id_scale == 0.5


def test_comma_separated_list_override():
    cfg = load_config(None, ["data.datasets=market1501,viper"])
    assert cfg.data.datasets == ["market1501", "viper"]


def test_nested_free_form_options():
    cfg = load_config(None, ["data.options.cuhk03np.boxes=labeled"])
    assert cfg.data.options == {"cuhk03np": {"boxes": "labeled"}}


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "data:\n  raw_rot: x\n"))
    msg = str(err.value)
    assert "data.raw_rot" in msg and "raw_root" in msg and "prepared_root" in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="unknown config key sed.*seed"):
        load_config(None, ["sed=1"])


def test_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["scenario.kind=by_site"])
    msg = str(err.value)
    assert "scenario.kind" in msg and "'by_camera'" in msg and "'by_identity'" in msg


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("seed=abc", "seed: expected an integer"),
        ("seed=true", "seed: expected an integer"),
        ("synthetic.id_scale=big", "synthetic.id_scale: expected a number"),
        ("synthetic.id_scale=2", "synthetic.id_scale: expected 0 < value <= 1"),
        ("data.workers=0", "data.workers: expected a positive value"),
        ("data.resize=[256]", "data.resize: expected [height, width]"),
        ("data.datasets=[]", "data.datasets: expected at least one"),
        ("scenario.kind=by_camera", "scenario.dataset: scenario kind 'by_camera' needs"),
        ("data=3", "data: expected a mapping"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_config(None, ["=3"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "data: [unclosed\n"))
    with pytest.raises(ConfigError, match="expected a mapping of keys"):
        load_config(write(tmp_path, "- a\n- b\n"))
    binary = tmp_path / "model_final.pt"  # a model file given as --config
    binary.write_bytes(b"PK\x03\x04\x14\x00\x00\x08\x08\x00\xe4\xa2")
    with pytest.raises(ConfigError) as info:
        load_config(binary)
    assert str(info.value) == f"config file {binary} is not UTF-8 YAML text (byte 0xe4 at offset 10)"


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["seed=7", "data.resize=[32,16]"])
    again = load_config(write(tmp_path, dump_config(cfg)))
    assert again == cfg


def test_shipped_configs_load():
    root = Path(__file__).resolve().parents[2] / "configs"
    paths = sorted(root.rglob("*.yaml"))
    assert paths, "no configs shipped"
    for path in paths:
        load_config(path)


def test_exponent_without_dot_is_a_number(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-5 as a string; float fields accept it, from a file and an override.
    cfg = load_config(write(tmp_path, "train:\n  weight_decay: 1e-5\n"), ["train.lr=2e-3"])
    assert cfg.train.weight_decay == pytest.approx(1e-5)
    assert cfg.train.lr == pytest.approx(2e-3)
    assert isinstance(cfg.train.weight_decay, float)


@pytest.mark.parametrize("section", ["split_files", "options"])
def test_per_dataset_keys_must_be_known_datasets(section):
    value = "split.json" if section == "split_files" else "{boxes: labeled}"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.{section}.cuhk03=" + value])
    msg = str(err.value)
    assert f"data.{section}.cuhk03: unknown dataset 'cuhk03'" in msg
    assert "cuhk03np" in msg and "market1501" in msg and "viper" in msg


def test_known_per_dataset_keys_load():
    cfg = load_config(None, ["data.split_files.viper=/s/viper split.json", "data.options.prid2011.max_frames=3"])
    assert cfg.data.split_files == {"viper": "/s/viper split.json"}
    assert cfg.data.options == {"prid2011": {"max_frames": 3}}


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["data.options.cuhk03np.box=labeled"], ("data.options.cuhk03np.box", "cuhk03np parser", "allowed options: boxes")),
        (["data.options.prid2011.frames=3"], ("prid2011.frames", "allowed options: max_frames, num_shared")),
        (["data.options.viper.seed=3"], ("viper.seed", "allowed options: none", "data.split_seed")),
        (["data.options.cuhk03np.boxes=labeled", "data.layout=fedreid"], ("layout fedreid", "allowed options: none")),
    ],
)
def test_misspelt_parser_option_names_dataset_option_and_allowed(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_fedftg_on_fedpav_is_refused_with_the_reason():
    # FedFTG conditions its generator on a label set shared by all clients and needs a server-side classifier;
    # FedPav's identity heads are private and its clients' identities disjoint, so the refusal says exactly that.
    with pytest.raises(ConfigError) as err:
        load_config(None, ["task=reid", "fl.fedftg=true"])
    message = str(err.value)
    assert message.startswith("fl.fedftg: FedFTG does not apply to FedPav's shared backbone (task=reid)")
    for fragment in ("task=classification only", "identity head is private", "identities of different clients "
                     "are disjoint", "no classifier", "no label y to condition the generator on",
                     "common to all clients", "fl.kd=true"):
        assert fragment in message, fragment
    load_config(None, ["task=classification", "fl.aggregation=fedavg", "fl.fedftg=true"])  # accepted there


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["train.lr=nan"], "train.lr: expected a finite number, got 'nan'"),
        (["train.lr=.nan"], "train.lr: expected a finite number, got nan"),
        (["train.weight_decay=.inf"], "train.weight_decay: expected a finite number, got inf"),
        (["train.momentum=NaN"], "train.momentum: expected a finite number"),
        (["fl.kd_lr=-.inf"], "fl.kd_lr: expected a finite number"),
        (["classification.alpha=nan"], "classification.alpha: expected a finite number"),
        (["model.dropout=nan"], "model.dropout: expected a finite number"),
        (["train.objective=fedprox", "train.objective_options={mu: .nan}"],
         "train.objective_options.mu: expected a finite number"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)


def test_range_checks_refuse_nan_that_bypasses_coercion():
    from fedreid.config import _check_positive, _check_range

    with pytest.raises(ConfigError, match="x: expected a positive value, got nan"):
        _check_positive("x", float("nan"))
    with pytest.raises(ConfigError, match="y: expected 0 <= value <= 1, got nan"):
        _check_range("y", float("nan"), 0, 1)


def test_a_typo_gets_a_did_you_mean_and_a_file_error_names_its_line(tmp_path):
    bad = tmp_path / "exp.yaml"
    bad.write_text("seed: 0\ntrain:\n  batch_size: 32\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value).startswith(f"config file {bad}, line 4: unknown config key train.lrr "
                                      "(did you mean train.lr?)")
    with pytest.raises(ConfigError) as info:  # the same key from an override: no file, no line
        load_config(None, ["train.lrr=0.1"])
    assert str(info.value).startswith("unknown config key train.lrr (did you mean train.lr?)")
    bad.write_text("seed: 0\nfl:\n  rounds: 2\n")  # a list entry's key from an override: not the file's line either
    with pytest.raises(ConfigError) as info:
        load_config(bad, ["fl.hooks=[{name: fedavgm, momentm: 0.7}]"])
    assert not str(info.value).startswith("config file") and "fl.hooks[0].momentm" in str(info.value)
    bad.write_text("seed: 0\ntrain:\n  batch_size: many\n")
    with pytest.raises(ConfigError, match=rf"^config file {bad}, line 3: train.batch_size: expected an integer"):
        load_config(bad)
    bad.write_text("fl:\n  rounds: [1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert "\n" not in str(info.value) and f"config file {bad} is not valid YAML: line 3, column 1:" in str(info.value)


def test_a_section_check_blames_the_file_line_only_for_a_key_the_file_sets(tmp_path):
    cfg_file = tmp_path / "exp.yaml"
    cfg_file.write_text("seed: 0\nfl:\n  rounds: 2\n  clients_per_round: 1\n")
    with pytest.raises(ConfigError) as info:  # the override is at fault, not the file's line 3
        load_config(cfg_file, ["fl.rounds=-1"])
    assert str(info.value) == "fl.rounds: expected a positive value, got -1"
    cfg_file.write_text("seed: 0\nfl:\n  clients_per_round: 1\n  rounds: -1\n")
    with pytest.raises(ConfigError, match=rf"^config file {cfg_file}, line 4: fl.rounds: expected a positive value"):
        load_config(cfg_file)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    twice = tmp_path / "exp.yaml"
    twice.write_text("fl:\n  rounds: 2\ntrain:\n  lr: 0.1\nfl:\n  rounds: 3\n")
    with pytest.raises(ConfigError, match=rf"^config file {twice} is not valid YAML: line 5, column 1: "
                                          r"key 'fl' is given twice \(first on line 1\)"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice \(first on line 2\)"):
        load_config_text("train:\n  lr: 0.1\n  batch_size: 4\n  lr: 0.2\n")


def test_override_strings_are_taken_as_typed_and_an_unexpanded_tilde_is_refused():
    cfg = load_config(None, ["run.out_dir=/tmp/h/run #2", "data.prepared_root='quoted #x'"])
    assert cfg.run.out_dir == "/tmp/h/run #2"  # YAML would have read ' #2' as a comment
    assert cfg.data.prepared_root == "quoted #x"
    assert load_config(None, ["fl.rounds=7", "data.resize=[32, 16]"]).fl.rounds == 7  # typed values as before
    with pytest.raises(ConfigError, match=r"the shell does not expand a '~' after '=': write the full path"):
        load_config(None, ["run.out_dir=~/tilde_run"])
