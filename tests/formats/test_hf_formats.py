"""HuggingFace weight files as transformers and the Hub write them: sharded safetensors
(`model.safetensors.index.json`), bfloat16/float16 safetensors, damaged shards, `pytorch_model.bin`.

The weights are a tiny random transformers `FlaxBertForPreTraining`; the reference for the model's
outputs is transformers' Flax BERT on those same weights. transformers' Flax `save_pretrained`
shards only as msgpack (`flax_model-0000k-of-0000n.msgpack`), so the sharded safetensors are
written as its PyTorch `save_pretrained` writes them: huggingface_hub's
`split_state_dict_into_shards_factory` picks the shards and the names
(`model-00001-of-00005.safetensors`), and the index is `{"metadata": {"total_size"}, "weight_map"}`.
"""

import functools
import importlib.util
import json
import os
import pathlib
import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.model.pretraining_heads import BertForPreTraining

transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from tests.helpers import tiny_bert_inputs  # noqa: E402

V, H, NH, I, L, P = 40, 16, 4, 32, 2, 24
SHARD_BYTES = 6000  # the weights are ~24 KB in float32: 5 shards


@pytest.fixture(scope="module")
def hf_model():
    """transformers' `FlaxBertForPreTraining` (built without its init: shapes from `eval_shape`), random
    float32 weights for it (LayerNorms and biases random too), and those weights under transformers'
    PyTorch names."""
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                  intermediate_size=I, max_position_embeddings=P, hidden_act="gelu")
    model = transformers.FlaxBertForPreTraining(cfg, _do_init=False)
    shapes = jax.eval_shape(functools.partial(model.init_weights, input_shape=model.input_shape),
                            jax.random.PRNGKey(0))
    rng = np.random.default_rng(4)

    def draw(path, s):
        n = rng.standard_normal(s.shape)
        scale = {"scale": 0.1, "embedding": 0.5, "kernel": 1 / np.sqrt(s.shape[0])}.get(path[-1].key, 0.1)
        return ((1.0 if path[-1].key == "scale" else 0.0) + scale * n).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(draw, shapes)
    flat = {}  # Flax -> PyTorch names, typed out here (not bert_jax.formats.hf.flax_to_hf_names)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [k.key for k in path]
        leaf, name = keys[-1], ".".join(keys[:-1])
        if leaf == "kernel":
            flat[name + ".weight"] = np.ascontiguousarray(x.T)
        elif leaf in ("embedding", "scale"):
            flat[name + ".weight"] = x
        else:
            flat[name + "." + leaf] = x
    return model, params, flat


def write_single(directory, model, tensors):
    model.config.save_pretrained(directory)
    safetensors_numpy.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def write_sharded(directory, model, tensors, max_shard_size=SHARD_BYTES):
    """As transformers' PyTorch `save_pretrained(max_shard_size=...)`: shards + index; the split."""
    from huggingface_hub import constants, split_state_dict_into_shards_factory
    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: t.nbytes, max_shard_size=max_shard_size,
        filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN)
    model.config.save_pretrained(directory)
    for filename, names in split.filename_to_tensors.items():
        safetensors_numpy.save_file({n: tensors[n] for n in names}, os.path.join(directory, filename),
                                    metadata={"format": "pt"})
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps(index, indent=2))
    return str(directory), split


def safetensors_header(path):
    """The JSON header of a safetensors file (its first 8 bytes: the header's length, little-endian)."""
    data = pathlib.Path(path).read_bytes()
    return json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])


def inputs(seed=1):
    return tiny_bert_inputs.inputs(V, seed)


@functools.lru_cache(maxsize=None)
def _ours(config):
    return jax.jit(BertForPreTraining(config).apply)  # one compile for all the tests (same shapes)


@functools.lru_cache(maxsize=None)
def _theirs(model):
    return jax.jit(lambda params, ids, mask, seg: model(ids, attention_mask=mask, token_type_ids=seg,
                                                        params=params))


def assert_matches_transformers(pretrained, hf_params, model, atol=1e-5):
    """Our pretraining model on `pretrained` == transformers' FlaxBertForPreTraining on `hf_params`."""
    ids, mask, seg, positions = inputs()
    ours = _ours(pretrained.config)({"params": convert.model_params(pretrained)}, jnp.asarray(ids),
                                    jnp.asarray(mask), jnp.asarray(seg), jnp.asarray(positions))
    ref = _theirs(model)(hf_params, ids, mask, seg)
    np.testing.assert_allclose(ours.mlm_logits, np.take_along_axis(
        np.asarray(ref.prediction_logits), positions[..., None], axis=1), atol=atol)
    np.testing.assert_allclose(ours.nsp_logits, ref.seq_relationship_logits, atol=atol)


