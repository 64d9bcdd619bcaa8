"""Checkpoint interop with HuggingFace: an export that transformers' Flax BERT loads without a
warning and runs with identical outputs, imports of the weights transformers writes (Flax msgpack
and safetensors, PyTorch safetensors, an old BertModel file), a `pytorch_model.bin` never
unpickled without torch, and unrecognized or damaged files named. Google TF1 and the CLI:
test_convert.py.
"""

import json
import logging
import os
import pickle

import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.model.modeling import BertModel

transformers = pytest.importorskip("transformers")

from tests.helpers.google_checkpoint import (  # noqa: E402
    GOOGLE_CONFIG, H, I, L, NH, P, V, inputs, run_encoder, run_ours)


def load_hf_logged(cls, directory, caplog):
    """transformers' `cls.from_pretrained(directory)` and the warnings it logged."""
    caplog.clear()
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            model = cls.from_pretrained(directory)
    finally:
        transformers.logging.disable_propagation()
    return model, caplog.text


def test_hf_export_loads_in_transformers_with_identical_outputs(google_dir, tmp_path, caplog):
    src = convert.load_pretrained(google_dir[0])
    out = convert.save_hf(src, str(tmp_path / "hf"))
    pre, log = load_hf_logged(transformers.FlaxBertForPreTraining, out, caplog)
    assert "were not used" not in log and "newly initialized" not in log, log
    base, log = load_hf_logged(transformers.FlaxBertModel, out, caplog)
    assert "newly initialized" not in log, log  # (the heads are "not used" by a BertModel)
    encoder_only = convert.Pretrained(src.config, {"bert": src.params["bert"]}, src.vocab_file, True)
    _, log = load_hf_logged(transformers.FlaxBertModel, convert.save_hf(encoder_only, str(tmp_path / "enc")),
                            caplog)
    assert "were not used" not in log and "newly initialized" not in log, log
    assert pre.config.hidden_act == "gelu" and pre.config.architectures == ["BertForPreTraining"]  # erf default
    assert transformers.BertTokenizer.from_pretrained(out).do_lower_case
    ids, mask, seg, positions = inputs()
    ours = run_ours(src, ids, mask, seg, positions)
    ref = pre(ids, attention_mask=mask, token_type_ids=seg)
    np.testing.assert_allclose(ours.mlm_logits, np.take_along_axis(
        np.asarray(ref.prediction_logits), positions[..., None], axis=1), atol=1e-5)
    np.testing.assert_allclose(ours.nsp_logits, ref.seq_relationship_logits, atol=1e-5)
    ref_base = base(ids, attention_mask=mask, token_type_ids=seg)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(run_encoder(src, ids, mask, seg).sequence_output)[real],
                               np.asarray(ref_base.last_hidden_state)[real], atol=1e-5)
    np.testing.assert_allclose(ours.pooled_output, ref_base.pooler_output, atol=1e-5)


def _randomize(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: (np.asarray(x) + 0.1 * rng.standard_normal(x.shape)).astype(np.float32), tree)


def _pt_names(flax_tree):
    """Independent HF Flax -> PyTorch renaming, for files transformers itself would write in PT."""
    flat = {}
    for path, x in jax.tree_util.tree_flatten_with_path(flax_tree)[0]:
        keys = [k.key for k in path]
        leaf, name = keys[-1], ".".join(keys[:-1])
        if leaf == "kernel":
            flat[name + ".weight"] = np.asarray(x).T.copy()
        elif leaf in ("embedding", "scale"):
            flat[name + ".weight"] = np.asarray(x)
        else:
            flat[name + "." + leaf] = np.asarray(x)
    return flat


@pytest.mark.parametrize("layout", ["flax_msgpack", "flax_safetensors", "pt_safetensors",
                                    "pt_bare_gamma_beta"])
