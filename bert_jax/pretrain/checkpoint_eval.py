"""`mode=evaluate`: a checkpoint scored on pretraining TFRecords, as the loop's evaluations score it.

`evaluate(config, workdir)` loads `config.init_checkpoint`'s parameters (`run_setup.load_params`:
a bert_jax workdir or export, Google's TF1 checkpoint, HF's safetensors; with
`config.model_family="modernbert"`, `model_family.load_modernbert`: a ModernBERT pretraining workdir
or a transformers ModernBERT folder, its model the checkpoint's with `config.model`'s `dtype`,
`attention_impl` and `local_blocks`), runs `steps.eval_step`
over one pass (or `config.eval_steps` batches) of `config.eval_data` (`feed.make_eval_input`,
`feed.run_eval`), and writes the metrics to `workdir/eval_results.json`. It reads the ml_collections
config here and passes explicit arguments below.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

import flax.linen as nn
import jax
import ml_collections

from bert_jax import layout
from bert_jax.formats import modernbert_hf
from bert_jax.model import modernbert_axes
from bert_jax.model.pretraining_heads import BertForPreTraining
from bert_jax.pretrain import model_family, steps
from bert_jax.pretrain.feed import make_eval_input, run_eval
from bert_jax.training import run_setup, sharding
from bert_jax.workdir import write_json


def evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Scores `config.init_checkpoint` on `config.eval_data`; writes `workdir/eval_results.json`."""
    if not config.init_checkpoint:
        raise ValueError("config.init_checkpoint is empty: give the checkpoint to evaluate")
    if not config.eval_data:
        raise ValueError("config.eval_data is empty: give the evaluation TFRecords (glob)")
    jax.config.update("jax_threefry_partitionable", True)
    mesh = sharding.create_mesh(config.mesh.to_dict(), config.dcn_mesh.to_dict())
    if config.get("model_family", "bert") == "modernbert":
        model, params, params_shardings = _modernbert(config, mesh)
    else:
        bert_config = run_setup.bert_config_from(config)
        params, params_shardings = run_setup.load_params(config, bert_config, mesh)
        model = BertForPreTraining(bert_config.replace(fp8=False))  # as in training's evaluations
    p_eval = jax.jit(functools.partial(steps.eval_step, model=model, objective=config.objective),
                     in_shardings=(params_shardings, sharding.batch_sharding(mesh)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        results = run_eval(p_eval, params, make_eval_input(config, config.eval_data), mesh,
            config.eval_steps)
    if jax.process_index() == 0:
        write_json(workdir, layout.EVAL_RESULTS, results, indent=2, sort_keys=True)
        print(json.dumps(results, sort_keys=True))
    return results


def _modernbert(config: ml_collections.ConfigDict, mesh):
    """The evaluation model, parameters and their shardings (by their logical axis names, as in training:
    `modernbert_axes`) of a ModernBERT `config.init_checkpoint`."""
    model_config, params, where = model_family.load_modernbert(config.init_checkpoint)
    ours = {k: config.model[k] for k in modernbert_hf.OWN_FIELDS if k in config.model}
    model_config = run_setup.modernbert_cpu_bf16(config, dataclasses.replace(model_config, **ours))
    model_family.check(config, model_config)
    logging.info("evaluating %s", where)
    shardings = sharding.logical_to_sharding(modernbert_axes.with_logical_axes(params), mesh)
    return model_family.eval_model(model_config), sharding.place(params, shardings), shardings