def assert_trees_equal(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (k, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype == np.float32 and x.shape == y.shape, jax.tree_util.keystr(k)
        assert np.array_equal(x, y), jax.tree_util.keystr(k)  # bit-exact


# ---------------------------------------------------------------------------------------------
# Sharded safetensors
# ---------------------------------------------------------------------------------------------


def test_sharded_safetensors_load_like_the_single_file_and_match_transformers(hf_model, tmp_path):
    model, params, flat = hf_model
    single = convert.load_pretrained(write_single(tmp_path / "single", model, flat))
    d, split = write_sharded(tmp_path / "sharded", model, flat)
    assert len(split.filename_to_tensors) >= 3 and "model-00001-of-" in sorted(split.filename_to_tensors)[0]
    assert not os.path.exists(os.path.join(d, "model.safetensors"))
    sharded = convert.load_pretrained(d)
    assert sharded.format == "hf" and sharded.missing == () and sharded.skipped == ()
    assert_trees_equal(sharded.params, single.params)
    assert_matches_transformers(sharded, params, model)


# ---------------------------------------------------------------------------------------------
# bfloat16 and float16
# ---------------------------------------------------------------------------------------------


def _rounded(tensors, dtype):
    return {k: v.astype(dtype) for k, v in tensors.items()}


def _hf_params_from(params, tensors):
    """transformers' Flax parameter tree (`params`'s structure) holding `tensors` (PyTorch names), float32."""
    def pick(path, _):
        keys = [k.key for k in path]
        leaf, name = keys[-1], ".".join(keys[:-1])
        value = np.asarray(tensors[name + (".weight" if leaf in ("kernel", "embedding", "scale") else "." + leaf)],
                           np.float32)
        return value.T if leaf == "kernel" else value

    return jax.tree_util.tree_map_with_path(pick, params)


@pytest.mark.parametrize("reader", ["numpy", "jax_fallback"])
def test_bfloat16_safetensors_read_as_exact_float32(hf_model, tmp_path, monkeypatch, reader):
    """bf16 weights read as float32 holding exactly the bf16 values (ml_dtypes' rounding of the
    originals), and the model on them matches transformers on the same rounded weights. Written
    with `safetensors.flax` (jnp.bfloat16 arrays, header dtype BF16). "jax_fallback": a safetensors
    whose numpy reader refuses BF16 (the installed one reads it as ml_dtypes.bfloat16), the case
    the loader's read-through-jax fallback is for."""
    from safetensors.flax import save_file
    model, params, flat = hf_model
    flat = dict(flat)
    # bfloat16's range, beyond float16's (its subnormals below 6e-5, its max 65504), as trained
    # weights have: a reader that went through float16 would lose these. Position 23 is never run.
    word, position = flat["bert.embeddings.word_embeddings.weight"].copy(), \
        flat["bert.embeddings.position_embeddings.weight"].copy()
    word[0, :4] = [3e-7, -1.1e-8, 2.5e-6, 1e-30]
    position[P - 1, :2] = [7e4, -1e9]
    flat.update({"bert.embeddings.word_embeddings.weight": word,
                 "bert.embeddings.position_embeddings.weight": position})
    bf16 = _rounded(flat, ml_dtypes.bfloat16)
    d = tmp_path / "bf16"
    model.config.save_pretrained(d)
    save_file({k: jnp.asarray(v) for k, v in bf16.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    assert {t["dtype"] for k, t in safetensors_header(d / "model.safetensors").items()
            if k != "__metadata__"} == {"BF16"}
    if reader == "jax_fallback":
        import safetensors
        real = safetensors.safe_open

        class NoNumpyBf16:
            def __init__(self, path, framework):
                self.f, self.np = real(path, framework=framework), framework == "np"

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *a):
                return self.f.__exit__(*a)

            def metadata(self):
                return self.f.metadata()

            def keys(self):
                return self.f.keys()

            def get_tensor(self, k):
                if self.np and self.f.get_slice(k).get_dtype() == "BF16":
                    raise TypeError("data type 'bfloat16' not understood")
                return self.f.get_tensor(k)

        monkeypatch.setattr(safetensors, "safe_open", NoNumpyBf16)
    p = convert.load_pretrained(str(d))
    assert p.missing == () and p.skipped == ()
    single = convert.load_pretrained(write_single(tmp_path / "f32", model, _rounded(bf16, np.float32)))
    assert_trees_equal(p.params, single.params)  # == the bf16 values, widened exactly
    got = p.params["bert"]["embeddings"]["word_embeddings"]
    assert np.array_equal(got, word.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(got, word)  # it was rounded
    assert 0 < abs(got[0, 1]) < 1.2e-8 and got[0, 3] != 0  # (float16 flushes these to 0)
    assert p.params["bert"]["embeddings"]["position_embeddings"][P - 1, 0] == np.float32(
        ml_dtypes.bfloat16(7e4))  # (float16: inf)
    assert_matches_transformers(p, _hf_params_from(params, bf16), model)


def test_mixed_precision_shards(hf_model, tmp_path):
    """One checkpoint with bf16, fp16 and fp32 tensors, sharded: each reads as float32 holding
    exactly its stored value."""
    model, params, flat = hf_model
    dtypes = (ml_dtypes.bfloat16, np.float16, np.float32)
    mixed = {k: v.astype(dtypes[i % 3]) for i, (k, v) in enumerate(sorted(flat.items()))}
    d, split = write_sharded(tmp_path / "mixed", model, mixed, max_shard_size=SHARD_BYTES // 2)
    assert len(split.filename_to_tensors) >= 3
    p = convert.load_pretrained(d)
    single = convert.load_pretrained(write_single(tmp_path / "f32", model, _rounded(mixed, np.float32)))
    assert_trees_equal(p.params, single.params)
    assert_matches_transformers(p, _hf_params_from(params, mixed), model)


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: each error names the file (and the tensor)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def sharded_dir(hf_model, tmp_path):
    model, _, flat = hf_model
    return write_sharded(tmp_path / "sharded", model, flat)


def test_index_naming_a_missing_shard(sharded_dir):
    d, split = sharded_dir
    last = sorted(split.filename_to_tensors)[-1]
    os.remove(os.path.join(d, last))
    with pytest.raises(FileNotFoundError, match=rf"model.safetensors.index.json.*{last}"):
        convert.load_pretrained(d)


@pytest.mark.parametrize("dropped", [("bert.encoder.layer.1.output.dense.bias",),  # the encoder
                                     ("cls.seq_relationship.weight", "cls.seq_relationship.bias")])  # a head
def test_shard_missing_a_tensor_the_index_promises(sharded_dir, dropped):
    """A whole head missing from its shard must not read as a checkpoint without that head."""
    d, split = sharded_dir
    shard = split.tensor_to_filename[dropped[0]]
    assert all(split.tensor_to_filename[n] == shard for n in dropped)
    path = os.path.join(d, shard)
    from safetensors.numpy import load_file
    kept = {k: v for k, v in load_file(path).items() if k not in dropped}
    safetensors_numpy.save_file(kept, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{shard}: .*{len(dropped)} tensor.*{dropped[0]}"):
        convert.load_pretrained(d)


def test_truncated_shard(sharded_dir):
    d, split = sharded_dir
    shard = sorted(split.filename_to_tensors)[1]
    path = pathlib.Path(d, shard)
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file"):
        convert.load_pretrained(d)


def test_index_without_weight_map(sharded_dir):
    d, _ = sharded_dir
    pathlib.Path(d, "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: no \"weight_map\""):
        convert.load_pretrained(d)


# ---------------------------------------------------------------------------------------------
# pytorch_model.bin
# ---------------------------------------------------------------------------------------------


class _Touch:
    """A pickle whose loading creates `path`: the visible trace of an unpickling."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def test_pytorch_bin_without_torch_is_a_clear_error_and_is_never_unpickled(hf_model, tmp_path):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: the .bin is read with torch.load(weights_only=True)")
    model, _, _ = hf_model
    d, marker = tmp_path / "pt", tmp_path / "unpickled"
    model.config.save_pretrained(d)
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Touch(marker)))
    pickle.loads((d / "pytorch_model.bin").read_bytes())  # the payload works: unpickling touches it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError, match=r"pt/pytorch_model.bin is a PyTorch pickle and torch is not "
                                         r"installed.*weights_only=True.*safe_serialization=True"):
        convert.load_pretrained(str(d))
    assert not marker.exists()


def test_pytorch_bin_read_with_torch(hf_model, tmp_path):
    """With torch installed (not in CI: skipped there): a `pytorch_model.bin` as torch.save writes
    it loads like the safetensors file, and a malicious pickle is refused by weights_only=True."""
    torch = pytest.importorskip("torch")
    model, params, flat = hf_model
    single = convert.load_pretrained(write_single(tmp_path / "single", model, flat))
    d = tmp_path / "pt"
    model.config.save_pretrained(d)
    torch.save({k: torch.from_numpy(v.copy()) for k, v in flat.items()}, str(d / "pytorch_model.bin"))
    p = convert.load_pretrained(str(d))
    assert_trees_equal(p.params, single.params)
    assert_matches_transformers(p, params, model)
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(pickle.UnpicklingError):  # weights_only=True refuses pathlib.Path.touch
        convert.load_pretrained(str(d))
    assert not marker.exists()
