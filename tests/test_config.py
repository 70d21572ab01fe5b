"""Config: recipes, overrides, and errors that name the key before any work starts."""
from __future__ import annotations

import json

import pytest
from conftest import run_check_script, run_cli

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
    assert cfg.train.max_steps == 9 and cfg.recipe is None and cfg.run_name == "b"
    (tmp_path / "c.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(tmp_path / "c.yaml"))


def test_a_key_given_twice_in_a_config_file_is_refused_and_merge_keys_may_be_overridden(tmp_path):
    """Plain YAML and JSON keep the last of two equal keys without a word: a file that sets train.max_steps twice
    would train the second length. Refused with both lines; a key brought in by a YAML merge key (<<) may still be
    overridden, as YAML means it to be. An empty file is said to be empty."""
    (tmp_path / "twice.yaml").write_text("recipe: tiny\ntrain:\n  max_steps: 5\n  eval_every: 2\n  max_steps: 6\n")
    with pytest.raises(ConfigError, match="line 5: max_steps is given twice in one mapping \\(first on line 3\\)"):
        load_config(str(tmp_path / "twice.yaml"))
    (tmp_path / "twice.json").write_text('{"train": {"max_steps": 5, "max_steps": 6}}')
    with pytest.raises(ConfigError, match="max_steps given twice in one object"):
        load_config(str(tmp_path / "twice.json"))
    (tmp_path / "same.yaml").write_text("recipe: tiny\ntrain:\n  max_steps: 5\nmodel:\n  max_steps: 5\n")
    with pytest.raises(ConfigError, match="model.max_steps"):   # the same name in two sections is no duplicate
        load_config(str(tmp_path / "same.yaml"))
    (tmp_path / "over.yaml").write_text("recipe: tiny\ntrain:\n  <<: {max_steps: 4, eval_every: 2}\n"
                                        "  max_steps: 9\n")
    cfg = load_config(str(tmp_path / "over.yaml"))
    assert cfg.train.max_steps == 9 and cfg.train.eval_every == 2
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="empty.yaml is empty"):
        load_config(str(tmp_path / "empty.yaml"))


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


# ----------------------------------------------------------------------------- refused before any work

