"""`--config` from any folder: a config file as is, else `configs/<name>.py`, `<name>.py` or `<name>`
as the installed `configs` package's module (`config_overrides.resolve_config`), for every entry
point that takes one; and the README's quick-start command run from a folder outside the checkout."""

from pathlib import Path

import pytest

from benchmarks.checkpoints import integrity_cost
from benchmarks.step import pretrain_step
from bert_jax.config_overrides import known_configs, load_config, resolve_config, resolve_config_argv
from bert_jax.pod.planning import planner

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The current folder: an empty one outside the checkout (no `configs/` in it)."""
    assert ROOT not in tmp_path.resolve().parents
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_known_configs_are_the_package_modules():
    assert known_configs() == sorted(p.stem for p in CONFIGS.glob("*.py") if not p.stem.startswith("_"))
    assert {"base", "demo", "glue", "own_data", "tiny"} <= set(known_configs())


def test_a_config_name_resolves_to_the_installed_package_file_from_any_folder(elsewhere):
    base = str(CONFIGS / "base.py")
    for value in ("configs/base.py", "./configs/base.py", "base.py", "base"):
        assert resolve_config(value) == base, value
    # The `:kind` suffix is kept, and reaches get_config.
    for value in ("configs/own_data.py:tagging", "own_data.py:tagging", "own_data:tagging"):
        assert resolve_config(value) == f"{CONFIGS / 'own_data.py'}:tagging", value
    assert load_config("own_data:tagging").to_dict() != load_config("own_data").to_dict()
    assert load_config("own_data:classification").to_dict() == load_config("configs/own_data.py").to_dict()
    assert load_config("tiny").model.hidden_size == 128
    # Both spellings of the flag, the rest of the command line untouched.
    assert resolve_config_argv(["main", "--config=tiny", "--config.seed=3", "--workdir=w"]) == [
        "main", f"--config={CONFIGS / 'tiny.py'}", "--config.seed=3", "--workdir=w"]
    assert resolve_config_argv(["main", "--config", "glue", "--workdir=w"]) == [
        "main", "--config", str(CONFIGS / "glue.py"), "--workdir=w"]


def test_an_existing_file_is_used_as_is(elsewhere):
    (elsewhere / "mine.py").write_text("from configs import tiny\n\n\ndef get_config():\n"
                                       "    return tiny.get_config()\n")
    assert resolve_config("mine.py") == "mine.py"
    assert resolve_config("mine.py:x") == "mine.py:x"
    assert resolve_config(str(elsewhere / "mine.py")) == str(elsewhere / "mine.py")
    # A file of the user's own with a config's name wins over the package's.
    (elsewhere / "configs").mkdir()
    (elsewhere / "configs" / "base.py").write_text("def get_config():\n    return None\n")
    assert resolve_config("configs/base.py") == "configs/base.py"
    assert resolve_config("base") == str(CONFIGS / "base.py")


def test_an_unknown_config_names_the_flag_the_value_and_the_known_names(elsewhere, capsys):
    for value in ("configs/nope.py", "nope", "nope.py:tagging", "other/base.py", ""):
        with pytest.raises(ValueError) as e:
            resolve_config(value, "--config")
        message = str(e.value)
        assert message.startswith(f"--config={value}: no such file"), message
        assert "known configs: " + ", ".join(known_configs()) in message, message
    # The entry points' own messages: bert_jax.main (before absl parses anything) and the planner.
    from bert_jax import main
    with pytest.raises(SystemExit) as e:
        main.parse_flags(["bert_jax.main", "--config=configs/nope.py", "--workdir=w"])
    assert e.value.code == 78  # bert_jax/exit_codes.py: a refused config, which no supervisor retries
    err = capsys.readouterr().err
    assert err.startswith("FATAL: --config=configs/nope.py: no such file"), err
    assert "known configs: base, demo" in err
    assert list(elsewhere.iterdir()) == []


def test_the_planner_and_the_benchmarks_resolve_the_same_way(elsewhere, capsys):
    args = planner.parse_args(["--config=large", "--topology=v4-8", "--config.model.num_hidden_layers=2"])
    config, bert_config = planner.load_config(args.config, 128, "bfloat16", args.overrides)
    assert (bert_config.hidden_size, bert_config.num_hidden_layers) == (1024, 2)
    with pytest.raises(SystemExit):
        planner.parse_args(["--config=nope"])
    err = capsys.readouterr().err
    assert "--config=nope: no such file" in err and "large" in err
    assert pretrain_step.load_config("configs/tiny.py").model.hidden_size == 128
    assert integrity_cost._load_config("tiny").model.hidden_size == 128


# The README's quick start run from a folder outside the checkout, `--config=configs/demo.py` as
# written: tests/pretrain/test_pretrain.py::test_offline_demo_end_to_end_shortened.
