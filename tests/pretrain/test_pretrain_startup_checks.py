"""What the pretraining entry point checks and records before it trains: an unknown config key,
bad settings and bad evaluation data, a vocabulary larger than the model or not the data's, token
ids past the model, the data's casing, and the hyperparameters TensorBoard reports; each refusal
names its config field before the first step. On the `data` fixture's records (conftest.py)."""

import json
import shutil
import time

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from tests.helpers.pretraining_records import VOCAB
from tests.helpers.pretraining_runs import cmd, run

pytestmark = pytest.mark.usefixtures("compilation_cache")  # conftest.py: one XLA cache for the runs


def test_an_unknown_config_key_is_named_with_the_nearest_valid_ones(data, tmp_path):
    r = run(cmd(tmp_path / "w", data, "--config.learning_rat=1e-3", "--config.model.hiden_size=64"), timeout=120)
    assert r.returncode == 78  # refused config (bert_jax/exit_codes.py)
    assert "--config.learning_rat: " in r.stderr and "has no key 'config.learning_rat'; nearest: " \
        "config.learning_rate" in r.stderr, r.stderr[-2000:]
    assert "nearest: config.model.hidden_size" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()


def test_data_casing_comes_from_the_records_dataset_info(tmp_path):
    from bert_jax import workdir as workdir_files
    from bert_jax.formats.common import _read_casing
    from bert_jax.model import model_config
    from bert_jax.pretrain import phases, startup_checks
    for name, lower in (("uncased", True), ("cased", False), ("unknown", None)):
        (tmp_path / name).mkdir()
        flags = {} if lower is None else {"do_lower_case": lower}
        (tmp_path / name / "dataset_info.json").write_text(json.dumps({"flags": flags, "files": {}}))
    phase = lambda name: phases.Phase(128, 20, str(tmp_path / name / "part-*"), 0, 10)
    assert startup_checks.data_casing([phase("uncased")]) is True
    assert startup_checks.data_casing([phase("cased"), phase("cased")]) is False
    assert startup_checks.data_casing([phase("uncased"), phase("cased")]) is None  # disagree: not recorded
    assert startup_checks.data_casing([phase("unknown")]) is None
    assert startup_checks.data_casing([phases.Phase(128, 20, str(tmp_path / "none" / "x"), 0, 10)]) is None
    # What the workdir then holds is what convert reads back.
    config = model_config.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16, max_position_embeddings=16)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n")
    workdir_files.write_model_files(str(tmp_path / "w"), config, str(vocab), False)
    assert _read_casing(str(tmp_path / "w")) is False
    # Written again only when changed: a finished (read-only) workdir re-runs as a no-op.
    files = [tmp_path / "w" / n for n in ("bert_config.json", "vocab.txt", "tokenizer_config.json")]
    times = [f.stat().st_mtime_ns for f in files]
    time.sleep(0.01)
    workdir_files.write_model_files(str(tmp_path / "w"), config, str(vocab), False)
    assert [f.stat().st_mtime_ns for f in files] == times
    workdir_files.write_model_files(str(tmp_path / "w"), config, str(vocab), True)
    assert _read_casing(str(tmp_path / "w")) is True


def test_a_vocab_larger_than_the_model_is_an_error_naming_both(data, tmp_path):
    from bert_jax.pretrain import loop as pretrain
    from configs import test as test_config
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB)]) + "\n")
    cfg = test_config.get_config()
    cfg.train_data, cfg.vocab_file, cfg.verify_data = f"{data}/train-*.tfrecord", str(vocab), False
    with pytest.raises(ValueError, match=rf"vocab.txt has {VOCAB + 5} tokens but config.model.vocab_size={VOCAB}") as e:
        pretrain.run(cfg, str(tmp_path / "w"))
    from bert_jax import exit_codes
    assert exit_codes.of(e.value) == exit_codes.CONFIG  # raised before training: a refusal, not a crash


