"""What pretraining does per `config.model_family`: the model, its init inputs, its FLOPs, what it refuses.

The loop (`loop.py`), the steps (`steps.py`) and the input (`feed.py`) are the same for both
families; this module holds the few places where they differ:

- "bert": `BertForPreTraining` (masked LM + next sentence), its FLOPs (`steps.train_flops_per_sequence`);
- "modernbert": `bert_jax.model.modernbert.ModernBertForMaskedLM` behind `ModernBertPreTraining`, which
  takes the pretraining batch's names (`input_ids`, `input_mask`, `masked_lm_positions`, and from
  packed rows `pack_ids` and `position_ids`; `segment_ids` and `cls_positions` are not read: no token
  types, no NSP) and returns a `PreTrainingOutput` without NSP logits, so the train and eval steps'
  masked-LM loss and sums are BERT's code (`steps.pretraining_sums`; the NSP sums are 0). Its `init`
  boxes the parameters with their logical axis names (`bert_jax.model.modernbert_axes`), so
  `config.mesh`'s fsdp and tensor sizes split them and the optimizer state as they split BERT's.

ModernBERT refuses, before anything compiles, what it has no part for: `config.use_nsp=True` and
`config.objective="ltr"`. BERT-only model options are not ModernBertConfig fields and are refused by
`run_setup.modernbert_config_from`.

A ModernBERT `config.init_checkpoint` (continued pretraining, `init_params`; `mode=evaluate`,
`checkpoint_eval.py`) is a ModernBERT pretraining workdir (its newest intact checkpoint's
parameters: `formats.modernbert_hf.load_workdir`) or a transformers ModernBERT folder
(`ModernBertForMaskedLM`'s `config.json` + `model.safetensors`: `formats.modernbert_hf.load`).
Continued pretraining refuses a checkpoint whose architecture differs from `config.model`'s, naming
the key. This module must not import tensorflow.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import ml_collections

from bert_jax.model import modeling, modernbert_axes
from bert_jax.model.modernbert import ModernBertConfig, ModernBertForMaskedLM
from bert_jax.model.pretraining_heads import BertForPreTraining, PreTrainingOutput
from bert_jax.pretrain import steps


def is_modernbert(model_config) -> bool:
    return isinstance(model_config, ModernBertConfig)


def check(config: ml_collections.ConfigDict, model_config) -> None:
    """Refuses, naming the key, what `config.model_family="modernbert"` pretraining cannot do."""
    if not is_modernbert(model_config):
        return
    where = "config.model_family='modernbert'"
    if config.use_nsp:
        raise ValueError(f"config.use_nsp=True: ModernBERT pretrains with masked LM only ({where} has no "
                         "next-sentence head); set config.use_nsp=False")
    if config.objective != "mlm":
        raise ValueError(f"config.objective={config.objective!r}: {where} pretrains with 'mlm' only")


def check_special_token_ids(model_config, special_ids: Optional[dict], where: str) -> None:
    """Raises naming `config.model.<role>_token_id` when a ModernBERT's [PAD]/[CLS]/[SEP] ids are not those of
    the run's vocabulary (`where`: its key): the export's config.json tells transformers these ids."""
    if not is_modernbert(model_config) or not special_ids:
        return
    for role in ("pad", "cls", "sep"):
        want, have = special_ids.get(f"{role}_id"), getattr(model_config, f"{role}_token_id")
        if want is not None and want >= 0 and have != want:
            raise ValueError(f"config.model.{role}_token_id={have}, but the {role} token of {where} has id {want}: set "
                             f"config.model.{role}_token_id={want} (the exported config.json gives transformers "
                             "these ids)")


# What a run may set apart from its ModernBERT init checkpoint: our own fields, regularization, the
# initialization (unused: the weights are the checkpoint's), the special-token ids and the classifier's
# settings (no weights of the masked-LM model).
NOT_ARCHITECTURE = ("dtype", "attention_impl", "local_blocks", "mixed_matmuls", "attention_dropout",
                    "embedding_dropout", "mlp_dropout", "initializer_range", "initializer_cutoff_factor",
                    "pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id",
                    "classifier_pooling", "classifier_dropout", "classifier_bias", "classifier_activation")


def load_modernbert(path: str) -> tuple[ModernBertConfig, dict, str]:
    """(config, params as float32 numpy, what was read) of `path`: a ModernBERT pretraining workdir or a
    transformers ModernBERT (masked-LM) folder; a fine-tuned one is refused naming `path`."""
    from bert_jax import layout
    from bert_jax.formats import modernbert_hf
    from data_pipeline import storage
    from data_pipeline.storage import paths as storage_paths
    if storage.exists(storage_paths.join(path, layout.TASK_FILE)):
        raise ValueError(f"config.init_checkpoint={path} is a ModernBERT fine-tuning workdir ({layout.TASK_FILE}): "
                         "pretraining and mode=evaluate read a masked-LM model (a pretraining workdir, or a "
                         "transformers ModernBertForMaskedLM folder)")
    if modernbert_hf.is_workdir(path):
        model_config, params, step = modernbert_hf.load_workdir(path)
        return model_config, params, f"step {step} of {path}"
    model_config, params, task = modernbert_hf.load(path)
    if task is not None:
        raise ValueError(f"config.init_checkpoint={path} is a fine-tuned ModernBERT (a {task['kind']} head): "
                         "pretraining and mode=evaluate read a masked-LM model (ModernBertForMaskedLM)")
    return model_config, params, path


def check_same_architecture(model_config: ModernBertConfig, checkpoint: ModernBertConfig, path: str) -> None:
    """Raises naming `config.model.<key>` when the run's model differs from the checkpoint's in its weights'
    architecture (every field but `NOT_ARCHITECTURE`)."""
    for field in dataclasses.fields(ModernBertConfig):
        mine, theirs = getattr(model_config, field.name), getattr(checkpoint, field.name)
        if field.name not in NOT_ARCHITECTURE and mine != theirs:
            raise ValueError(f"config.model.{field.name}={mine!r}, but the init checkpoint {path} has "
                             f"{field.name}={theirs!r}: set config.model to the checkpoint's architecture "
                             "(its config.json), or pretrain from scratch without config.init_checkpoint")


def init_params(config: ml_collections.ConfigDict, model_config, fresh_params: dict, shardings: dict,
                google_gelu: Optional[str] = None) -> dict:
    """Continued pretraining: the parameters `config.init_checkpoint` gives the run, on `shardings`
    (BERT: `run_setup.init_from_checkpoint`, heads it lacks kept fresh; ModernBERT: every parameter the
    checkpoint's, its architecture `config.model`'s)."""
    from bert_jax.training import run_setup, sharding
    path = config.init_checkpoint
    if not is_modernbert(model_config):
        return run_setup.init_from_checkpoint(path, model_config, fresh_params, shardings, google_gelu=google_gelu)
    checkpoint, params, _ = load_modernbert(path)
    check_same_architecture(model_config, checkpoint, path)
    return sharding.place(params, shardings)


class ModernBertPreTraining:
    """`ModernBertForMaskedLM` with the pretraining step's calling convention (`init`, `apply` with the
    batch's names); its parameters are exactly `ModernBertForMaskedLM`'s (`formats.modernbert_hf`), boxed
    with their logical axis names by `init`."""

    def __init__(self, config: ModernBertConfig):
        self.config = config
        self.module = ModernBertForMaskedLM(config)

    def _call(self, method, variables_or_rngs, input_ids, input_mask, masked_lm_positions,
              pack_ids=None, position_ids=None, deterministic: bool = True, **kwargs):
        kwargs.pop("segment_ids", None)  # no token types
        kwargs.pop("cls_positions", None)  # no NSP
        return method(variables_or_rngs, input_ids, input_mask, pack_ids, position_ids, masked_lm_positions,
                      deterministic, **kwargs)

    def init(self, rngs, **batch):
        """`ModernBertForMaskedLM`'s variables, its parameters boxed with their logical axis names
        (`modernbert_axes`: `sharding.sharded_init` splits them over fsdp and tensor as BERT's)."""
        variables = self._call(self.module.init, rngs, **batch)
        return {**variables, "params": modernbert_axes.with_logical_axes(variables["params"])}

    def apply(self, variables, **batch) -> PreTrainingOutput:
        hidden, logits = self._call(self.module.apply, variables, **batch)
        del hidden
        return PreTrainingOutput(mlm_logits=logits, nsp_logits=None, masked_output=None, pooled_output=None)


def pretraining_model(model_config):
    """The model the train step applies: `BertForPreTraining` or `ModernBertPreTraining`."""
    if is_modernbert(model_config):
        return ModernBertPreTraining(model_config)
    return BertForPreTraining(model_config)


def eval_model(model_config):
    """The model evaluation applies (BERT's without FP8: evaluation runs in the compute dtype)."""
    if is_modernbert(model_config):
        return ModernBertPreTraining(model_config)
    return BertForPreTraining(model_config.replace(fp8=False))


def dummy_inputs(model_config) -> dict:
    """Small inputs for `init` / `eval_shape`."""
    if is_modernbert(model_config):
        ids = jnp.zeros((1, 8), jnp.int32)
        return dict(input_ids=ids, input_mask=jnp.ones_like(ids), masked_lm_positions=jnp.zeros((1, 2), jnp.int32))
    return modeling.dummy_inputs(model_config)


def train_flops_per_sequence(model_config, seq_len: int, num_predictions: int) -> float:
    """Matmul FLOPs of one training step per sequence (forward + backward = 3x forward), for MFU."""
    if is_modernbert(model_config):
        return modernbert_train_flops_per_sequence(model_config, seq_len, num_predictions)
    return steps.train_flops_per_sequence(model_config, seq_len, num_predictions)


def modernbert_train_flops_per_sequence(config: ModernBertConfig, seq_len: int, num_predictions: int,
                                        window_keys: Optional[int] = None) -> float:
    """ModernBERT's model count, per token and layer: Wqkv 3·H², Wo H², the GeGLU MLP's Wi 2·H·I and
    Wo I·H (2 FLOPs each multiply-add); attention scores and context 2·K·H with K keys a query: all
    `seq_len` in global layers, the band's `min(seq_len, 2·(local_attention // 2) + 1)` in local ones
    (`window_keys` overrides it: e.g. `local_blocks`' ~3·local_attention/2 keys it executes). The MLM
    head at `num_predictions` positions: dense H², decoder H·V. Times 3 for forward + backward.
    ModernBERT-base at T=1024 with 307 predictions: ~0.84 TFLOP."""
    h, i, t, v = config.hidden_size, config.intermediate_size, seq_len, config.vocab_size
    band = min(t, 2 * (config.local_attention // 2) + 1) if window_keys is None else window_keys
    total = 0
    for layer in range(config.num_hidden_layers):
        keys = t if config.is_global(layer) else band
        total += 2 * t * (3 * h * h + h * h + 2 * h * i + i * h) + 2 * 2 * t * keys * h
    total += 2 * num_predictions * (h * h + h * v)
    return 3.0 * total
