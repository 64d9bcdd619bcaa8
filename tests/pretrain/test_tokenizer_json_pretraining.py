"""Pretraining over records a HuggingFace tokenizer.json made (`config.tokenizer_json`): dynamic masking
takes the file's [MASK] id and size, the workdir and the HF export carry the file, and a run given
another tokenizer.json, both vocabularies, whole-word dynamic masking or too small a model is refused.

Two byte-level BPE tokenizer.json files are trained here by the `tokenizers` library on a few hundred
lines of made-up text (no shared data); their special tokens are ordered so that [MASK] is not a
vocab.txt's id 4. Records: `create_pretraining_data --tokenizer_json`, statically masked at 15%."""

import json
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tokenizers = pytest.importorskip("tokenizers")

from bert_jax import exit_codes  # noqa: E402
from bert_jax.pretrain import feed, loop, startup_checks  # noqa: E402
from bert_jax.pretrain.phases import resolve_phases  # noqa: E402
from configs import modernbert_tiny  # noqa: E402
from tests.helpers.pretraining_runs import ROOT, env, losses  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PREDS = 10  # configs/modernbert_tiny.py's max_predictions_per_seq


def train_bpe(lines, path, vocab_size: int, specials) -> str:
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Tokenizer A (400 ids, [MASK] 0) and B (another vocabulary), and records of A (length 32)."""
    from data_pipeline import create_pretraining_data as cpd

    rng = np.random.RandomState(0)
    words = ["".join(rng.choice(list("abcdefghijklmnop"), rng.randint(2, 9))) for _ in range(120)]
    lines = [" ".join(rng.choice(words, rng.randint(6, 14))) + "." for _ in range(400)]
    d = tmp_path_factory.mktemp("bpe")
    a = train_bpe(lines, d / "a.json", 400, ["[MASK]", "[CLS]", "[SEP]", "[PAD]", "[UNK]"])
    b = train_bpe(lines[:200], d / "b.json", 380, SPECIALS)
    text = d / "corpus.txt"
    text.write_text("\n\n".join("\n".join(lines[i:i + 10]) for i in range(0, 400, 10)) + "\n")
    records = {}
    for name, tokenizer in (("a", a), ("b", b)):
        records[name] = d / f"records_{name}"
        cpd.create_pretraining_data([str(text)], str(records[name]), None, tokenizer_json=tokenizer,
                                    max_seq_length=32, max_predictions_per_seq=PREDS, masked_lm_prob=0.15,
                                    dupe_factor=1, random_seed=3)
    return {"a": a, "b": b, "records": records}


def tiny_config(made, **more):
    """configs/modernbert_tiny.py over records of A with A's tokenizer.json, 30% dynamic masking."""
    config = modernbert_tiny.get_config()
    settings = {"train_data": f"{made['records']['a']}/*.tfrecord", "tokenizer_json": made["a"], "vocab_file": "",
                "verify_data": False, "packing": False, "dynamic_masking": True, "masked_lm_prob": 0.3,
                "num_train_steps": 3, "log_every_steps": 1, "checkpoint_every_steps": 3, "eval_every_steps": 0,
                "lr_decay_steps": 1}
    for k, v in dict(settings, **more).items():
        setattr(config, k, v)
    m = config.model  # A's ids: [MASK] 0, [CLS] 1, [SEP] 2, [PAD] 3
    m.pad_token_id, m.cls_token_id, m.sep_token_id, m.bos_token_id, m.eos_token_id = 3, 1, 2, 1, 2
    return config


def test_dynamic_masking_uses_the_tokenizer_jsons_mask_id(made):
    want = tokenizers.Tokenizer.from_file(made["a"]).token_to_id("[MASK]")
    assert want == 0  # not a vocab.txt's 4, nor [PAD]'s 0 in a vocab.txt: A's own order
    config = tiny_config(made)
    special_ids = startup_checks.special_token_ids("", config.tokenizer_json)
    batch = next(feed.make_train_input(config, resolve_phases(config)[0], special_ids))
    weights = batch["masked_lm_weights"] > 0
    real = batch["input_mask"].sum(1)
    # 30% of each row (the records' own masks are 15%): dynamic masking made these.
    np.testing.assert_array_equal(weights.sum(1), np.minimum(PREDS, np.maximum(1, np.round(real * 0.3))))
    at = np.take_along_axis(batch["input_ids"], batch["masked_lm_positions"], 1)[weights]
    labels = batch["masked_lm_ids"][weights]
    assert (labels != want).all()  # the originals: never [MASK]
    share = (at == want).mean()
    assert 0.6 < share < 0.95, share  # 80% of the predicted tokens become [MASK] (rule 80/10/10)
    unmasked = np.ones_like(batch["input_ids"], bool)
    np.put_along_axis(unmasked, batch["masked_lm_positions"], ~weights, 1)
    assert not (batch["input_ids"][unmasked & (batch["input_mask"] > 0)] == want).any()


