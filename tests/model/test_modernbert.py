"""The ModernBERT encoder (bert_jax/model/modernbert.py) against transformers' `ModernBertForMaskedLM`.

The reference is transformers itself: `tests/fixtures/modernbert_tiny/` holds the config and tensor list
transformers saved for a tiny model and its outputs, on weights a seeded recipe draws
(`tests/helpers/modernbert_fixture.py`; no weights are committed), on two rows crossing the local window,
one padded (`tests/helpers/make_modernbert_reference.py`, run with torch). Where torch is importable the
export is also loaded by transformers and run live.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from bert_jax.formats import modernbert_hf
from bert_jax.model import attention, modernbert
from tests.helpers import modernbert_fixture

FIXTURE = modernbert_fixture.FIXTURE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The fixture's checkpoint as transformers loaded it: config.json and the drawn model.safetensors."""
    return modernbert_fixture.checkpoint(str(tmp_path_factory.mktemp("modernbert_tiny")))


def _forward(config, params, ids, mask, **kw):
    model = modernbert.ModernBertForMaskedLM(config)
    return model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), **kw)


def _reference():
    ref = np.load(os.path.join(FIXTURE, "reference.npz"))
    return {k: ref[k] for k in ref.files}


@pytest.mark.parametrize("local_blocks", [False, True])
def test_forward_equals_transformers_on_its_own_random_weights(local_blocks, tiny):
    config, params, task = modernbert_hf.load(tiny, local_blocks=local_blocks)
    assert task is None
    assert config.layer_types() == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    ref = _reference()
    hidden, logits = _forward(config, params, ref["input_ids"], ref["attention_mask"])
    # The band mask: every position, padding rows included (transformers masks keys only, as we do). By
    # blocks: every real token (a padding query out of reach of real keys averages its window instead).
    real = np.ones_like(ref["attention_mask"], bool) if not local_blocks else ref["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(hidden)[real], ref["last_hidden_state"][real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[real], ref["logits"][real], atol=1e-5, rtol=0)
    # The reference is not trivially matched: the local window and the rotary embeddings both matter.
    for change in () if local_blocks else ({"local_attention": 64}, {"local_rope_theta": 160_000.0}, {"global_rope_theta": 10_000.0}):
        other, _ = _forward(dataclasses.replace(config, **change), params, ref["input_ids"], ref["attention_mask"])
        assert np.abs(np.asarray(other)[real] - ref["last_hidden_state"][real]).max() > 1e-3, change


@pytest.mark.parametrize("length,half_window,packed", [(50, 6, False), (50, 6, True), (64, 8, True), (7, 2, False)])
def test_attention_by_blocks_equals_the_band_masked_attention_for_every_real_query(length, half_window, packed):
    rng = np.random.RandomState(length + half_window)
    q, k, v = (jnp.asarray(rng.standard_normal((2, length, 3, 8)), jnp.float32) for _ in range(3))
    keys_ok = np.ones((2, length), np.int32)
    keys_ok[1, length - length // 3:] = 0
    pack_ids = None
    if packed:
        cut = length // 2 - 3
        pack_ids = np.where(np.arange(length)[None] < cut, 1, 2) * keys_ok
    mask = attention.make_attention_mask(jnp.asarray(keys_ok), None if pack_ids is None else jnp.asarray(pack_ids))
    mask = mask & attention.band(length, half_window)
    want = attention.attention(q, k, v, mask, impl="einsum")
    got = attention.banded_attention(q, k, v, jnp.asarray(keys_ok), None if pack_ids is None else jnp.asarray(pack_ids),
                                      half_window)
    real = keys_ok.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6, rtol=0)


def test_an_export_writes_the_tensors_and_config_transformers_wrote(tmp_path, tiny):
    config, params, _ = modernbert_hf.load(tiny)
    modernbert_hf.save(str(tmp_path), config, params)
    # What transformers wrote: these names, shapes and dtypes (tensors.json); these values (the drawn ones).
    listed = modernbert_fixture.shapes()["model"]
    theirs = modernbert_fixture.encoder_tensors()
    ours = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(ours) == sorted(listed)
    for name in listed:
        assert list(ours[name].shape) == listed[name] and ours[name].dtype == np.float32, name
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    with open(os.path.join(FIXTURE, "config.json")) as f:
        their_config = json.load(f)
    with open(tmp_path / "config.json") as f:
        our_config = json.load(f)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "local_attention", "global_attn_every_n_layers", "layer_types", "rope_parameters", "norm_eps",
                "norm_bias", "attention_bias", "mlp_bias", "decoder_bias", "pad_token_id", "model_type"):
        assert our_config[key] == their_config[key], key
    assert modernbert.ModernBertConfig.from_hf_dict(our_config) == config


def test_the_4x_config_keys_read_as_the_5x_ones():
    with open(os.path.join(FIXTURE, "config.json")) as f:
        d = json.load(f)
    old = {k: v for k, v in d.items() if k not in ("rope_parameters", "layer_types")}
    old.update(global_rope_theta=160_000.0, local_rope_theta=10_000.0)
    assert modernbert.ModernBertConfig.from_hf_dict(old) == modernbert.ModernBertConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="layer_types"):
        modernbert.ModernBertConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 4})


