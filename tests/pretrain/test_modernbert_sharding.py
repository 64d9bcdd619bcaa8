"""ModernBERT on a (data, fsdp, tensor) mesh (issue 72): its parameters' logical axis names
(bert_jax/model/modernbert_axes.py) and the shardings they give, and the pretraining and fine-tuning train
steps (as `pretrain.loop` and `finetune.preparation` build them) on data=2, fsdp=2, tensor=2 of the 8 fake
CPU devices (tests/conftest.py) against the same steps on one device: the same loss and the same updated
parameters, with the parameters and the optimizer state really split."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bert_jax.finetune import heads, modernbert_tasks, steps as finetune_steps
from bert_jax.model import modernbert, modernbert_axes
from bert_jax.pretrain import loop, steps
from bert_jax.training import optim, run_setup, sharding, train_state
from configs import modernbert_tiny

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
ROWS, LENGTH, PREDS = 8, 16, 4


def tiny_config():
    """configs/modernbert_tiny.py smaller: H 32, 4 heads, GeGLU 2 x 48, vocabulary 128; layer 0 global,
    layer 1 local with a 2-token half-window (rows of 16 run by blocks)."""
    config = modernbert_tiny.get_config()
    m = config.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_attention_heads = 128, 32, 48, 4
    m.local_attention, m.max_position_embeddings, m.dtype = 4, 32, "float32"
    config.learning_rate, config.warmup_steps = 1e-3, 0  # the first step at the peak rate
    return config


def one_device_mesh():
    return sharding.create_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])


def at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---------------------------------------------------------------------------------------------
# The names and the shardings they give
# ---------------------------------------------------------------------------------------------


def test_every_parameter_has_names_and_they_shard_per_the_golden_table():
    """Every parameter of the MLM model and of each task model (biases on) is named; on fsdp=2,
    tensor=4 the specs are BERT's for the same roles, the fused kernels split over fsdp only."""
    cfg = modernbert.ModernBertConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32, attention_bias=True,
                                      mlp_bias=True, norm_bias=True, classifier_bias=True)
    ids = jnp.ones((1, 8), jnp.int32)
    mesh = sharding.create_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    mlm = jax.eval_shape(lambda: modernbert_axes.with_logical_axes(
        modernbert.ModernBertForMaskedLM(cfg).init(jax.random.key(0), ids, ids)["params"]))
    specs = jax.tree_util.tree_map(lambda s: s.spec, sharding.logical_to_sharding(mlm, mesh))
    golden = {
        ("model", "tok_embeddings", "embedding"): P("tensor", "fsdp"),
        ("model", "embedding_norm", "scale"): P("fsdp"),
        ("model", "layers_1", "attn_norm", "bias"): P("fsdp"),
        ("model", "layers_1", "attn", "Wqkv", "kernel"): P("fsdp", None),
        ("model", "layers_1", "attn", "Wqkv", "bias"): P(None),
        ("model", "layers_1", "attn", "Wo", "kernel"): P("tensor", "fsdp"),
        ("model", "layers_1", "attn", "Wo", "bias"): P("fsdp"),
        ("model", "layers_1", "mlp", "Wi", "kernel"): P("fsdp", None),
        ("model", "layers_1", "mlp", "Wo", "kernel"): P("tensor", "fsdp"),
        ("model", "final_norm", "scale"): P("fsdp"),
        ("head", "dense", "kernel"): P("fsdp", "tensor"),
        ("head", "norm", "scale"): P("fsdp"),
        ("decoder_bias",): P("tensor"),
    }
    for path, spec in golden.items():
        assert at(specs, path) == spec, path
    for kind in modernbert.TASK_CLASSES:
        inputs = jnp.ones((1, 2, 8), jnp.int32) if kind == "multiple_choice" else ids
        task = jax.eval_shape(lambda: modernbert_axes.with_logical_axes(
            modernbert.ModernBertForTask(cfg, kind, 3).init(jax.random.key(0), inputs, inputs)["params"]))
        task_specs = jax.tree_util.tree_map(lambda s: s.spec, sharding.logical_to_sharding(task, mesh))
        assert at(task_specs, ("classifier", "kernel")) == P("fsdp", None), kind
        assert at(task_specs, ("model", "layers_0", "mlp", "Wi", "kernel")) == P("fsdp", None), kind
    with pytest.raises(ValueError, match="model/layers_0/attn/Wk/kernel has no logical axis names"):
        modernbert_axes.axes_of(("model", "layers_0", "attn", "Wk", "kernel"))
    with pytest.raises(ValueError, match=r"head/dense/kernel has shape \(32, 32, 1\)"):
        modernbert_axes.with_logical_axes({"head": {"dense": {"kernel": jnp.zeros((32, 32, 1))}}})