def test_hf_import_of_transformers_weights(tmp_path, layout):
    from safetensors.numpy import save_file
    hf_cfg = transformers.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                     intermediate_size=I, max_position_embeddings=P, hidden_act="gelu")
    model = transformers.FlaxBertForPreTraining(hf_cfg, seed=3)
    model.params = _randomize(model.params, 4)  # LayerNorms and biases random too
    d = str(tmp_path / layout)
    if layout == "flax_msgpack":
        model.save_pretrained(d)
    elif layout == "flax_safetensors":
        model.save_pretrained(d, safe_serialization=True)
    else:
        hf_cfg.save_pretrained(d)
        flat = _pt_names(model.params)
        if layout == "pt_bare_gamma_beta":  # an old BertModel file: no "bert." prefix, gamma/beta
            flat = {k[len("bert."):].replace("LayerNorm.weight", "LayerNorm.gamma")
                    .replace("LayerNorm.bias", "LayerNorm.beta"): v
                    for k, v in flat.items() if k.startswith("bert.")}
            flat["embeddings.position_ids"] = np.arange(P)[None]
        save_file(flat, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    p = convert.load_pretrained(d)
    assert p.format == "hf" and p.config.hidden_act == "gelu"
    ids, mask, seg, positions = inputs()
    if layout == "pt_bare_gamma_beta":
        assert p.missing == ("mlm", "nsp") and p.skipped == ("bert.embeddings.position_ids",)
    else:
        assert p.missing == () and p.skipped == ()
        ours = run_ours(p, ids, mask, seg, positions)
        ref = model(ids, attention_mask=mask, token_type_ids=seg)
        np.testing.assert_allclose(ours.mlm_logits, np.take_along_axis(
            np.asarray(ref.prediction_logits), positions[..., None], axis=1), atol=1e-5)
        np.testing.assert_allclose(ours.nsp_logits, ref.seq_relationship_logits, atol=1e-5)
    base = transformers.FlaxBertModel(hf_cfg, _do_init=False)
    ref_base = base(ids, attention_mask=mask, token_type_ids=seg, params=model.params["bert"])
    out = BertModel(p.config).apply({"params": convert.model_params(p)["bert"]}, ids, mask, seg)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.sequence_output)[real],
                               np.asarray(ref_base.last_hidden_state)[real], atol=1e-5)
    np.testing.assert_allclose(out.pooled_output, ref_base.pooler_output, atol=1e-5)


class _Payload:
    def __reduce__(self):
        return (open, (SENTINEL, "w"))


SENTINEL = os.path.join(os.path.dirname(__file__), "..", "..", ".unpickled_sentinel")


def test_pytorch_bin_is_never_unpickled_without_torch(tmp_path):
    try:
        import torch  # noqa: F401
        pytest.skip("torch installed: the .bin is read with torch.load(weights_only=True)")
    except ImportError:
        pass
    d = tmp_path / "pt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(GOOGLE_CONFIG, model_type="bert")))
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(ValueError, match="weights_only=True.*safetensors"):
        convert.load_pretrained(str(d))
    assert not os.path.exists(SENTINEL)


def test_unrecognized_directory_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="format not recognized.*notes.txt"):
        convert.load_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        convert.load_pretrained(str(tmp_path / "absent"))



def test_damaged_hf_files_are_named(google_dir, tmp_path):
    """A truncated download or a mis-encoded config.json names the file, not a bare
    SafetensorError / UnicodeDecodeError."""
    import shutil
    src = convert.load_pretrained(google_dir[0])
    good = convert.save_hf(src, str(tmp_path / "hf"))
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut/model.safetensors: not a readable safetensors file"):
        convert.load_pretrained(str(cut))
    latin = tmp_path / "latin"
    shutil.copytree(good, latin)
    config = (latin / "config.json").read_bytes()
    (latin / "config.json").write_bytes(config.replace(b"{", b'{"note": "caf\xe9", ', 1))
    with pytest.raises(ValueError, match=r"latin/config.json: line 1, column 14: byte 0xe9 is not valid UTF-8"):
        convert.load_pretrained(str(latin))