def test_a_packed_row_computes_what_each_sequence_alone_computes(tiny):
    config, params, _ = modernbert_hf.load(tiny)
    rng = np.random.RandomState(3)
    a, b = rng.randint(3, 48, size=17), rng.randint(3, 48, size=21)
    packed = np.concatenate([a, b, [0, 0]])[None]
    pack_ids = np.array([[1] * 17 + [2] * 21 + [0, 0]])
    hidden, _ = _forward(config, params, packed, (pack_ids > 0).astype(np.int32), pack_ids=jnp.asarray(pack_ids))
    for seq, start in ((a, 0), (b, 17)):
        alone, _ = _forward(config, params, seq[None], np.ones((1, len(seq)), np.int32))
        np.testing.assert_allclose(np.asarray(hidden)[0, start:start + len(seq)], np.asarray(alone)[0], atol=2e-6)


def test_a_packed_rows_sequence_logits_are_each_sequence_alones(tiny):
    """`cls_positions` (packed rows, the fine-tuning loop's `config.packing`): the sequence head's logits
    of each packed sequence are those of the sequence alone; other kinds refuse them by name."""
    config, params, _ = modernbert_hf.load(tiny)
    tensors = {**modernbert_hf.to_hf(params, config), **modernbert_fixture.head_tensors("sequence")}
    del tensors["decoder.bias"]
    task_params = {"params": modernbert_hf.from_hf(tensors, config, kind="sequence")}
    model = modernbert.ModernBertForTask(config, "sequence", 3)
    rng = np.random.RandomState(4)
    a, b = rng.randint(3, 48, size=9), rng.randint(3, 48, size=14)
    packed = jnp.asarray(np.concatenate([a, b, [0, 0, 0]])[None])
    pack_ids = jnp.asarray([[1] * 9 + [2] * 14 + [0] * 3])
    got = model.apply(task_params, packed, (pack_ids > 0).astype(jnp.int32), pack_ids,
                      cls_positions=jnp.asarray([[0, 9]]))  # [1, slots, 3]
    for slot, seq in enumerate((a, b)):
        alone = model.apply(task_params, jnp.asarray(seq[None]), jnp.ones((1, len(seq)), jnp.int32))
        np.testing.assert_allclose(np.asarray(got)[0, slot], np.asarray(alone)[0], atol=2e-6)
    with pytest.raises(ValueError, match="cls_positions"):
        modernbert.ModernBertForTask(config, "token", 3).init(jax.random.key(0), packed, pack_ids > 0, pack_ids,
                                                              cls_positions=jnp.asarray([[0, 9]]))


def test_positions_restart_at_each_packed_sequence():
    # Rotary attention depends on position differences only, so restarting changes the scores by
    # rounding alone (the packed-row test cannot see it); restarting makes a packed sequence's angles
    # those of the sequence alone, bit for bit.
    pack_ids = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0]])
    got = modernbert.positions_of(pack_ids > 0, pack_ids)
    assert np.asarray(got).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    assert np.asarray(modernbert.positions_of(jnp.ones((1, 4), bool), None)).tolist() == [[0, 1, 2, 3]]


def test_masked_positions_gather_the_rows_the_full_logits_have(tiny):
    config, params, _ = modernbert_hf.load(tiny)
    ref = _reference()
    positions = np.array([[1, 5, 30], [2, 9, 20]])
    _, logits = _forward(config, params, ref["input_ids"], ref["attention_mask"], masked_positions=jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(logits), np.take_along_axis(ref["logits"], positions[..., None], 1), atol=1e-5)


def test_a_bad_shape_or_a_foreign_checkpoint_is_refused_by_name(tmp_path, tiny):
    with pytest.raises(ValueError, match="does not divide"):
        modernbert.ModernBertConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="odd"):
        modernbert.ModernBertConfig(hidden_size=36, num_attention_heads=4)
    config, params, _ = modernbert_hf.load(tiny)
    tensors = modernbert_hf.to_hf(params, config)
    del tensors["model.layers.2.mlp.Wo.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.Wo\.weight"):
        modernbert_hf.from_hf(tensors, config)
    with pytest.raises(FileNotFoundError, match="config.json"):
        modernbert_hf.load(str(tmp_path))


def test_initialization_draws_transformers_distributions():
    config = modernbert.ModernBertConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                         num_attention_heads=4, max_position_embeddings=64)
    ids = np.ones((1, 8), np.int32)
    params = modernbert.ModernBertForMaskedLM(config).init(jax.random.PRNGKey(0), ids, ids)["params"]
    wqkv = np.asarray(params["model"]["layers_1"]["attn"]["Wqkv"]["kernel"])
    wo = np.asarray(params["model"]["layers_1"]["mlp"]["Wo"]["kernel"])
    # A normal of std 0.02 cut at 2 std (transformers' `trunc_normal_`), "out" layers 0.02 / sqrt(2 L).
    assert np.abs(wqkv).max() <= 0.04 and 0.016 < wqkv.std() < 0.019
    out_std = 0.02 / np.sqrt(12)
    assert np.abs(wo).max() <= 2 * out_std + 1e-7 and 0.8 * out_std < wo.std() < 0.95 * out_std
    assert "attn_norm" not in params["model"]["layers_0"] and "attn_norm" in params["model"]["layers_1"]


