"""A checkpoint's casing (do_lower_case) from what it holds, not from its folder's name: its
tokenizer_config.json when there is one, else its vocabulary (`formats.common.casing_from_vocab`)."""

from pathlib import Path

import pytest

from bert_jax.formats.common import casing_from_vocab

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "vocab"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write(path: Path, tokens) -> str:
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(path)


def test_hand_made_vocabularies(tmp_path):
    lower = [f"w{i}" for i in range(300)] + ["##ing", "ℝ"]  # one symbol with a capital, as bert-base-uncased
    assert casing_from_vocab(write(tmp_path / "u.txt", SPECIAL + lower)) is True
    cased = lower + [w.capitalize() for w in ("the", "paris", "john", "new", "york")]  # 5 of 307: 1.6%
    assert casing_from_vocab(write(tmp_path / "c.txt", SPECIAL + cased)) is False
    chinese = SPECIAL + ["<S>", "<T>"] + [chr(0x4E00 + i) for i in range(500)]
    assert casing_from_vocab(write(tmp_path / "zh.txt", chinese)) is True
    assert casing_from_vocab(write(tmp_path / "empty.txt", SPECIAL)) is None
    assert casing_from_vocab(str(tmp_path / "missing.txt")) is None


@pytest.mark.parametrize("name, lower", [("bert-base-uncased", True), ("bert-base-cased", False),
                                         ("bert-base-chinese", True)])
def test_the_released_vocabularies(name, lower):
    path = SHARED / name / "vocab.txt"
    if not path.exists():
        pytest.skip("../shared/data is absent")
    assert casing_from_vocab(str(path)) is lower


@pytest.mark.parametrize("fmt", ["google", "hf"])
def test_the_vocabulary_decides_not_the_folder_name(tmp_path, fmt):
    """A checkpoint without tokenizer_config.json (as Google's releases ship) whose vocabulary is
    cased, in a folder named like an uncased release: cased (the name said uncased before)."""
    pytest.importorskip("tensorflow")
    import jax
    import numpy as np

    from bert_jax import convert
    from bert_jax.model import modeling, pretraining_heads
    from bert_jax.model.model_config import BertConfig

    cfg = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     max_position_embeddings=16)
    params = pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **modeling.dummy_inputs(cfg))["params"]
    vocab = write(tmp_path / "vocab.txt", SPECIAL + ["The", "Paris", "a", "b"] + [f"w{i}" for i in range(31)])
    pretrained = convert.Pretrained(cfg, jax.tree_util.tree_map(np.asarray, params), vocab, None, "bert_jax", (), ())
    out = tmp_path / "uncased_L-1_H-8_A-2"
    convert.save_pretrained(pretrained, str(out), fmt)
    (out / "tokenizer_config.json").unlink(missing_ok=True)
    assert (out / "vocab.txt").exists()
    assert convert.load_pretrained(str(out)).do_lower_case is False
