"""Checkpoint interop: Google TF1 in and out, the bert_jax format, the CLI. HuggingFace's side is in
test_convert_hf.py.

The Google checkpoint is written with TF1's own `Saver` from names typed out of the issue's list
(not from `bert_jax.formats.google`'s table: tests/helpers/google_checkpoint.py, the `google_dir`
fixture of conftest.py), and the imported model is checked against an independent numpy forward
pass of Google's TF1 BERT on those same variables.
"""

import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import scipy.special

from bert_jax import convert
from bert_jax.formats.google import _GOOGLE_FIELDS
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modeling import BertModel

tf = pytest.importorskip("tensorflow")
transformers = pytest.importorskip("transformers")

from tests.helpers.google_checkpoint import (  # noqa: E402
    GOOGLE_CONFIG, H, I, L, NH, google_variables, inputs, run_encoder, run_ours, write_tf1_checkpoint)


def numpy_google_bert(v, ids, mask, seg, positions, gelu="tanh"):
    """Google's TF1 BERT forward (modeling.py + run_pretraining.py heads) in float64 numpy.

    `gelu`: the form Google's "gelu" took: "erf" in google-research/bert until 2019-02-07 (the
    2018 releases), "tanh" (the approximation) since.
    """
    v = {k: x.astype(np.float64) for k, x in v.items()}
    hd = H // NH

    def ln(x, name):
        m = x.mean(-1, keepdims=True)
        var = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(var + 1e-12) * v[name + "/gamma"] + v[name + "/beta"]

    def gelu_tanh(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    def gelu_erf(x):
        return 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))

    gelu = {"tanh": gelu_tanh, "erf": gelu_erf}[gelu]

    def dense(x, name):
        return x @ v[name + "/kernel"] + v[name + "/bias"]

    b, t = ids.shape
    x = (v["bert/embeddings/word_embeddings"][ids] + v["bert/embeddings/token_type_embeddings"][seg]
         + v["bert/embeddings/position_embeddings"][:t][None])
    x = ln(x, "bert/embeddings/LayerNorm")
    adder = (1.0 - mask[:, None, None, :].astype(np.float64)) * -10000.0
    for i in range(L):
        p = f"bert/encoder/layer_{i}/"

        def heads(name):
            return dense(x, p + "attention/self/" + name).reshape(b, t, NH, hd).transpose(0, 2, 1, 3)

        q, k, val = heads("query"), heads("key"), heads("value")
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + adder
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ val).transpose(0, 2, 1, 3).reshape(b, t, H)
        att = ln(dense(ctx, p + "attention/output/dense") + x, p + "attention/output/LayerNorm")
        x = ln(dense(gelu(dense(att, p + "intermediate/dense")), p + "output/dense") + att,
               p + "output/LayerNorm")
    pooled = np.tanh(dense(x[:, 0], "bert/pooler/dense"))
    out = {"sequence": x, "pooled": pooled}
    if "cls/predictions/output_bias" in v:
        gathered = x[np.arange(b)[:, None], positions]
        h = ln(gelu(dense(gathered, "cls/predictions/transform/dense")), "cls/predictions/transform/LayerNorm")
        out["mlm"] = h @ v["bert/embeddings/word_embeddings"].T + v["cls/predictions/output_bias"]
        out["nsp"] = pooled @ v["cls/seq_relationship/output_weights"].T + v["cls/seq_relationship/output_bias"]
    return out