def test_transformers_loads_our_export_and_predicts_the_same(tmp_path):
    """Live, where torch is installed: a fresh random model of ours, exported, run by transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = modernbert.ModernBertConfig(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=6, local_attention=10, max_position_embeddings=64,
                                         pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1,
                                         eos_token_id=2, initializer_range=0.2)
    ids = np.random.RandomState(5).randint(3, 80, size=(3, 33))
    mask = np.ones_like(ids)
    mask[2, 20:] = 0
    params = modernbert.ModernBertForMaskedLM(config).init(jax.random.PRNGKey(1), ids, mask)["params"]
    modernbert_hf.save(str(tmp_path), config, params)
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(model).__name__ == "ModernBertForMaskedLM"
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    _, ours = _forward(config, params, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(ours)[real], theirs[real], atol=1e-5, rtol=0)
    assert (np.asarray(ours).argmax(-1)[real] == theirs.argmax(-1)[real]).all()


HEAD_KINDS = [("sequence", 3, "cls"), ("sequence_mean", 3, "mean"), ("token", 5, "cls"), ("span", 2, "cls"),
              ("multiple_choice", 1, "cls")]


@pytest.mark.parametrize("name,num_outputs,pooling", HEAD_KINDS)
def test_each_task_head_equals_transformers(name, num_outputs, pooling, tiny):
    """transformers' four task models on the fixture's encoder, their heads drawn by the recipe."""
    config, params, _ = modernbert_hf.load(tiny)
    config = dataclasses.replace(config, classifier_pooling=pooling)
    kind = name.removesuffix("_mean")
    heads = np.load(os.path.join(FIXTURE, "heads.npz"))
    tensors = {**modernbert_hf.to_hf(params, config), **modernbert_fixture.head_tensors(name)}
    del tensors["decoder.bias"]
    task_params = modernbert_hf.from_hf(tensors, config, kind=kind)
    ref = _reference()
    ids, mask = ref["input_ids"], ref["attention_mask"]
    if kind == "multiple_choice":
        ids, mask = ids[None], mask[None]
    logits = modernbert.ModernBertForTask(config, kind, num_outputs).apply(
        {"params": task_params}, jnp.asarray(ids), jnp.asarray(mask))
    want = heads[f"{name}/logits"]
    real = ref["attention_mask"].astype(bool) if kind in ("token", "span") else np.ones(want.shape[:-1], bool)
    assert logits.shape == want.shape
    np.testing.assert_allclose(np.asarray(logits)[real], want[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,num_outputs", [("sequence", 3), ("sequence", 1), ("token", 4), ("span", 2),
                                              ("multiple_choice", 1)])
def test_transformers_loads_each_exported_task_model_as_its_class(tmp_path, kind, num_outputs, tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, params, _ = modernbert_hf.load(tiny)
    ref = _reference()
    ids, mask = ref["input_ids"], ref["attention_mask"]
    if kind == "multiple_choice":
        ids, mask = ids[None], mask[None]
    model = modernbert.ModernBertForTask(config, kind, num_outputs)
    task_params = model.init(jax.random.PRNGKey(2), jnp.asarray(ids), jnp.asarray(mask))["params"]
    task_params = {**task_params, "model": params["model"]}
    labels = [f"l{i}" for i in range(num_outputs)] if kind in ("sequence", "token") and num_outputs > 1 else []
    modernbert_hf.save(str(tmp_path), config, task_params, {"kind": kind, "num_outputs": num_outputs, "labels": labels})
    loaded_config, loaded, task = modernbert_hf.load(str(tmp_path))
    assert task == {"kind": kind, "num_outputs": num_outputs, "labels": labels}
    auto = {"sequence": transformers.AutoModelForSequenceClassification,
            "token": transformers.AutoModelForTokenClassification,
            "span": transformers.AutoModelForQuestionAnswering,
            "multiple_choice": transformers.AutoModelForMultipleChoice}[kind]
    theirs_model = auto.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(theirs_model).__name__ == modernbert.TASK_CLASSES[kind]
    with torch.no_grad():
        out = theirs_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    theirs = (torch.stack([out.start_logits, out.end_logits], -1) if kind == "span" else out.logits).numpy()
    ours = np.asarray(model.apply({"params": loaded}, jnp.asarray(ids), jnp.asarray(mask)))
    real = ref["attention_mask"].astype(bool) if kind in ("token", "span") else np.ones(theirs.shape[:-1], bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-5, rtol=0)
    assert (ours.argmax(-1)[real] == theirs.argmax(-1)[real]).all()