# ---------------------------------------------------------------------------------------------
# Pretraining
# ---------------------------------------------------------------------------------------------


def pretraining_batch() -> dict:
    """8 rows of 16 tokens: rows 0-3 pack two sequences (9 + 5 tokens, then padding), rows 4-7 one of 16."""
    rng = np.random.RandomState(0)
    pack = np.ones((ROWS, LENGTH), np.int32)
    pack[:4, 9:14], pack[:4, 14:] = 2, 0
    ids = rng.randint(5, 128, size=(ROWS, LENGTH)).astype(np.int32) * (pack > 0)
    positions = np.where(pack == 2, np.arange(LENGTH) - 9, np.arange(LENGTH)) * (pack > 0)
    masked = np.stack([np.sort(rng.choice(13, PREDS, replace=False)) + 1 for _ in range(ROWS)]).astype(np.int32)
    labels = np.take_along_axis(ids, masked, 1)
    weights = np.ones((ROWS, PREDS), np.float32)
    weights[:, -1] = 0.0
    return {"input_ids": ids, "input_mask": (pack > 0).astype(np.int32), "segment_ids": np.zeros_like(ids),
            "pack_ids": pack, "position_ids": positions.astype(np.int32), "masked_lm_positions": masked,
            "masked_lm_ids": labels, "masked_lm_weights": weights,
            "next_sentence_labels": np.zeros((ROWS, 1), np.int32)}


def pretraining_step(mesh):
    """One step of the loop's model, optimizer and sharded init (`loop.build`, `sharding.sharded_init`) on `mesh`:
    (state before, state after, metrics)."""
    config = tiny_config()
    model_config = run_setup.model_config_from(config)
    model, tx, schedule, init_state = loop.build(config, model_config, mesh)
    state, shardings = sharding.sharded_init(init_state, jax.random.key(0), mesh)
    step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule, use_nsp=False,
                                     mesh=mesh),
                   in_shardings=(shardings, sharding.batch_sharding(mesh)), out_shardings=(shardings, None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        new_state, metrics = step(state, sharding.to_global(pretraining_batch(), mesh))
    return state, new_state, metrics


@pytest.fixture(scope="module")
def pretrained():
    return {"one": pretraining_step(one_device_mesh()), "mesh": pretraining_step(sharding.create_mesh(MESH))}


def test_pretraining_step_on_the_mesh_equals_the_one_device_step(pretrained):
    (before1, after1, metrics1), (_, after8, metrics8) = pretrained["one"], pretrained["mesh"]
    np.testing.assert_allclose(float(metrics8["loss"]), float(metrics1["loss"]), rtol=1e-6)
    assert float(metrics1["loss"]) > 1.0  # a real cross-entropy over 128 ids, not a zero
    want_before, want, got = flat(before1.params), flat(after1.params), flat(after8.params)
    assert set(got) == set(want)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], atol=1e-5, rtol=0, err_msg=path)
    # The step moved every parameter (else equality would say little): by about the learning rate.
    moved = [np.abs(want[p] - want_before[p]).max() for p in want]
    assert min(moved) > 1e-4, min(moved)