def assert_trees_equal(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (k, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(k)
        assert np.array_equal(x, y), jax.tree_util.keystr(k)  # bit-exact


# ---------------------------------------------------------------------------------------------
# Google TF1
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("google_gelu", [None, "erf", "tanh"])
def test_google_import_matches_independent_forward(google_dir, google_gelu, caplog):
    """Google's "gelu" is the erf form by default (the 2018 releases), the tanh form on request;
    either way the import equals Google's TF1 graph computed with that form."""
    path, variables = google_dir
    assert convert.detect_format(path) == "google"
    with caplog.at_level(logging.INFO):
        p = convert.load_pretrained(path, google_gelu=google_gelu)
    form = google_gelu or "erf"
    assert p.config.hidden_act == {"erf": "gelu", "tanh": "gelu_tanh"}[form]
    said = [r for r in caplog.records if "Google config" in r.getMessage()]
    assert len(said) == 1 and f'google_gelu="{form}"' in said[0].getMessage()  # one line: the choice, ...
    assert f'--google_gelu={"tanh" if form == "erf" else "erf"}' in said[0].getMessage()  # ... how to change it
    assert said[0].levelno == (logging.WARNING if google_gelu is None else logging.INFO)
    assert p.do_lower_case is True  # from the release-style directory name
    assert p.vocab_file == os.path.join(path, "vocab.txt")
    assert p.missing == ()
    assert set(p.skipped) == {"global_step", "bert/pooler/dense/kernel/adam_m", "output_weights"}
    ids, mask, seg, positions = inputs()
    ref = numpy_google_bert(variables, ids, mask, seg, positions, gelu=form)
    other = numpy_google_bert(variables, ids, mask, seg, positions, gelu="tanh" if form == "erf" else "erf")
    assert np.abs(ref["mlm"] - other["mlm"]).max() > 1e-3  # the test tells the two forms apart
    out = run_ours(p, ids, mask, seg, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(run_encoder(p, ids, mask, seg).sequence_output)[real],
                               ref["sequence"][real], atol=1e-5)
    np.testing.assert_allclose(out.pooled_output, ref["pooled"], atol=1e-5)
    np.testing.assert_allclose(out.mlm_logits, ref["mlm"], atol=1e-5)
    np.testing.assert_allclose(out.nsp_logits, ref["nsp"], atol=1e-5)


def test_google_encoder_only_reports_missing_heads(tmp_path):
    variables = google_variables(heads=False)
    write_tf1_checkpoint(str(tmp_path / "enc"), variables, extra=False)
    p = convert.load_pretrained(str(tmp_path / "enc" / "bert_model.ckpt"))  # a prefix works too
    # Casing from its vocabulary (no capitals: lower-cased), whatever the folder is called.
    assert p.missing == ("mlm", "nsp") and p.heads == () and p.do_lower_case is True
    ids, mask, seg, _ = inputs()
    out = BertModel(p.config).apply({"params": convert.model_params(p)["bert"]}, ids, mask, seg)
    ref = numpy_google_bert(variables, ids, mask, seg, None, gelu="erf")  # the default reading
    np.testing.assert_allclose(out.pooled_output, ref["pooled"], atol=1e-5)


def test_google_missing_encoder_variable_and_bad_shape_are_named(tmp_path):
    variables = google_variables()
    del variables["bert/encoder/layer_1/output/dense/bias"]
    write_tf1_checkpoint(str(tmp_path / "a"), variables, extra=False)
    with pytest.raises(ValueError, match="layer_1/output/dense/bias"):
        convert.load_pretrained(str(tmp_path / "a"))
    variables = google_variables()
    write_tf1_checkpoint(str(tmp_path / "b"), variables, extra=False)
    cfg = dict(GOOGLE_CONFIG, intermediate_size=I + 1)
    (tmp_path / "b" / "bert_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"intermediate/dense/kernel has shape \(16, 32\).*intermediate_size=33"):
        convert.load_pretrained(str(tmp_path / "b"))


@pytest.mark.parametrize("fmt", convert.FORMATS)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_export_import_round_trip_is_bit_exact(google_dir, tmp_path, fmt, act):
    src = convert.load_pretrained(google_dir[0])
    src.config = src.config.replace(hidden_act=act)
    out = convert.save_pretrained(src, str(tmp_path / fmt), fmt)
    assert convert.detect_format(out) == fmt
    back = convert.load_pretrained(out)
    assert back.format == fmt
    assert_trees_equal(back.params, src.params)
    for field in _GOOGLE_FIELDS + ("layer_norm_eps",):
        assert getattr(back.config, field) == getattr(src.config, field), field
    assert back.do_lower_case is True
    assert open(back.vocab_file).read() == open(src.vocab_file).read()
    if fmt == "google":  # Google's own reading of the file: "gelu", + our marker naming which
        cfg = json.load(open(os.path.join(out, "bert_config.json")))
        assert cfg["hidden_act"] == "gelu" and cfg["bert_jax_hidden_act"] == act
        reader = tf.train.load_checkpoint(os.path.join(out, "bert_model.ckpt"))
        assert reader.get_variable_to_shape_map()["cls/seq_relationship/output_weights"] == [2, H]
        np.testing.assert_array_equal(reader.get_tensor("bert/encoder/layer_0/attention/self/query/kernel"),
                                      google_dir[1]["bert/encoder/layer_0/attention/self/query/kernel"])


def test_google_gelu_in_config_reading(tmp_path):
    """`google_gelu` resolves Google's "gelu" only: erf by default, tanh on request; our export's
    `bert_jax_hidden_act` marker wins over it; other formats and activations are untouched."""
    d = dict(GOOGLE_CONFIG)
    assert BertConfig.from_dict(d, google_format=True).hidden_act == "gelu"
    assert BertConfig.from_dict(d, google_format=True, google_gelu="erf").hidden_act == "gelu"
    assert BertConfig.from_dict(d, google_format=True, google_gelu="tanh").hidden_act == "gelu_tanh"
    assert BertConfig.from_dict(d, google_gelu="tanh").hidden_act == "gelu"  # ours/HF: "gelu" is erf
    relu = dict(d, hidden_act="relu")
    assert BertConfig.from_dict(relu, google_format=True, google_gelu="tanh").hidden_act == "relu"
    for marker in ("gelu", "gelu_tanh", "gelu_new"):
        for flag in (None, "erf", "tanh"):
            cfg = BertConfig.from_dict(dict(d, bert_jax_hidden_act=marker), google_format=True, google_gelu=flag)
            assert cfg.hidden_act == marker, (marker, flag)
    with pytest.raises(ValueError, match=r"google_gelu must be one of \('erf', 'tanh'\), got 'exact'"):
        BertConfig.from_dict(d, google_format=True, google_gelu="exact")
    path = tmp_path / "bert_config.json"
    path.write_text(json.dumps(d))
    assert BertConfig.from_json_file(path).hidden_act == "gelu"
    assert BertConfig.from_json_file(path, google_gelu="tanh").hidden_act == "gelu_tanh"
    assert convert.read_google_config(str(path), "tanh").hidden_act == "gelu_tanh"
    with pytest.raises(ValueError, match="google_gelu must be one of"):  # whatever the format
        convert.load_config(str(tmp_path / "absent"), "hf", google_gelu="exact")


@pytest.mark.parametrize("google_gelu", ["erf", "tanh"])
def test_google_gelu_round_trips_and_hf_export_names_it(google_dir, tmp_path, google_gelu):
    """Google -> ours -> Google -> ours keeps the chosen GELU (on re-import the export's marker wins
    over any flag), and the HF export names it ("gelu" for erf, "gelu_new" for tanh): transformers
    then computes Google's graph with that form."""
    act, hf_act = {"erf": ("gelu", "gelu"), "tanh": ("gelu_tanh", "gelu_new")}[google_gelu]
    flip = "tanh" if google_gelu == "erf" else "erf"
    src = convert.load_pretrained(google_dir[0], google_gelu=google_gelu)
    assert src.config.hidden_act == act
    ours = convert.load_pretrained(convert.save_bert_jax(src, str(tmp_path / "ours")))
    assert json.load(open(tmp_path / "ours" / "bert_config.json"))["hidden_act"] == act  # recorded
    assert ours.config == src.config
    google = convert.save_google(ours, str(tmp_path / "google"))
    cfg = json.load(open(os.path.join(google, "bert_config.json")))
    assert (cfg["hidden_act"], cfg["bert_jax_hidden_act"]) == ("gelu", act)
    for flag in (None, google_gelu, flip):
        back = convert.load_pretrained(google, google_gelu=flag)
        assert back.config == src.config, flag
        assert convert.load_config(google, google_gelu=flag) == src.config, flag
    assert_trees_equal(back.params, src.params)
    hf = convert.save_hf(back, str(tmp_path / "hf"))
    assert json.load(open(os.path.join(hf, "config.json")))["hidden_act"] == hf_act
    assert convert.load_pretrained(hf).config.hidden_act == act
    model = transformers.FlaxBertModel.from_pretrained(hf)
    assert model.config.hidden_act == hf_act
    ids, mask, seg, positions = inputs()
    ref = numpy_google_bert(google_dir[1], ids, mask, seg, positions, gelu=google_gelu)
    out = model(ids, attention_mask=mask, token_type_ids=seg)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.last_hidden_state)[real], ref["sequence"][real], atol=1e-5)
    np.testing.assert_allclose(out.pooler_output, ref["pooled"], atol=1e-5)


def test_scanned_params_export_like_unrolled(google_dir, tmp_path):
    src = convert.load_pretrained(google_dir[0])
    scanned = convert.model_params(src, src.config.replace(scan_layers=True))
    assert "layers" in scanned["bert"]["encoder"]
    again = convert.Pretrained(src.config, scanned, src.vocab_file, True)
    back = convert.load_pretrained(convert.save_bert_jax(again, str(tmp_path / "x")))
    assert_trees_equal(back.params, src.params)


# ---------------------------------------------------------------------------------------------
# The CLI and the bert_jax format
# ---------------------------------------------------------------------------------------------


def test_cli_chain_google_hf_bert_jax_google(google_dir, tmp_path, capsys, caplog):
    src, variables = google_dir
    a, b, c = str(tmp_path / "hf"), str(tmp_path / "bj"), str(tmp_path / "g")
    assert convert.main(["--input", src, "--output", a, "--output_format", "hf"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["input_format"] == "google" and summary["heads"] == ["mlm", "nsp"]
    assert "global_step" in summary["skipped"]
    assert convert.main(["--input", a, "--output", b, "--output_format", "bert_jax"]) == 0
    with caplog.at_level("INFO"):
        assert convert.main(["--input", b, "--input_format", "bert_jax", "--output", c,
                             "--output_format", "google"]) == 0
    # Our INFO lines stay; orbax's per-read INFO chatter (throughput, handlers) does not.
    assert not [r for r in caplog.records if f"{os.sep}orbax{os.sep}" in r.pathname and r.levelno < 30]
    reader = tf.train.load_checkpoint(os.path.join(c, "bert_model.ckpt"))
    assert set(reader.get_variable_to_shape_map()) == set(variables)
    for name, value in variables.items():
        np.testing.assert_array_equal(reader.get_tensor(name), value, err_msg=name)
    with pytest.raises(FileExistsError, match="not empty"):
        convert.main(["--input", b, "--output", c, "--output_format", "google"])


def test_cli_google_gelu_flag(google_dir, tmp_path, capsys, caplog):
    """--google_gelu picks the GELU of a Google checkpoint (default erf); one log line says which
    (an INFO line when chosen: the CLI shows bert_jax's INFO lines); the HF export says it."""
    for flag, act, hf_act in ((None, "gelu", "gelu"), ("erf", "gelu", "gelu"), ("tanh", "gelu_tanh", "gelu_new")):
        out = str(tmp_path / f"hf_{flag}")
        argv = ["--input", google_dir[0], "--output", out, "--output_format", "hf"]
        caplog.clear()
        assert convert.main(argv + ([f"--google_gelu={flag}"] if flag else [])) == 0
        said = [r for r in caplog.records if r.getMessage().startswith("Google config")]
        assert len(said) == 1 and f'google_gelu="{flag or "erf"}"' in said[0].getMessage()
        assert said[0].levelno == (logging.WARNING if flag is None else logging.INFO)
        assert json.loads(capsys.readouterr().out)["hidden_act"] == act
        assert json.load(open(os.path.join(out, "config.json")))["hidden_act"] == hf_act
    with pytest.raises(SystemExit):
        convert.main(["--input", google_dir[0], "--output", str(tmp_path / "x"), "--output_format", "hf",
                      "--google_gelu=exact"])
    assert "invalid choice: 'exact'" in capsys.readouterr().err


def test_google_gelu_reaches_the_tools_that_read_an_init_checkpoint(google_dir):
    """config.google_gelu (pretraining, evaluation, fine-tuning) and fill_mask's google_gelu read a
    Google checkpoint's "gelu" as asked; erf when not asked."""
    from bert_jax import fill_mask
    from bert_jax.training import run_setup
    from configs import base, glue
    for flag, act in ((None, "gelu"), ("erf", "gelu"), ("tanh", "gelu_tanh")):
        for config in (base.get_config(), glue.get_config()):
            config.init_checkpoint, config.google_gelu = google_dir[0], flag
            assert run_setup.bert_config_from(config).hidden_act == act, (flag, config.mode)
        assert fill_mask.load(google_dir[0], google_gelu=flag)[1].hidden_act == act


def test_pretraining_workdir_is_a_bert_jax_checkpoint(google_dir, tmp_path):
    """A workdir's newest TrainState (checkpoints/<step>/state) loads like an export."""
    import optax
    from bert_jax.checkpoints import checkpointer
    from bert_jax.training import train_state
    src = convert.load_pretrained(google_dir[0])
    params = convert.model_params(src, src.config.replace(scan_layers=True))
    state = train_state.create_train_state(params, optax.adam(1e-3), jax.random.key(0))
    workdir = tmp_path / "work"
    src.config.to_json_file(str(tmp_path / "bert_config.json"))
    os.makedirs(workdir)
    os.replace(tmp_path / "bert_config.json", workdir / "bert_config.json")
    with checkpointer.Checkpointer(str(workdir / "checkpoints"), save_interval_steps=1, max_to_keep=2,
                                    handle_sigterm=False) as ckpt:
        ckpt.save(7, state, {}, force=True)
    p = convert.load_pretrained(str(workdir))
    assert p.format == "bert_jax" and p.heads == ("mlm", "nsp")
    assert_trees_equal(p.params, src.params)


def test_fetch_downloads_and_unpacks_a_release_zip_once(google_dir, tmp_path):
    """Google's releases are zips (the 2018 ones with a top folder, the 2020 ones without)."""
    import zipfile
    src = google_dir[0]
    for top, name in (("uncased_L-2_H-16_A-4/", "a.zip"), ("", "uncased_L-2_H-16_A-4.zip")):
        archive = tmp_path / name
        with zipfile.ZipFile(archive, "w") as z:
            for f in os.listdir(src):
                z.write(os.path.join(src, f), top + f)
        path = convert.fetch(archive.as_uri(), str(tmp_path / f"cache_{name}"))
        p = convert.load_pretrained(path)
        assert p.format == "google" and p.do_lower_case is True
        assert_trees_equal(p.params, convert.load_pretrained(src).params)
        archive.unlink()  # a second fetch uses the cache
        assert convert.fetch(archive.as_uri(), str(tmp_path / f"cache_{name}")) == path
    assert convert.fetch(src, str(tmp_path)) == src
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("../evil/bert_config.json", "{}")
    with pytest.raises(ValueError, match="unsafe path"):
        convert.fetch(bad.as_uri(), str(tmp_path / "c3"))


def test_convert_and_formats_import_tensorflow_only_to_read_or_write_google_checkpoints():
    code = ("import bert_jax.convert, bert_jax.formats.google, bert_jax.formats.hf, bert_jax.formats.native, sys; "
            "assert 'tensorflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
