"""What every seed of a fine-tuning run shares, made once (`prepare` -> `Prepared`): the settings
checked against the model and the mesh, the task's splits featurized, the step plan and the
optimizer (`make_optimizer`; the examples counted as Google's scripts count them,
`count_examples`), the state's shapes and shardings, and the jitted programs (initialization, train
and eval steps), so that a second seed (`bert_jax.finetune.restarts`) compiles nothing the first
compiled. `bert_jax.finetune.loop.train_seed` runs one seed of it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Optional

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from bert_jax import exit_codes
from bert_jax.finetune import batches as finetune_batches, heads, modernbert_tasks, steps
from bert_jax.model.model_config import BertConfig
from bert_jax.training import optim, sharding, train_state
from data_pipeline.tasks import tokenizer_json


def make_optimizer(config: ml_collections.ConfigDict, total_steps: int, warmup_steps: int):
    """(learning-rate schedule, optimizer) of `config` for a run of `total_steps`."""
    schedule = optim.learning_rate_schedule(config.learning_rate, warmup_steps, total_steps,
                                            google_style=config.get("google_lr_schedule", False))
    tx = optim.make_optimizer(config.optimizer, schedule, weight_decay=config.weight_decay,
                              b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                              clip_norm=config.clip_norm or None)
    return schedule, tx


def count_examples(split) -> int:
    """Training examples as Google's scripts count them: those that gave at least one feature
    row (an example skipped as a bad row does not count; Google's readers drop it too)."""
    if "example_index" in split.features:
        return len(np.unique(split.features["example_index"]))
    return len(split.examples)


@dataclasses.dataclass
class Prepared:
    """What every seed of a run shares (`prepare`): the data, the model, the schedule, and the
    jitted programs, created once so that a second seed compiles nothing the first compiled."""
    task: Any
    bert_config: BertConfig
    vocab_file: str
    do_lower_case: Optional[bool]  # None: a tokenizer.json (its normalizer decides)
    tokenizer: Any
    mesh: Any
    eval_batch: int
    train: Any  # data_pipeline.tasks.Split
    evals: list
    total_steps: int
    epoch_ends: list
    stream: bool
    abstract_state: Any
    state_shardings: Any
    init: Any  # jit: key (, pretrained parts) -> TrainState
    train_step: Any  # jit: (state, batch) -> (state, metrics)
    eval_step: Any  # jit: (params, batch) -> (outputs, sums)
    test_splits: dict = dataclasses.field(default_factory=dict)  # featurized on first use


def prepare(config: ml_collections.ConfigDict, task, bert_config: BertConfig, with_encoder: bool,
            vocab_file: str, do_lower_case: bool) -> Prepared:
    """The settings checked, the data featurized, the model, optimizer and programs of a run;
    nothing here depends on `config.seed` (`train_seed` takes it)."""
    from data_pipeline import tasks as tasks_lib

    jax.config.update("jax_threefry_partitionable", True)
    max_len = config.max_seq_length
    # The settings against the model and the mesh, the data, the schedule: a bad config is not retried.
    with exit_codes.refusals():
        if max_len > bert_config.max_position_embeddings:
            raise ValueError(f"config.max_seq_length={max_len} exceeds the model's max_position_embeddings="
                             f"{bert_config.max_position_embeddings}")
        mesh = sharding.create_mesh(config.mesh.to_dict(), config.dcn_mesh.to_dict())
        eval_batch = config.eval_batch_size or config.global_batch_size
        for field, size in (("config.global_batch_size", config.global_batch_size),
                            ("config.eval_batch_size", eval_batch)):
            if size < 1:
                raise ValueError(f"{field}={size} must be at least 1")
            sharding.check_divisibility(mesh, global_batch_size=size, batch_field=field,
                                        num_attention_heads=bert_config.num_attention_heads,
                                        intermediate_size=bert_config.intermediate_size,
                                        hidden_size=bert_config.hidden_size)

        # --- data ---
        tokenizer = tokenizer_json.make_tokenizer(task, vocab_file, do_lower_case)  # vocab.txt or tokenizer.json
        num_ids = max(tokenizer.vocab.values(), default=-1) + 1  # ids, not distinct tokens (repeats)
        if num_ids > bert_config.vocab_size:
            raise ValueError(f"{vocab_file} has {num_ids} entries but the model's vocab_size is "
                             f"{bert_config.vocab_size}: wrong vocabulary for this checkpoint")
        started = time.time()
        eval_splits = tuple(config.eval_splits) or task.eval_splits
        _prepare_tfds_on_host_zero(task, (task.train_split, *eval_splits),
                                   task.test_splits if config.predict_test else ())
        task.show_progress = jax.process_index() == 0
        train = tasks_lib.load_split(task, task.train_split, tokenizer, max_len, training=True)
        evals = [tasks_lib.load_split(task, s, tokenizer, max_len, training=False) for s in eval_splits]
        logging.info("task %s: %d training rows (%d examples), eval %s, featurized in %.1fs; skipped bad rows: %s",
                     task.name, len(train.features["weight"]), len(train.examples),
                     {s.name: len(s.examples) for s in evals}, time.time() - started, task.skipped or "none")

        # --- model, optimizer, state ---
        # ModernBERT (`config.model_family`): transformers' task classes behind the same call.
        model_class = modernbert_tasks.TaskModel if modernbert_tasks.is_model(bert_config) else heads.BertForTask
        model = model_class(bert_config, task.head, task.num_outputs)
        num_train = len(train.features["weight"])
        total_steps, warmup, epoch_ends = finetune_batches.train_plan(config, count_examples(train), num_train)
        stream = config.get("num_train_steps_from", "epochs") == "examples"
        logging.info("%d training steps (%d warmup), evaluations after steps %s", total_steps, warmup, epoch_ends)
        schedule, tx = make_optimizer(config, total_steps, warmup)
    dummy = heads.dummy_batch(task.head, max_len, task.num_outputs)

    def init_state(rng):
        params_rng, dropout_rng = jax.random.split(rng)
        params = modernbert_tasks.init_params(model, params_rng, *(dummy[k] for k in heads.MODEL_INPUTS))
        if model_class is heads.BertForTask:  # ModernBERT's classifier is drawn as transformers draws it
            params = heads.draw_head(params, config.get("head_init", "truncated_normal"),
                                     jax.random.fold_in(params_rng, 1), bert_config.initializer_range)
        return train_state.create_train_state(params, tx, dropout_rng)

    level = config.get("xla_backend_optimization_level", -1)
    compiler_options = {"xla_backend_optimization_level": level} if level >= 0 else None
    abstract = jax.eval_shape(init_state, jax.random.key(config.seed))  # shapes only: any seed
    state_shardings = sharding.logical_to_sharding(abstract, mesh, sharding.DEFAULT_RULES)
    abstract_state = sharding.abstract_with_shardings(nn.meta.unbox(abstract), state_shardings)

    # --- the programs, jitted once for every seed ---
    if with_encoder:
        # The encoder's random initialization is dead code in this program (the checkpoint
        # replaces it), so XLA drops it: only the head's is compiled and run (a MiniLM's
        # whole initialization took 8 s to compile on 2 CPU cores). The head's values are
        # the same: flax draws each module's key from its own path.
        def init_with_encoder(rng, encoder):  # encoder: {"bert": ...} (ModernBERT: {"model", "head"})
            state = nn.meta.unbox(init_state(rng))
            return state.replace(params={**state.params, **encoder})

        init = jax.jit(init_with_encoder, out_shardings=state_shardings, donate_argnums=1,
                       compiler_options=compiler_options)
    else:
        init = jax.jit(lambda r: nn.meta.unbox(init_state(r)), out_shardings=state_shardings,
                       compiler_options=compiler_options)
    batch_sharding = sharding.batch_sharding(mesh)
    p_train = jax.jit(functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule),
                      in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
                      donate_argnums=0, compiler_options=compiler_options)
    p_eval = jax.jit(functools.partial(steps.eval_step, model=model),
                     in_shardings=(state_shardings.params, batch_sharding), compiler_options=compiler_options)
    return Prepared(task=task, bert_config=bert_config, vocab_file=vocab_file, do_lower_case=do_lower_case,
                    tokenizer=tokenizer, mesh=mesh, eval_batch=eval_batch, train=train, evals=evals,
                    total_steps=total_steps, epoch_ends=epoch_ends, stream=stream, abstract_state=abstract_state,
                    state_shardings=state_shardings, init=init, train_step=p_train, eval_step=p_eval)


def _prepare_tfds_on_host_zero(task, splits, optional_splits=()) -> None:
    """With TFDS as the source on several hosts, host 0 downloads and prepares every dataset the
    run will read while the others wait; then they find it in a shared `tfds_data_dir` (or
    prepare their own copy in a local one). Without this, N hosts build it at once in one
    folder. `optional_splits` (test splits) may be missing."""
    from data_pipeline import tasks as tasks_lib

    if task.source != "tfds" or jax.process_count() == 1:
        return
    if jax.process_index() == 0:
        with tasks_lib.prepare_tfds_only():
            for split in splits:
                task.read(split)
            for split in optional_splits:
                try:
                    task.read(split)
                except (FileNotFoundError, KeyError, ValueError) as e:  # as the prediction loop
                    logging.info("no %s split to prepare: %s", split, e)
    multihost_utils.sync_global_devices("bert_jax.finetune.preparation: TFDS datasets prepared")
