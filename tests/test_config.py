"""Config: recipes, overrides, and errors that name the key before any work starts."""
from __future__ import annotations

import json

import pytest
from conftest import run_cli

from trainbox.config import RunConfig, load_config, recipe_names
from trainbox.errors import ConfigError


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_loads(name):
    cfg = load_config(name)
    assert cfg.recipe == name and cfg.run_name == name
    # a recipe round-trips through its own dump
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_expected_recipes_ship():
    assert {"tiny", "gpt2-125m"} <= set(recipe_names())


def test_overrides_are_typed():
    cfg = load_config("tiny", ["train.max_steps=50", "model.n_layer=2", "optim.lr=1e-3", "train.compile=true",
                               "data.text_key=[a, b]"])
    assert cfg.train.max_steps == 50 and cfg.model.n_layer == 2 and cfg.optim.lr == 1e-3
    assert cfg.train.compile is True and cfg.data.text_key == ["a", "b"]


def test_gpt2_125m_shape():
    m = load_config("gpt2-125m").model
    assert (m.n_layer, m.n_head, m.n_embd, m.vocab_size) == (12, 12, 768, 50304)


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["train.max_step=5"])
    assert "train.max_step" in e.value.message and "train.max_steps" in e.value.message


def test_unknown_section_lists_valid():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["trian.max_steps=5"])
    assert "trian" in e.value.message and "train" in e.value.message


def test_wrong_type_names_key():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["train.max_steps=many"])
    assert "train.max_steps" in e.value.message and "many" in e.value.message


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="n_embd"):
        load_config("tiny", ["model.n_embd=250", "model.n_head=4"])


def test_bad_recipe_name():
    with pytest.raises(ConfigError) as e:
        load_config("tinyy")
    assert "unknown recipe 'tinyy'" in e.value.message and "tiny" in e.value.message


def test_json_and_yaml_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"train": {"max_steps": 7}, "model": {"n_layer": 3}}))
    (tmp_path / "b.yaml").write_text("train:\n  max_steps: 8\n")
    assert load_config(str(tmp_path / "a.json")).train.max_steps == 7
    cfg = load_config(str(tmp_path / "b.yaml"), ["train.max_steps=9"])
    assert cfg.train.max_steps == 9 and cfg.recipe == "b"
    (tmp_path / "c.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(tmp_path / "c.yaml"))


def test_cli_config_errors_exit_2_without_traceback(tmp_path):
    for args, needle in ((["train", "tiny", "train.max_step=5"], "train.max_steps"),
                         (["train", "tiny", "model.n_layer=two"], "model.n_layer"),
                         (["train", "no-such-recipe"], "unknown recipe"),
                         (["config", "validate", "tiny", "optim.lr=-1"], "optim.lr")):
        proc = run_cli(*args, cwd=tmp_path, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2
    assert not (tmp_path / "runs").exists()  # failed before any work
    debug = run_cli("train", "tiny", "train.max_step=5", cwd=tmp_path, env={"TRAINBOX_DEBUG": "1"}, check=False)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_cli_config_show_and_schema():
    shown = run_cli("config", "show", "tiny", "train.max_steps=3").stdout
    assert "max_steps: 3" in shown and "family: gpt" in shown
    schema = json.loads(run_cli("config", "schema", "--json").stdout)
    assert "train" in schema["properties"] and "TrainSection" in json.dumps(schema)


@pytest.mark.parametrize("override, names", [
    ("run.seed=-1", "run.seed"), ("run.seed=4294967296", "run.seed"), ("optim.betas=[2,0.95]", "optim.betas"),
    ("optim.betas=[0.9,1.0]", "optim.betas"), ("optim.eps=inf", "optim.eps"), ("optim.lr=nan", "optim.lr"),
    ("optim.weight_decay=.inf", "optim.weight_decay"), ("model.dropout=nan", "model.dropout"),
])
def test_out_of_range_values_fail_before_any_work(override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config("tiny", [override])


def test_yaml_alias_bomb_is_refused_without_expanding(tmp_path):
    """Nine levels of ten aliases would be 10^9 values once walked; the file is refused after 100,000."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        load_config(str(bomb))
    with pytest.raises(ConfigError, match="expands to more than"):   # the same as an override value
        load_config("tiny", ["train.threads={" + ", ".join(lines) + "}"])


def test_an_option_that_names_a_config_key_points_at_the_dotted_form():
    proc = run_cli("train", "tiny", "--max-steps", "5", check=False)
    assert proc.returncode == 2 and "train.max_steps=5" in proc.stderr, proc.stderr
    proc = run_cli("train", "--lr=0.1", check=False)
    assert proc.returncode == 2 and "optim.lr=0.1" in proc.stderr, proc.stderr
