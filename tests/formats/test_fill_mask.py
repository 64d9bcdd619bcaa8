"""fill_mask: top-k guesses equal transformers' FlaxBertForPreTraining on the same exported weights."""

import jax
import numpy as np
import pytest

from bert_jax import convert, fill_mask
from bert_jax.formats.common import unrolled
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modeling import dummy_inputs
from bert_jax.model.pretraining_heads import BertForPreTraining

transformers = pytest.importorskip("transformers")
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "a", "big", "red", "##s", "hello", "world", ".", ","]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fm")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    params = BertForPreTraining(config).init(jax.random.key(1), **dummy_inputs(config))["params"]
    params = jax.tree_util.tree_map(
        lambda x: np.asarray(x) + 0.3 * np.random.default_rng(x.size).standard_normal(x.shape), params)
    p = convert.Pretrained(config, unrolled(params), str(d / "vocab.txt"), True)
    return convert.save_hf(p, str(d / "hf"))


def test_guesses_match_transformers(hf_dir, capsys):
    params, config, tok = fill_mask.load(hf_dir)
    texts = ["The cat [MASK] on the mat.", "[MASK] dog ran , [MASK] world"]
    results = fill_mask.fill_mask(params, config, tok, texts, top_k=3)
    hf = transformers.FlaxBertForPreTraining.from_pretrained(hf_dir)
    for r in results:
        ids = np.array([tok.convert_tokens_to_ids(r["tokens"])])
        probs = np.asarray(jax.nn.softmax(hf(ids).prediction_logits[0], -1))
        masks = [i for i, t in enumerate(r["tokens"]) if t == "[MASK]"]
        assert len(r["guesses"]) == len(masks)
        for pos, guesses in zip(masks, r["guesses"]):
            order = np.argsort(-probs[pos])[:3]
            assert [g[0] for g in guesses] == [tok.inv_vocab[int(i)] for i in order]
            np.testing.assert_allclose([g[1] for g in guesses], probs[pos][order], atol=1e-5)
    # A pretraining config with FP8 (as the demo's): guessed in the model's dtype, the same guesses
    # (FP8's scaling state is the train state's, not in `params`).
    assert fill_mask.fill_mask(params, config.replace(fp8=True), tok, texts, top_k=3) == results
    assert fill_mask.main(["--init_checkpoint", hf_dir, "--text", "the [MASK] sat", "--top_k", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the [MASK] sat\n    [MASK] -> ") and out.count("(") == 2


def test_clear_errors(hf_dir, tmp_path, capsys):
    params, config, tok = fill_mask.load(hf_dir)
    with pytest.raises(ValueError, match="no \\[MASK\\]"):
        fill_mask.fill_mask(params, config, tok, ["no blank here"])
    p = convert.load_pretrained(hf_dir)
    encoder_only = convert.save_hf(convert.Pretrained(p.config, {"bert": p.params["bert"]}, p.vocab_file, True),
                                   str(tmp_path / "enc"))
    with pytest.raises(ValueError, match="no masked-LM head"):
        fill_mask.load(encoder_only)
    # The command line says it in one line (exit status 2), not with a traceback.
    assert fill_mask.main(["--init_checkpoint", encoder_only, "--text", "the [MASK] sat"]) == 2
    assert fill_mask.main(["--init_checkpoint", hf_dir, "--text", "no blank"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "no masked-LM head" in err[0] and "no [MASK]" in err[1]