# (settings, --nproc, what the message says): each refused alike by `trainbox train` and `trainbox config validate`
# (one function, train/preflight.py), with exit 2, the key named and nothing done
REFUSED = [
    (["train.max_steps=true"], 1, "train.max_steps: Input should be a number, not true or false"),
    (["optim.lr=true"], 1, "optim.lr: Input should be a number, not true or false"),
    (["train.max_steps=1e24"], 1, "train.max_steps: Input should be less than or equal to 1000000000"),
    (["train.max_steps=2.5"], 1, "train.max_steps: Input should be a valid integer, got a number with a fractional"),
    (["train.max_steps=5", "train.epochs=2"], 1, "train.max_steps=5 and train.epochs=2.0 each set the run's length"),
    (["train.max_steps=null", "train.max_tokens=100"], 1, "train.max_tokens=100 is less than one step's 256 tokens"),
    (["model.vocab_size=64"], 1, "model.vocab_size=64 is smaller than the 2,048 ids of the tokenizer"),
    (["monitor.host=no-such-host.invalid"], 1, "monitor.host='no-such-host.invalid' does not resolve"),
    (["monitor.host=192.0.2.1"], 1, "monitor.host='192.0.2.1' is not an address of this machine"),
    (["data.seq_len=1e8"], 1, "data.seq_len: Input should be less than or equal to 1048576"),
    (["train.micro_batch_size=7"], 1, "train.micro_batch_size=7 does not divide the 8 sequences per process"),
    (["train.micro_batch_size=4"], 4, "train.micro_batch_size=4 does not divide the 2 sequences per process"),
    ([], 3, "train.global_batch_size=8 does not split over 3 processes"),
    (["model.moe.expert_parallel=2"], 2, "model.moe.expert_parallel applies to model.family=moe, not gpt"),
    (["model.family=moe", "model.moe.num_experts=4", "model.moe.expert_parallel=2"], 1,
     "model.moe.expert_parallel=2 does not divide the run's 1 process(es)"),
    (["model.family=moe", "model.moe.num_experts=4", "model.moe.expert_parallel=2", "optim.name=muon"], 2,
     "model.moe.expert_parallel=2 runs with optim.name=adamw"),
    pytest.param(["train.device=cuda"], 1, "train.device=cuda but no CUDA GPU is visible",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without a GPU")),
    ([], 0, "--nproc 0: the number of processes must be at least 1"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command gets past its pre-flight checks: no download, worker, run directory or model."""
    from trainbox.train.stop import STOP

    def work(*args, **kwargs):
        raise AssertionError("work started after the pre-flight checks")

    # the name each module calls: cli/train.py holds its own (from-import), which a patch of cli.data's alone would
    # leave real, or, were cli/train.py first imported under the patch, leave patched for the rest of the process
    monkeypatch.setattr("trainbox.cli.data.fetch_run_data", work)
    monkeypatch.setattr("trainbox.cli.train.fetch_run_data", work)
    monkeypatch.setattr("trainbox.cli.train._launch_torchrun", work)
    monkeypatch.setattr("trainbox.train.loop.Trainer.setup", work)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # what `train` sets, kept as it was
    yield
    STOP.restore()   # `train` keeps stop signals for its loop


@pytest.mark.parametrize("overrides, nproc, says", REFUSED)
@pytest.mark.parametrize("verb", ["train", "config validate"])
def test_train_and_config_validate_refuse_the_same_settings_before_any_work(verb, overrides, nproc, says, tiny,
                                                                            tmp_path, no_work, capsys):
    from trainbox.cli import main
    code = main([*verb.split(), "tiny", *tiny, *overrides, "--nproc", str(nproc)])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_config_validate_says_the_layout_train_would_run(tiny, no_work, capsys):
    """What `config validate` accepts: the layout `train --nproc N` decides, the micro-batch it adapts said once;
    a monitor host that would not resolve passes while the monitor is off."""
    from trainbox.cli import main
    tiny = [o for o in tiny if not o.startswith("train.micro_batch_size")]   # the recipe's 32 then adapts
    assert main(["config", "validate", "tiny", *tiny, "--nproc", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "tiny: valid (ddp, 2 processes on cpu: global batch 8 = 4 x 1 accumulation x 2)"
    assert err.strip() == ("train.micro_batch_size=4 on 2 processes (the recipe's 32 does not divide the 4 sequences "
                           "per process); the global batch stays 8")
    assert main(["config", "validate", "tiny", *tiny, "monitor.enabled=false", "monitor.host=no-such-host.invalid",
                 "train.max_steps=1.0e+3"]) == 0


def test_refused_before_any_work_as_a_user_runs_it(tiny, tmp_path):
    """The real command line, in a fresh interpreter: exit 2, one message naming the key, no run directory."""
    for args, says in ((["train", "tiny", *tiny, "train.max_steps=true"], "train.max_steps"),
                       (["config", "validate", "tiny", *tiny, "data.seq_len=1e8"], "data.seq_len")):
        proc = run_cli(*args, cwd=tmp_path, check=False)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2
    assert not (tmp_path / "runs").exists()


def test_a_length_given_on_the_command_line_replaces_the_recipes():
    """A run's length is one setting: tiny's recipe sets train.max_steps, the command line's epochs replace it."""
    cfg = load_config("tiny", ["train.epochs=2"])
    assert (cfg.train.max_steps, cfg.train.epochs, cfg.train.max_tokens) == (None, 2.0, None)
    assert load_config("tiny", ["train.max_tokens=2e6"]).train.max_tokens == 2_000_000   # whole numbers as 2e6
    with pytest.raises(ConfigError, match="each set the run's length"):
        load_config("tiny", ["train.max_tokens=1e6", "train.epochs=1"])


def test_the_layout_is_decided_in_one_place():
    """The layout's rules (config/layout.py) are written nowhere else: no other module refuses a micro-batch, a
    process count or an expert-parallel degree that does not divide what it must."""
    from conftest import REPO
    src = REPO / "src" / "trainbox"
    others = [p for p in src.rglob("*.py") if p != src / "config" / "layout.py"]
    for needle in ("does not divide", "does not split over", "expert_parallel %", "% t.micro_batch_size"):
        assert [p.relative_to(src) for p in others if needle in p.read_text()] == [], needle


@pytest.mark.parametrize("first", ["from trainbox.model.spec import families; families()",
                                   "from trainbox.model.spec import family; family('gpt')",
                                   "import trainbox.config"])
def test_the_config_holds_every_family_whichever_module_loads_first(first):
    """The model section is assembled from the families as trainbox.config loads, and the families' own sections
    import trainbox.config: a program that asks for the families before it reads a config (a fresh process each)
    gets every family's section in the config all the same."""
    run_check_script(first + """
from trainbox.config import ModelSection, load_config
from trainbox.model.spec import families
own = {name for name, spec in families().items() if spec.section is not None}
assert {"llama", "moe", "t5"} <= own <= set(ModelSection.model_fields), (own, sorted(ModelSection.model_fields))
assert load_config("tiny", ["model.family=llama", "model.llama.n_kv_head=2"]).model.llama.n_kv_head == 2
print("ok")""")


# ----------------------------------------------------------------------------- config files and recipe names


def test_a_folder_named_like_a_recipe_does_not_hide_the_recipe(tmp_path, monkeypatch, caplog):
    """A folder `tiny` in the current directory is no config file: `tiny` is still the recipe. A file `tiny` is
    read when written as a path, and the bare name says which of the two it took."""
    (tmp_path / "tiny").mkdir()
    for verb in (["config", "show", "tiny"], ["config", "validate", "tiny", "train.max_steps=5"]):
        proc = run_cli(*verb, cwd=tmp_path, check=False)
        assert proc.returncode == 0 and "does not exist" not in proc.stderr, proc.stderr
    assert "n_embd: 96" in run_cli("config", "show", "tiny", cwd=tmp_path).stdout   # the recipe's own width
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").recipe == "tiny"
    with pytest.raises(ConfigError, match="config file ./tiny is a folder, not a config file"):
        load_config("./tiny")
    (tmp_path / "tiny").rmdir()
    (tmp_path / "tiny").write_text("train:\n  max_steps: 7\n")
    with caplog.at_level("WARNING", logger="trainbox"):
        assert load_config("tiny").train.max_steps == 300   # the recipe's
    assert "tiny: the recipe tiny, not the file tiny here (pass ./tiny for the file)" in caplog.text
    assert load_config("./tiny").train.max_steps == 7


def test_a_config_files_recipe_line_applies_the_file_over_that_recipe(tmp_path):
    """`recipe: tiny` in a file means tiny's settings with the file's on top, key by key as overrides would (a
    length in the file replaces the recipe's); the command line's overrides come last. The config records the
    recipe, and the recorded config loads back to the same config."""
    from trainbox.config import dump_yaml
    ok = tmp_path / "ok.yaml"
    ok.write_text("recipe: tiny\ntrain:\n  max_steps: 5\nmodel:\n  n_layer: 2\n")
    cfg = load_config(str(ok), ["optim.lr=1e-3"])
    tiny = load_config("tiny")
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.data.tokenizer) == (2, tiny.model.n_embd, tiny.data.tokenizer)
    assert (cfg.train.max_steps, cfg.optim.lr, cfg.optim.name) == (5, 1e-3, "muon")
    assert cfg.recipe == "tiny" and cfg.run_name == "tiny"
    recorded = tmp_path / "config.yaml"
    recorded.write_text(dump_yaml(cfg))   # what a run's config.yaml holds
    assert "\nrecipe: tiny\n" in f"\n{recorded.read_text()}" and load_config(str(recorded)) == cfg
    (tmp_path / "tokens.yaml").write_text("recipe: tiny\ntrain:\n  max_tokens: 2e6\n")
    length = load_config(str(tmp_path / "tokens.yaml")).train
    assert (length.max_steps, length.max_tokens) == (None, 2_000_000)
    shown = run_cli("config", "show", str(ok)).stdout
    assert "n_layer: 2" in shown and "tokenizer: embedded:shakespeare-bpe" in shown and "max_steps: 5" in shown


def test_a_config_files_unknown_recipe_is_refused_with_the_recipes(tmp_path):
    (tmp_path / "n.yaml").write_text("recipe: nosuch\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "n.yaml"))
    assert e.value.message == f"{tmp_path / 'n.yaml'}: recipe: nosuch names no recipe"
    assert "recipes: " in e.value.hint and "tiny" in e.value.hint
    (tmp_path / "t.yaml").write_text("recipe: tinny\n")
    with pytest.raises(ConfigError, match="did you mean tiny"):
        load_config(str(tmp_path / "t.yaml"))
    proc = run_cli("config", "validate", "n.yaml", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "recipe: nosuch names no recipe" in proc.stderr and "valid" not in proc.stdout


def test_a_config_file_without_a_recipe_line_starts_from_the_defaults_named_after_the_file(tmp_path):
    """No `recipe:` line: the defaults, the run named after the file (one safe path component); the recorded
    config loads back to the same config and the same run folder."""
    from trainbox.config import dump_yaml
    path = tmp_path / "my run.yaml"
    path.write_text("train:\n  max_steps: 8\n")
    cfg = load_config(str(path))
    assert cfg.recipe is None and cfg.run_name == "my-run" and cfg.model.n_layer == RunConfig().model.n_layer
    assert load_config(str(path), ["run.name=other"]).run_name == "other"
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    assert load_config(str(tmp_path / "config.yaml")) == cfg


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 5\n  x: [1,\n  y: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(bad))
    assert e.value.message.startswith(f"{bad} is not valid YAML")
    assert f'in "{bad}", line 3' in e.value.message and "<unicode string>" not in e.value.message