def test_bad_settings_and_bad_eval_data_stop_before_any_training(data, tmp_path):
    """Each names its config field (or the pattern) before the first step, so nothing is lost."""
    from bert_jax.pretrain import loop as pretrain
    from configs import test as test_config

    def config(**overrides):
        cfg = test_config.get_config()
        cfg.train_data, cfg.verify_data = f"{data}/train-*.tfrecord", False
        cfg.log_every_steps = 1  # a step that ran would leave train_log.jsonl
        cfg.update(overrides)
        return cfg

    # One glob over the records of two runs made otherwise (casing): refused, naming both manifests.
    from data_pipeline.records import manifests
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name, lower in (("a", True), ("b", False)):
        shutil.copy(data / "train-0.tfrecord", mixed / f"{name}.tfrecord")
        manifests.write_dataset_info(str(mixed), {str(mixed / f"{name}.tfrecord"): 64},
                                  {"flags": {"do_lower_case": lower}})

    cases = [(dict(learning_rate=-1e-4), r"config.learning_rate=-0.0001 must not be negative"),
             (dict(global_batch_size=0), r"config.global_batch_size=0 must be at least 1"),
             (dict(checkpoint_every_steps=0), r"config.checkpoint_every_steps=0 must be at least 1"),
             (dict(eval_data=f"{data}/nothing*.tfrecord", eval_every_steps=2), r"nothing\*.tfrecord' matches no file"),
             # The records are length 32 with 5 predictions; the test model's position table is 64.
             (dict(max_seq_length=128), r"config.max_seq_length=128 exceeds config.model.max_position_embeddings=64"),
             (dict(max_seq_length=48), r"written with max_seq_length=32, max_predictions_per_seq=5, but "
                                       r"config.max_seq_length=48, config.max_predictions_per_seq=5"),
             (dict(max_predictions_per_seq=7), r"config.max_predictions_per_seq=7: set these to the records'"),
             (dict(phases=[dict(fraction=0.5, max_seq_length=32, max_predictions_per_seq=5,
                                train_data=f"{data}/train-*.tfrecord"),
                           dict(fraction=0.5, max_seq_length=48, max_predictions_per_seq=7,
                                train_data=f"{data}/train-*.tfrecord")]),
              r"but config.phases\[1\].max_seq_length=48"),
             (dict(train_data=f"{mixed}/*.tfrecord"),
              r"different do_lower_case: True per \S*/mixed/a\.dataset_info\.json, False per \S*/b\.dataset_info")]
    from bert_jax import exit_codes
    for i, (overrides, message) in enumerate(cases):
        with pytest.raises(Exception, match=message) as e:
            pretrain.run(config(**overrides), str(tmp_path / f"w{i}"))
        assert not (tmp_path / f"w{i}" / "train_log.jsonl").exists()
        # Each a refusal (bert_jax/exit_codes.py), a path that matches nothing included; but records made
        # otherwise are bad data.
        want = {"ManifestMismatchError": exit_codes.DATA}.get(type(e.value).__name__, exit_codes.CONFIG)
        assert exit_codes.of(e.value) == want, (overrides, e.value)


def test_token_ids_past_the_model_and_a_different_vocab_are_named(tmp_path):
    import hashlib

    from bert_jax.pretrain import startup_checks
    batch = {"input_ids": np.array([[2, 7, 511, 3]]), "masked_lm_ids": np.array([[600, 0]])}
    startup_checks.check_token_ids(batch, 601, "data/*.tfrecord")
    with pytest.raises(ValueError, match=r"data/\*.tfrecord: masked_lm_ids holds token id 600 but "
                                         r"config.model.vocab_size=600") as e:
        startup_checks.check_token_ids(batch, 600, "data/*.tfrecord")
    from bert_jax import exit_codes
    assert exit_codes.of(e.value) == exit_codes.DATA  # raised while training: bad data, not retried
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nword\n")
    made = tmp_path / "made"
    made.mkdir()
    info = {"vocab_sha256": hashlib.sha256(vocab.read_bytes()).hexdigest(), "flags": {"vocab_file": str(vocab)}}
    (made / "dataset_info.json").write_text(json.dumps(info))
    startup_checks.check_vocab_matches_data(str(vocab), [str(made / "*.tfrecord")])  # the same file: fine
    crlf = tmp_path / "crlf.txt"  # the same tokens, other bytes: fine
    crlf.write_bytes(vocab.read_bytes().replace(b"\n", b"\r\n").rstrip())
    startup_checks.check_vocab_matches_data(str(crlf), [str(made / "*.tfrecord")])
    other = tmp_path / "other.txt"
    other.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nmot\n")
    with pytest.raises(ValueError, match=r"other.txt is not the vocabulary .*made/\*.tfrecord was made with "
                                         r"\(.*vocab.txt, per its dataset_info.json\): their tokens differ"):
        startup_checks.check_vocab_matches_data(str(other), [f"{tmp_path / 'nothing' / '*'},{made / '*.tfrecord'}"])
    vocab.unlink()  # the recorded file gone: bytes differ, tokens unknown -> a warning, not an error
    startup_checks.check_vocab_matches_data(str(other), [str(made / "*.tfrecord")])


def test_hparams_report_the_model_as_built_not_the_config_defaults():
    # An init checkpoint's config.json replaces config.model's sizes; TensorBoard must show those.
    import importlib

    from bert_jax.model.model_config import BertConfig
    from bert_jax.training import run_setup

    config = importlib.import_module("configs.base").get_config()
    built = BertConfig(vocab_size=1000, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                       intermediate_size=1536)
    h = run_setup.hparams(config, built)
    assert config.model.hidden_size == 768 and h["model.hidden_size"] == 384
    assert h["model.num_hidden_layers"] == 6 and h["model.vocab_size"] == 1000
    assert h["learning_rate"] == config.learning_rate and h["mesh.data"] == -1
    assert "model.bert_jax" not in h and all(isinstance(v, (int, float, str, bool)) for v in h.values())
