"""extract_features: Google's input rules and JSON layout; values equal the model's hidden states."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bert_jax import convert, extract_features as ef
from tests.helpers.xla_flags import xla_flags
from bert_jax.formats.common import unrolled
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modeling import BertModel
from data_pipeline import tokenization

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "a", "big", "red", "##s", "hello", "world", "!", ","]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny BERT (3 layers) exported in HF format with its vocab and casing."""
    d = tmp_path_factory.mktemp("ckpt")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    params = BertModel(config).init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    params = jax.tree_util.tree_map(
        lambda x: np.asarray(x) + 0.1 * np.random.default_rng(x.size).standard_normal(x.shape), params)
    p = convert.Pretrained(config, {"bert": unrolled(params)}, str(d / "vocab.txt"), True)
    return convert.save_hf(p, str(d / "hf")), config


def test_featurize_follows_googles_rules():
    class Tok:  # whitespace "tokenizer": the rules under test are truncation and layout
        def tokenize(self, text):
            return text.split()

        def convert_tokens_to_ids(self, tokens):
            return [len(t) for t in tokens]

    f = ef.featurize(ef.Example(0, "a b c d e", "x y z"), Tok(), 8)
    # 8 - 3 = 5 pieces: pop from the longer (a) until 5 remain: a b c | x y z -> a(3) + b(3) = 6 > 5,
    # tie at 3 vs 3 pops from b -> a b c | x y.
    assert f.tokens == ["[CLS]", "a", "b", "c", "[SEP]", "x", "y", "[SEP]"]
    assert f.segment_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    f = ef.featurize(ef.Example(1, "a b c d e f g"), Tok(), 6)
    assert f.tokens == ["[CLS]", "a", "b", "c", "d", "[SEP]"]
    f = ef.featurize(ef.Example(2, ""), Tok(), 6)
    assert f.tokens == ["[CLS]", "[SEP]"] and f.input_mask.tolist() == [1, 1, 0, 0, 0, 0]
    assert ef.hidden_state_index(-1, 3) == 3 and ef.hidden_state_index(0, 3) == 1
    with pytest.raises(ValueError, match="--layers: -4 is out of range"):
        ef.hidden_state_index(-4, 3)


def test_read_examples_pairs_blank_lines_and_bad_utf8(tmp_path):
    p = tmp_path / "in.txt"
    p.write_bytes(b"hello world\n\nthe cat ||| the dog\nbad \xff byte\n")
    stats = {}
    ex = list(ef.read_examples(str(p), stats))
    assert [(e.index, e.text_a, e.text_b) for e in ex] == [
        (0, "hello world", None), (1, "", None), (2, "the cat", "the dog"), (3, "bad \ufffd byte", None)]
    assert stats["lines_with_bad_utf8"] == 1
    assert ef.count_lines(str(p)) == 4  # the progress bar's total
    for content, expected in ((b"", 0), (b"one", 1), (b"a\r\nb", 2), (b"\n\n", 2)):
        p.write_bytes(content)
        assert ef.count_lines(str(p)) == len(list(ef.read_examples(str(p)))) == expected


def test_cli_output_equals_the_models_hidden_states(checkpoint, tmp_path):
    ckpt, config = checkpoint
    lines = ["the cat sat on the mat!", "hello world ||| a big red dogs ran", "", "the " * 40]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out" / "features.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    r = subprocess.run([sys.executable, "-m", "bert_jax.extract_features", f"--input_file={tmp_path / 'in.txt'}",
                        f"--output_file={out}", f"--init_checkpoint={ckpt}", "--layers=-1,0,-2",
                        "--max_seq_length=16", "--batch_size=3", "--combine=concat_last_four",
                        "--sentence_pooling=mean"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["linex_index"] for rec in records] == [0, 1, 2, 3]
    assert list(records[0]) == ["linex_index", "features", "sentence_embedding"]
    assert list(records[0]["features"][0]) == ["token", "layers", "combined"]

    tok = tokenization.FullTokenizer(str(Path(ckpt) / "vocab.txt"), do_lower_case=True)
    p = convert.load_pretrained(ckpt)
    for rec, line in zip(records, lines):
        a, _, b = line.partition(" ||| ")
        ex = ef.Example(rec["linex_index"], a.strip(), b.strip() if b else None)
        feat = ef.featurize(ex, tok, 16)
        assert [f["token"] for f in rec["features"]] == feat.tokens
        hidden = BertModel(config).apply({"params": p.params["bert"]}, feat.input_ids[None], feat.input_mask[None],
                                         feat.segment_ids[None], output_hidden_states=True).hidden_states
        hidden = np.asarray(hidden)[:, 0]  # [layers + 1, length, hidden]
        n = len(feat.tokens)
        for j, index in enumerate([-1, 0, -2]):
            got = np.array([f["layers"][j]["values"] for f in rec["features"]])
            assert rec["features"][0]["layers"][j]["index"] == index
            want = hidden[{-1: 3, 0: 1, -2: 2}[index], :n]
            np.testing.assert_allclose(got, want, atol=2e-6)
        # "last four" of a 3-layer model: its three Transformer layers, last first (not the embeddings)
        concat = np.concatenate([hidden[3], hidden[2], hidden[1]], -1)[:n]
        np.testing.assert_allclose(np.array([f["combined"] for f in rec["features"]]), concat, atol=2e-6)
        np.testing.assert_allclose(rec["sentence_embedding"], concat.mean(0), atol=2e-6)
    assert len(records[3]["features"]) == 16  # truncated to max_seq_length
    # A pretraining config with FP8: features in the model's dtype, the same (FP8's scaling state is
    # the train state's, not in the parameters).
    fp8 = ef.FeatureExtractor(config.replace(fp8=True), p.params["bert"], [-1], "none", "none")
    np.testing.assert_allclose(fp8(feat.input_ids[None], feat.input_mask[None], feat.segment_ids[None])["layers"][0],
                               hidden[None, 3], atol=2e-6)


def test_bad_flags_name_the_flag(checkpoint, tmp_path):
    ckpt, config = checkpoint
    (tmp_path / "in.txt").write_text("hello\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    r = subprocess.run([sys.executable, "-m", "bert_jax.extract_features", f"--input_file={tmp_path / 'in.txt'}",
                        f"--output_file={tmp_path / 'o.jsonl'}", f"--init_checkpoint={ckpt}", "--layers=-5", "--max_seq_length=16"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--layers: -5 is out of range" in r.stderr
    assert not (tmp_path / "o.jsonl").exists()