def test_pretraining_parameters_and_optimizer_state_are_split_over_the_mesh(pretrained):
    _, state, _ = pretrained["mesh"]
    emb = state.params["model"]["tok_embeddings"]["embedding"]  # [128, 32]
    assert emb.sharding.spec == P("tensor", "fsdp") and emb.addressable_shards[0].data.shape == (64, 16)
    wo = state.params["model"]["layers_1"]["mlp"]["Wo"]["kernel"]  # [48, 32]
    assert wo.sharding.spec == P("tensor", "fsdp") and wo.addressable_shards[0].data.shape == (24, 16)
    wi = state.params["model"]["layers_1"]["mlp"]["Wi"]["kernel"]  # [32, 96]: fsdp only (modernbert_axes)
    assert wi.sharding.spec == P("fsdp", None) and wi.addressable_shards[0].data.shape == (16, 96)
    # Adam's moments follow their parameters.
    mu = [s for s in jax.tree_util.tree_leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
          if hasattr(s, "mu")][0].mu
    moment = mu["model"]["tok_embeddings"]["embedding"]
    assert moment.sharding.spec == P("tensor", "fsdp") and moment.addressable_shards[0].data.shape == (64, 16)


# ---------------------------------------------------------------------------------------------
# Fine-tuning
# ---------------------------------------------------------------------------------------------


def finetuning_step(mesh):
    """One classification step of `modernbert_tasks.TaskModel` on `mesh`, its state initialized and its
    shardings derived as `finetune.preparation` does (`modernbert_tasks.init_params`)."""
    model_config = run_setup.model_config_from(tiny_config())
    model = modernbert_tasks.TaskModel(model_config, "classification", 3)
    tx = optim.make_optimizer("adamw", lambda step: 1e-3, weight_decay=0.01, clip_norm=1.0)
    dummy = heads.dummy_batch("classification", LENGTH)

    def init_state(rng):
        params = modernbert_tasks.init_params(model, rng, *(dummy[k] for k in heads.MODEL_INPUTS))
        return train_state.create_train_state(params, tx, jax.random.key(1))

    abstract = jax.eval_shape(init_state, jax.random.key(0))
    shardings = sharding.logical_to_sharding(abstract, mesh)
    rng = np.random.RandomState(1)
    lengths = rng.randint(6, LENGTH + 1, size=ROWS)
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
    batch = {"input_ids": rng.randint(5, 128, size=(ROWS, LENGTH)).astype(np.int32) * mask, "input_mask": mask,
             "segment_ids": np.zeros_like(mask), "label": rng.randint(0, 3, size=ROWS).astype(np.int32),
             "weight": np.ones(ROWS, np.float32)}
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        state = jax.jit(lambda r: nn.meta.unbox(init_state(r)), out_shardings=shardings)(jax.random.key(0))
        step = jax.jit(functools.partial(finetune_steps.train_step, model=model, tx=tx, schedule=lambda s: 1e-3),
                       in_shardings=(shardings, sharding.batch_sharding(mesh)), out_shardings=(shardings, None))
        new_state, metrics = step(state, sharding.to_global(batch, mesh))
    return new_state, metrics


def test_finetuning_step_on_the_mesh_equals_the_one_device_step_with_split_parameters():
    state1, metrics1 = finetuning_step(one_device_mesh())
    state8, metrics8 = finetuning_step(sharding.create_mesh(MESH))
    np.testing.assert_allclose(float(metrics8["loss"]), float(metrics1["loss"]), rtol=1e-6)
    want, got = flat(state1.params), flat(state8.params)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], atol=1e-5, rtol=0, err_msg=path)
    wo = state8.params["model"]["layers_0"]["attn"]["Wo"]["kernel"]  # [32, 32]: heads over tensor
    assert wo.sharding.spec == P("tensor", "fsdp") and wo.addressable_shards[0].data.shape == (16, 16)
    dense = state8.params["head"]["dense"]["kernel"]
    assert dense.sharding.spec == P("fsdp", "tensor") and dense.addressable_shards[0].data.shape == (16, 16)
