"""`mode=evaluate`: a checkpoint scored on pretraining TFRecords, as the loop's evaluations score it.

`evaluate(config, workdir)` loads `config.init_checkpoint`'s parameters (`run_setup.load_params`:
a bert_jax workdir or export, Google's TF1 checkpoint, HF's safetensors), runs `steps.eval_step`
over one pass (or `config.eval_steps` batches) of `config.eval_data` (`feed.make_eval_input`,
`feed.run_eval`), and writes the metrics to `workdir/eval_results.json`. It reads the ml_collections
config here and passes explicit arguments below.
"""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import ml_collections

from bert_jax import layout
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
    model_family.check_evaluate(config)
    jax.config.update("jax_threefry_partitionable", True)
    bert_config = run_setup.bert_config_from(config)
    mesh = sharding.create_mesh(config.mesh.to_dict(), config.dcn_mesh.to_dict())
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
