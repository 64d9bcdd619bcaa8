"""What pretraining does per `config.model_family`: the model, its init inputs, its FLOPs, what it refuses.

The loop (`loop.py`), the steps (`steps.py`) and the input (`feed.py`) are the same for both
families; this module holds the few places where they differ:

- "bert": `BertForPreTraining` (masked LM + next sentence), its FLOPs (`steps.train_flops_per_sequence`);
- "modernbert": `bert_jax.model.modernbert.ModernBertForMaskedLM` behind `ModernBertPreTraining`, which
  takes the pretraining batch's names (`input_ids`, `input_mask`, `masked_lm_positions`, and from
  packed rows `pack_ids` and `position_ids`; `segment_ids` and `cls_positions` are not read: no token
  types, no NSP) and returns a `PreTrainingOutput` without NSP logits, so the train and eval steps'
  masked-LM loss and sums are BERT's code (`steps.pretraining_sums`; the NSP sums are 0).

ModernBERT refuses, before anything compiles, what it has no part for: `config.use_nsp=True`,
`config.objective="ltr"`, `config.init_checkpoint` (continued pretraining of a ModernBERT
checkpoint is not wired), and `mode=evaluate`. BERT-only model options are not ModernBertConfig
fields and are refused by `run_setup.modernbert_config_from`. This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import ml_collections

from bert_jax.model import modeling
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
    if config.get("init_checkpoint"):
        raise ValueError(f"config.init_checkpoint={config.init_checkpoint}: {where} pretrains from scratch "
                         "(continued pretraining of a ModernBERT checkpoint is not supported)")


def check_evaluate(config: ml_collections.ConfigDict) -> None:
    """`mode=evaluate` scores BERT checkpoints only (`run_setup.load_params` reads BERT's trees)."""
    if config.get("model_family", "bert") != "bert":
        raise ValueError("mode=evaluate scores BERT checkpoints; config.model_family='modernbert' evaluates during "
                         "pretraining (config.eval_data, config.eval_every_steps)")


class ModernBertPreTraining:
    """`ModernBertForMaskedLM` with the pretraining step's calling convention (`init`, `apply` with the
    batch's names); its parameters are exactly `ModernBertForMaskedLM`'s (`formats.modernbert_hf`)."""

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
        return self._call(self.module.init, rngs, **batch)

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
