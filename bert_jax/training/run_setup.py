"""What a pretraining, fine-tuning, evaluation or prediction run sets up the same way, from its config.

- the model's config (`model_config_from`, by `config.model_family`): BERT's (`bert_config_from`:
  `config.model`, or an init checkpoint's with the run's own settings over it: `RUN_KEYS`,
  `SETTING_KEYS`; `ARCHITECTURE_KEYS` are the checkpoint's) or ModernBERT's (`modernbert_config_from`,
  `modernbert_cpu_bf16` for a checkpoint's), `model.mixed_matmuls` as `config.cpu_bf16` decides for both;
- jax's random-bit generator (`use_prng_impl`, `config.prng_impl`);
- a checkpoint's parameters, sharded onto the mesh (`load_params`, `init_from_checkpoint`: any
  format `bert_jax.convert` reads, or a bert_jax workdir's train state);
- the run's settings for TensorBoard (`hparams`) and the devices' peak FLOP/s for MFU.

The loops (`bert_jax.pretrain.loop`, `bert_jax.finetune.loop`), predict and the demo call these;
nothing here reads data. This module must not import tensorflow.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional

import flax.linen as nn
import jax
import ml_collections

from bert_jax import layout
from bert_jax.checkpoints import saved_state
from bert_jax.model import modeling
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modernbert import ModernBertConfig
from bert_jax.model.pretraining_heads import BertForPreTraining
from bert_jax.training import chips, cpu_bf16, sharding
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

# With an init checkpoint, which `config.model` keys apply (`bert_config_from`). Every field of
# BertConfig is in exactly one group (tests/pretrain/test_pretrain_config.py).
# How this run computes; no checkpoint decides it (Google's and HF's configs do not name it):
RUN_KEYS = ("dtype", "param_dtype", "scan_layers", "remat_policy", "attention_impl", "vocab_pad_multiple",
            "sparse_last_layer", "fp8", "fused_ops", "fused_ffn", "mixed_matmuls", "separate_qkv",
            "fused_qkv")


# The checkpoint's value, unless `--config.model.<key>` is given (then that):
SETTING_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "causal_attention", "initializer_range")


# What the checkpoint's weights are: its value; a different one given is refused:
ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps")


def bert_config_from(config: ml_collections.ConfigDict, given: Optional[Iterable[str]] = None,
                     workdir: Optional[str] = None) -> BertConfig:
    """The model config: `config.model`, or with an init checkpoint (any format: a bert_jax
    directory, Google TF1, HuggingFace) the checkpoint's config with `config.model`'s RUN_KEYS and
    the SETTING_KEYS `given` (dotted, `config.model.hidden_dropout_prob`; default: those on this
    process's command line). An ARCHITECTURE_KEYS value given that differs from the checkpoint's
    raises ValueError naming the key. `model.mixed_matmuls` as `config.cpu_bf16` decides on this
    backend (`bert_jax.training.cpu_bf16`; a training run passes its `workdir`, where "auto"'s
    decision is recorded for its resumption)."""
    init = config.get("init_checkpoint", "")
    model = cpu_bf16.resolve(config.model.to_dict(), config.get("cpu_bf16", "auto"), workdir)
    if not init:
        return BertConfig.from_dict(model)
    from bert_jax import convert
    from bert_jax.config_overrides import given_on_command_line
    given = {k[len("config.model."):] for k in (given_on_command_line() if given is None else given)
             if k.startswith("config.model.")}
    checkpoint = convert.load_config(init, google_gelu=config.get("google_gelu"))
    for key in sorted(given & set(ARCHITECTURE_KEYS)):
        if model[key] != getattr(checkpoint, key):
            hint = " (Google's \"gelu\": set config.google_gelu)" if key == "hidden_act" else ""
            raise ValueError(
                f"--config.model.{key}={model[key]!r}: the init checkpoint {init} has {key}="
                f"{getattr(checkpoint, key)!r}, and its weights are of that architecture{hint}; drop the flag, "
                f"or pretrain from scratch without config.init_checkpoint")
    changes = {k: model[k] for k in RUN_KEYS if k in model}
    changes.update({k: model[k] for k in SETTING_KEYS if k in given})
    return checkpoint.replace(**changes)


MODEL_FAMILIES = ("bert", "modernbert")


def model_config_from(config: ml_collections.ConfigDict, given: Optional[Iterable[str]] = None,
                      workdir: Optional[str] = None):
    """`config.model` as the model of `config.model_family` takes it: a `BertConfig`
    (`bert_config_from`) or a `ModernBertConfig` (`modernbert_config_from`)."""
    family = config.get("model_family", "bert")
    if family not in MODEL_FAMILIES:
        raise ValueError(f"config.model_family={family!r}: one of {MODEL_FAMILIES}")
    if family == "modernbert":
        return modernbert_config_from(config, workdir)
    return bert_config_from(config, given, workdir)


def modernbert_config_from(config: ml_collections.ConfigDict, workdir: Optional[str] = None) -> ModernBertConfig:
    """`config.model` (ModernBertConfig's fields, transformers' names) as a `ModernBertConfig`, with
    `mixed_matmuls` as `config.cpu_bf16` decides on this backend (as BERT's, `bert_config_from`; a
    training run passes its `workdir`, where "auto"'s decision is recorded for its resumption).

    A key ModernBERT has no field for (BERT's `fp8`, `scan_layers`, ...) is refused naming it."""
    model = config.model.to_dict()
    unknown = sorted(set(model) - {f.name for f in dataclasses.fields(ModernBertConfig)})
    if unknown:
        raise ValueError(f"config.model.{unknown[0]} (of {unknown}): not a field of ModernBertConfig "
                         f"(config.model_family='modernbert'; BERT-only options do not apply)")
    return ModernBertConfig(**cpu_bf16.resolve(model, config.get("cpu_bf16", "auto"), workdir))


def modernbert_cpu_bf16(config: ml_collections.ConfigDict, model_config: ModernBertConfig,
                        workdir: Optional[str] = None) -> ModernBertConfig:
    """A ModernBERT checkpoint's config (fine-tuning's init checkpoint, a fine-tuned model to predict
    with, a checkpoint to evaluate) with `mixed_matmuls` as `config.cpu_bf16` decides on this backend from
    `config.model.mixed_matmuls` (default False): how this run computes, whatever the checkpoint's run did."""
    model = dict(dataclasses.asdict(model_config), mixed_matmuls=bool(config.model.get("mixed_matmuls", False)))
    chosen = cpu_bf16.resolve(model, config.get("cpu_bf16", "auto"), workdir)["mixed_matmuls"]
    return dataclasses.replace(model_config, mixed_matmuls=chosen)


PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def use_prng_impl(config: ml_collections.ConfigDict) -> None:
    """jax's random-bit generator per `config.prng_impl` (dropout's masks), before any key is made."""
    impl = config.get("prng_impl", "threefry2x32")
    if impl not in PRNG_IMPLS:
        raise ValueError(f"config.prng_impl must be one of {PRNG_IMPLS}, got {impl!r}")
    jax.config.update("jax_default_prng_impl", impl)


def peak_flops_per_device() -> Optional[float]:
    """Peak dense bf16 FLOP/s of this process's devices, for MFU (the chip table: `training.chips`)."""
    return chips.peak_flops(jax.devices()[0].device_kind)


def hparams(config: ml_collections.ConfigDict, bert_config: BertConfig) -> dict:
    """The run's scalar settings for TensorBoard, `model.*` as the model really is (an init
    checkpoint's config.json replaces `config.model`'s sizes)."""
    flat = {k: v for k, v in flatten_dict(config.to_dict()).items() if not k.startswith("model.")}
    flat.update(flatten_dict({"model": dataclasses.asdict(bert_config)}))
    return {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool))}


def init_from_checkpoint(path: str, bert_config: BertConfig, fresh_params: dict, shardings: dict,
                         *, require_heads: bool = False, google_gelu: Optional[str] = None) -> dict:
    """`fresh_params` with every part `path` (any format) has replaced by its weights, on `shardings`.

    Heads the checkpoint lacks keep their fresh initialization (logged), unless `require_heads`.
    """
    from bert_jax import convert
    from bert_jax.formats.common import TASK_HEAD
    pretrained = convert.load_pretrained(path, google_gelu=google_gelu)
    if pretrained.missing:
        if require_heads:
            raise ValueError(f"config.init_checkpoint={path} has no {' and no '.join(pretrained.missing)} "
                             f"head: the pretraining objectives need them")
        logging.info("init_checkpoint has no %s head(s): they start from a fresh initialization",
                     ", ".join(pretrained.missing))
    loaded = convert.model_params(pretrained, bert_config)
    if loaded.pop(TASK_HEAD, None) is not None:  # a fine-tuned model: its task head has no place here
        logging.info("init_checkpoint is a fine-tuned model: its %s head is not used", pretrained.task_head)
    placed = sharding.place(loaded, {k: shardings[k] for k in loaded})
    return {**fresh_params, **placed}


def load_params(config, bert_config: BertConfig, mesh):
    """Parameters of `config.init_checkpoint`, sharded onto `mesh`: a bert_jax workdir's newest
    train state (only its parameters are read, shard by shard), or any checkpoint `bert_jax.convert`
    reads.

    A workdir restores whatever optimizer, clipping, number of hosts or layer layout
    (`scan_layers`) trained it: the optimizer state and the per-host input state are not read, and
    scanned layers are unstacked (or unrolled ones stacked) to this config's layout.
    """
    path = config.init_checkpoint
    model = BertForPreTraining(bert_config)

    def abstract_params(cfg):
        abstract = jax.eval_shape(lambda: model.clone(config=cfg).init(
            jax.random.key(0), **modeling.dummy_inputs(cfg))["params"])
        return abstract, sharding.logical_to_sharding(abstract, mesh)

    abstract, shardings = abstract_params(bert_config)
    from bert_jax import convert
    has_checkpoints = storage.isdir(storage_paths.join(path, layout.CHECKPOINTS))
    train_state_dir = has_checkpoints or (
        convert.detect_format(path) == "bert_jax"
        and not storage.isdir(storage_paths.join(path, layout.EXPORTED_PARAMS)))
    if not train_state_dir:  # an export, a Google or a HuggingFace checkpoint
        return init_from_checkpoint(path, bert_config, {}, shardings, require_heads=True,
                                    google_gelu=config.get("google_gelu")), shardings
    ckpt_dir = storage_paths.join(path, layout.CHECKPOINTS) if has_checkpoints else path
    try:
        saved_scanned = any("/encoder/layers/" in key for key in saved_state.saved_keys(ckpt_dir))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"config.init_checkpoint={path}: {e}") from None
    saved_config = dataclasses.replace(bert_config, scan_layers=saved_scanned)
    saved_abstract, saved_shardings = (abstract, shardings) if saved_scanned == bert_config.scan_layers \
        else abstract_params(saved_config)
    target = sharding.abstract_with_shardings(nn.meta.unbox(saved_abstract), saved_shardings)
    part, step = saved_state.restore_part(ckpt_dir, {"params": target})
    params = part["params"]
    logging.info("init_checkpoint: parameters of step %d of %s", step, ckpt_dir)
    if saved_scanned != bert_config.scan_layers:
        logging.info("init_checkpoint: %s its layers to config.model.scan_layers=%s",
                     "unstacking" if saved_scanned else "stacking", bert_config.scan_layers)
        params = (modeling.unstack_layers(params) if saved_scanned
                  else modeling.stack_layers(params, bert_config.num_hidden_layers))
        params = sharding.place(params, nn.meta.unbox(shardings))
    return params, shardings


def flatten_dict(d: dict, prefix: str = "") -> dict:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (config dicts: TensorBoard's hparams, host comparisons)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