def test_main_trains_on_them_and_the_export_carries_the_tokenizer_json(made, tmp_path):
    import transformers

    from bert_jax import convert

    work = tmp_path / "w"
    overrides = {k: v for k, v in tiny_config(made).items() if k in (
        "train_data", "tokenizer_json", "verify_data", "packing", "num_train_steps", "log_every_steps",
        "checkpoint_every_steps", "eval_every_steps", "lr_decay_steps")}
    args = [sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/modernbert_tiny.py'}",
            f"--workdir={work}"] + [f"--config.{k}={v}" for k, v in overrides.items()] + [
            f"--config.model.{k}_token_id={v}" for k, v in dict(pad=3, cls=1, sep=2, bos=1, eos=2).items()]
    r = subprocess.run(args, env=env(devices=1), cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(losses(work)) == [1, 2, 3] and all(np.isfinite(list(losses(work).values())))
    assert (work / "tokenizer.json").read_bytes() == open(made["a"], "rb").read()
    assert not (work / "vocab.txt").exists()
    out = tmp_path / "hf"
    assert convert.main([f"--input={work}", f"--output={out}", "--output_format=hf"]) == 0
    assert not (out / "vocab.txt").exists()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert hf.convert_tokens_to_ids("[MASK]") == 0
    exported = json.loads((out / "config.json").read_text())
    assert [exported[f"{r}_token_id"] for r in ("pad", "cls", "sep")] == hf.convert_tokens_to_ids(
        ["[PAD]", "[CLS]", "[SEP]"])


@pytest.mark.parametrize("more,match", [
    ({"tokenizer_json": "B"}, r"config.tokenizer_json=.*b.json is not the tokenizer.json .*records_a/\*.tfrecord "
                              r"was made with \(.*a.json, per its dataset_info.json\)"),
    ({"train_data": "RECORDS_B"}, r"config.tokenizer_json=.*a.json is not the tokenizer.json .*records_b"),
    ({"vocab_file": "VOCAB"}, r"config.vocab_file=.*vocab.txt and config.tokenizer_json=.*a.json: give one"),
    ({"dynamic_whole_word_mask": True}, r"config.dynamic_whole_word_mask=True with config.tokenizer_json="),
    ({"model.vocab_size": 399}, r"config.model.vocab_size=399, but .* of 400 ids"),
    ({"model.sep_token_id": 3}, r"config.model.sep_token_id=3, but the sep token of config.tokenizer_json=.*a.json "
                                r"has id 2"),
])
def test_a_run_is_refused_before_training(made, tmp_path, more, match):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS) + "\n")
    stand_in = {"B": made["b"], "RECORDS_B": f"{made['records']['b']}/*.tfrecord", "VOCAB": str(vocab)}
    config = tiny_config(made)
    for key, value in more.items():
        value = stand_in.get(value, value)
        if key.startswith("model."):
            setattr(config.model, key[len("model."):], value)
        else:
            setattr(config, key, value)
    with pytest.raises(ValueError, match=match) as e:
        loop.run(config, str(tmp_path / "w"))
    assert exit_codes.of(e.value) == exit_codes.CONFIG


def test_the_model_smaller_than_the_file_is_refused_naming_the_key(made):
    with pytest.raises(ValueError, match=r"config.tokenizer_json=.*a.json has 400 tokens but "
                                         r"config.model.vocab_size=399"):
        startup_checks.check_special_ids_fit(startup_checks.special_token_ids("", made["a"]), 399,
                                             f"config.tokenizer_json={made['a']}")
