"""The fine-tuning loop: one loop for every task of `data_pipeline.tasks`.

    python -m bert_jax.main --config=configs/glue.py --config.task=sst2 --config.data_dir=DIR \\
        --config.init_checkpoint=PATH --workdir=W

`run(config, workdir)` reads the config: the task (`config.task`, from `config.data_dir` or TFDS),
the pretrained encoder (`config.init_checkpoint`, any format `bert_jax.convert` reads), its
vocabulary and casing; then `train_and_evaluate` does the rest with explicit arguments, so tests
(and users with weights in memory) can pass the encoder's parameters directly.

What the loop does, whatever the task (the task supplies the head kind, the number of outputs,
featurization, post-processing and the metric; there is no per-task branch here):
- the encoder from the checkpoint plus a fresh head (`bert_jax.finetune.heads.BertForTask`), initialized
  straight into its shards on the same (data, fsdp, tensor) mesh as pretraining;
- AdamW (`config.optimizer`), linear warmup over `warmup_proportion` of the steps then linear
  decay to 0, global-norm clipping; the paper's defaults live in the configs;
- epochs over the in-memory features, reshuffled each epoch with `seed + epoch`; the last batch
  is completed with weight-0 rows, so nothing is dropped;
- each batch cut to the shortest of `config.trim_padding_buckets` lengths that holds its longest
  row (`bert_jax.finetune.batches`; evaluation takes its rows by length): the padded
  computation to float rounding, at the cost of a compile per length; not for the span head;
- training rows packed several to a row (`config.packing`, classification, regression and token
  heads; `bert_jax/finetune/row_packing.py`): the unpacked loss to float rounding, in the rows
  each step needs; the lengths and row counts compiled are those that pay for their compile
  (`bert_jax.finetune.batches` plans every step's batch before training);
- or google-research/bert's `run_classifier.py` / `run_squad.py` recipe (docs/finetuning.md):
  `optimizer="google_adamw"`, `google_lr_schedule=True` and `num_train_steps_from="examples"`:
  `int(len(train_examples) / global_batch_size * num_train_epochs)` steps of full batches from
  one stream of the feature rows, pass after pass (`train_plan`, `stream_batches`);
- after each epoch: every eval split is predicted, post-processed and scored; the epoch whose
  first eval split has the best `task.primary_metric` is kept in `W/best/` (parameters) with its
  predictions in `W/best_predictions/`; the last state is in `W/checkpoints/` (resumable, also after
  a SIGTERM mid-epoch: the batches of an epoch are a function of the seed);
- after training: predictions for the task's test splits (GLUE-server files, with the final
  parameters) and `W/eval_results.json` (metric name -> value, last epoch; keys of eval splits
  after the first are prefixed with the split's name) plus `W/eval_history.json` (every epoch);
- metrics to TensorBoard and the console (`workdir.metric_writer`), progress bars (tqdm);
- with `config.seeds`, the paper's random restarts (`bert_jax.finetune.restarts`): all of the
  above once per seed in `W/seeds/<seed>/`, with the programs jitted once for every seed
  (`bert_jax.finetune.preparation`), and the best seed's best epoch copied to `W/best/`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from typing import Optional

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from bert_jax import exit_codes, layout, versions, workdir as workdir_files
from bert_jax.checkpoints import checkpointer, step_dirs
from bert_jax.finetune import (batches as finetune_batches, heads, modernbert_tasks, preparation, restarts,
                               row_packing, steps)
from bert_jax.layout import TASK_FILE
from bert_jax.model.model_config import BertConfig
from bert_jax.training import compile_ahead, run_setup, sharding
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import tokenizer_json


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def task_description(task, config: ml_collections.ConfigDict) -> dict:
    """What `W/task.json` says about the fine-tuned head, for `mode=predict` and the HF export:
    the task, the head kind, its outputs and their label names (in the order of the head's outputs;
    empty for regression, span and multiple choice), the sequence length and the task options."""
    labels = [] if task.head in ("regression", "span", "multiple_choice") else [str(x) for x in task.labels]
    description = {"task": task.name, "head": task.head, "num_outputs": int(task.num_outputs), "labels": labels,
                   "max_seq_length": int(config.max_seq_length), "task_options": config.task_options.to_dict()}
    if modernbert_tasks.wanted(config):  # mode=predict reads W/transformers/ (BERT's task.json is unchanged)
        description["model_family"] = "modernbert"
    return description


def make_task(config: ml_collections.ConfigDict):
    from data_pipeline import tasks
    return tasks.get_task(
        config.task, config.data_dir, source=config.data_source, tfds_data_dir=config.tfds_data_dir or None,
        skip_bad_rows=config.skip_bad_rows,
        split_files={k: v for k, v in config.split_files.to_dict().items() if v},
        **config.task_options.to_dict())


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Fine-tunes `config.init_checkpoint` on `config.task`; returns the final eval results.

    What is read and checked before training (the task, the checkpoint, the vocabulary; in
    `train_and_evaluate` the settings and the resumed checkpoint) runs inside
    `exit_codes.refusals()`: a bad config ends the process with exit code 78, not retried.
    """
    with exit_codes.refusals():
        task, bert_config, init_params, vocab_file, do_lower_case = _prepare(config, workdir)
    return train_and_evaluate(config, workdir, task, bert_config, init_params, vocab_file, do_lower_case)


def _prepare(config: ml_collections.ConfigDict, workdir: Optional[str] = None) -> tuple:
    """(task, bert_config, encoder params or None, vocab file, do_lower_case) of `config` (`run`);
    with `config.model_family="modernbert"` the model config and parameters are ModernBERT's
    (`bert_jax.finetune.modernbert_tasks`)."""
    modernbert = modernbert_tasks.wanted(config)
    if modernbert:
        modernbert_tasks.check_config(config)  # BERT-only options refused by name
    if config.model.get("fp8"):
        raise ValueError("config.model.fp8=True: FP8 training is a pretraining option (bert_jax.pretrain.loop); "
                         "fine-tuning runs in config.model.dtype (e.g. bfloat16): set config.model.fp8=False")
    heads.check_head_init(config.get("head_init", "truncated_normal"))
    task = make_task(config)
    run_setup.use_prng_impl(config)
    if modernbert:
        bert_config, init_params, vocab_file, do_lower_case = modernbert_tasks.load(config, workdir)
    elif config.get("tokenizer_json"):
        raise ValueError(f"config.tokenizer_json={config.tokenizer_json}: a tokenizer.json is read for "
                         "config.model_family=modernbert; BERT fine-tuning reads a WordPiece config.vocab_file")
    else:
        bert_config, init_params, vocab_file, do_lower_case = _bert_encoder(config, workdir)
    if not vocab_file:
        raise ValueError("no vocabulary: set config.vocab_file (the checkpoint has no vocab.txt"
                         f"{'; or config.tokenizer_json' if modernbert else ''})")
    if tokenizer_json.is_tokenizer_json(vocab_file):  # its normalizer decides the casing
        logging.info("tokenizer %s (HuggingFace tokenizer.json)", vocab_file)
        return task, bert_config, init_params, vocab_file, None
    if do_lower_case is None:  # no config, no tokenizer_config.json: the vocabulary says it
        from bert_jax.formats.common import casing_from_vocab
        do_lower_case = casing_from_vocab(vocab_file)
        if do_lower_case is not None:
            logging.info("casing from the vocabulary %s: do_lower_case=%s", vocab_file, do_lower_case)
    if do_lower_case is None:
        logging.warning("casing unknown (no config.do_lower_case, none in the checkpoint): lower-casing; "
                        "set config.do_lower_case=False for a cased model")
    do_lower_case = True if do_lower_case is None else bool(do_lower_case)
    logging.info("vocabulary %s, do_lower_case=%s", vocab_file, do_lower_case)
    return task, bert_config, init_params, vocab_file, do_lower_case


def _bert_encoder(config: ml_collections.ConfigDict, workdir: Optional[str]) -> tuple:
    """(BertConfig, `{"bert": encoder}` or None, vocab file, casing or None) of `config`."""
    bert_config = run_setup.bert_config_from(config, workdir=workdir)  # cpu_bf16's decision kept in W
    init_params, vocab_file, do_lower_case = None, config.vocab_file, config.do_lower_case
    if config.init_checkpoint:
        from bert_jax import convert
        pretrained = convert.load_pretrained(config.init_checkpoint, google_gelu=config.get("google_gelu"))
        init_params = convert.model_params(pretrained, bert_config, heads=False)
        vocab_file = vocab_file or pretrained.vocab_file
        if do_lower_case is None:
            do_lower_case = pretrained.do_lower_case
    else:
        logging.warning("config.init_checkpoint is empty: the encoder starts from a random initialization")
    return bert_config, init_params, vocab_file, do_lower_case


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, task, bert_config: BertConfig,
                       init_params: Optional[dict], vocab_file: str, do_lower_case: bool) -> dict:
    """The loop (module docstring). `init_params` is `{"bert": numpy tree}` (ModernBERT: `{"model": ...,
    "head": ...}`; or None: random).

    Returns the last epoch's eval results (as written to `W/eval_results.json`); with
    `config.seeds`, one run per seed (`bert_jax.finetune.restarts`) and their summary.
    """
    seeds = config.get("seeds", ()) or ()
    with exit_codes.refusals():
        restarts.check_workdir(workdir, seeds)
    prepared = preparation.prepare(config, task, bert_config, init_params is not None, vocab_file, do_lower_case)
    if not seeds:
        return train_seed(prepared, config, workdir, init_params)[0]
    return restarts.run_seeds(config, workdir, seeds, task.primary_metric,
                              functools.partial(train_seed, prepared, init_params=init_params))


def train_seed(prepared: preparation.Prepared, config: ml_collections.ConfigDict, workdir: str,
               init_params: Optional[dict]) -> tuple[dict, bool]:
    """One run of `prepared` with `config.seed` (the head's draw, dropout, the data order) in
    `workdir`: resumed from `W/checkpoints/`, evaluated after each epoch, its files written.
    Returns the last epoch's eval results, and whether the run finished (False: stopped by
    SIGTERM or preemption, saved to resume)."""
    from tqdm import tqdm

    p = prepared
    task, bert_config, mesh, train, evals, epoch_ends = p.task, p.bert_config, p.mesh, p.train, p.evals, p.epoch_ends
    total_steps, stream, eval_batch, max_len = p.total_steps, p.stream, p.eval_batch, config.max_seq_length
    rules = sharding.DEFAULT_RULES
    storage.makedirs(workdir)
    every = int(config.get("checkpoint_every_steps", 0) or 0)
    if every < 0:
        raise exit_codes.mark(ValueError(f"config.checkpoint_every_steps={every}: 0 (each epoch) or a positive "
                                         "step count"), exit_codes.CONFIG)
    # Both checkpointers' deadlines.
    timeouts = dict(save_timeout_s=config.get("checkpoint_save_timeout_seconds", 1800),
                    restore_timeout_s=config.get("checkpoint_restore_timeout_seconds", 1800))
    ckpt = checkpointer.Checkpointer(storage_paths.join(workdir, layout.CHECKPOINTS),
                                      save_interval_steps=every or total_steps + 1,
                                      max_to_keep=1, async_save=config.async_checkpointing,
                                      on_damaged=config.get("on_damaged_checkpoint", "fallback"), **timeouts)
    best_ckpt = checkpointer.Checkpointer(storage_paths.join(workdir, layout.BEST), save_interval_steps=1,
                                           max_to_keep=1, async_save=False, handle_sigterm=False, **timeouts)
    start_step, meta = ckpt.latest_step(), {}
    keys = heads.batch_keys(task.head)
    trimming, eval_trimming, step_rows, slots = finetune_batches.plan_batches(
        config, task, train, evals, mesh, total_steps, len(epoch_ends), stream, eval_batch)
    hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())

    def epoch_batches(epoch: int, step: int):
        """This host's batches of `epoch` from `step` on (packed: bert_jax/finetune/row_packing.py)."""
        begin, end = ([0] + epoch_ends)[epoch], epoch_ends[epoch]
        if stream:
            batches = finetune_batches.stream_batches(
                train.features, keys, config.global_batch_size, range(step, end), seed=config.seed,
                **hosts, **trimming)
        else:
            batches = itertools.islice(finetune_batches.batches(
                train.features, keys, config.global_batch_size, shuffle_seed=config.seed + epoch,
                **hosts, **trimming), step - begin, None)
        if step_rows is not None:  # this host's rows of each step, packed
            batches = (row_packing.pack(b, int(step_rows[k]) // jax.process_count(), slots)
                       for k, b in zip(itertools.count(step), batches))
        return batches

    # The programs this run will call, compiled on a background thread while it restores or
    # initializes, trains and evaluates (bert_jax/training/compile_ahead.py): every training batch
    # shape in order; every evaluation batch shape queued, taken by the main thread while it waits
    # for the training step's program, or after. The same programs, compiled earlier.
    resumed = start_step or 0  # the newest step saved (its restore comes below)
    ahead = compile_ahead.CompileAhead(enabled=bool(config.get("compile_ahead", True)) and resumed < total_steps,
                                       context=lambda: _MeshContext(mesh, rules))
    first_epoch = sum(end <= resumed for end in epoch_ends)
    ahead.submit_each("train", p.train_step, (p.abstract_state,), itertools.chain.from_iterable(
        epoch_batches(e, max(resumed, ([0] + epoch_ends)[e])) for e in range(first_epoch, len(epoch_ends))),
        process_count=jax.process_count(), limit=_distinct_train_shapes(step_rows, trimming, resumed),
        sharding=sharding.batch_sharding(mesh))
    ahead.queue_each("eval", p.eval_step, (p.abstract_state.params,), itertools.chain.from_iterable(
        steps.predict_batches(split, keys=keys, batch_size=eval_batch, **eval_trimming)[0] for split in evals),
        process_count=jax.process_count(), sharding=sharding.batch_sharding(mesh))
    if start_step is not None:  # the newest intact step: damaged ones are skipped (checkpointer.py)
        try:  # before anything compiles; refused: not retried (a version mismatch keeps its own exit code)
            with exit_codes.refusals():
                start_step, state, meta = ckpt.restore_latest(p.abstract_state, check_input_state=False)
                versions.check_resume(meta.get(versions.META_KEY),
                                      allow_change=config.get("allow_version_change", False),
                                      where=f"checkpoint step {start_step} in {ckpt.directory}")
        except step_dirs.CheckpointRestoreError:
            ahead.close()
            ckpt.close()  # puts the previous SIGTERM handler back
            best_ckpt.close()
            raise
        logging.info("resumed from step %d", start_step)
    else:
        start_step = 0
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):  # straight into shards (sharding.sharded_init)
            if init_params is None:
                state = p.init(jax.random.key(config.seed))
            else:
                encoder = {k: _place_encoder(v, p.state_shardings.params[k]) for k, v in init_params.items()}
                state = p.init(jax.random.key(config.seed), encoder)
    if jax.process_index() == 0:
        bpe = tokenizer_json.is_tokenizer_json(p.vocab_file)  # W/tokenizer.json instead of W/vocab.txt
        workdir_files.write_model_files(workdir, bert_config, "" if bpe else p.vocab_file, p.do_lower_case,
                                        tokenizer_json=p.vocab_file if bpe else "")
        workdir_files.write_json(workdir, TASK_FILE, task_description(task, config), indent=2)

    writer = workdir_files.metric_writer(workdir, just_logging=jax.process_index() > 0)
    if start_step == 0:
        writer.write_hparams(run_setup.hparams(config, bert_config))
    p_train = p.train_step
    predict = functools.partial(steps.predict_split, p.eval_step, mesh=mesh, keys=keys, batch_size=eval_batch,
                                before_call=lambda b: ahead.wait(("eval", compile_ahead.signature(b))),
                                **eval_trimming)


    history = list(meta.get("history", []))
    best = meta.get("best")
    installed_versions = versions.installed()

    def checkpoint_meta() -> dict:  # the history and best epoch so far; the versions, checked on resume
        return {"history": history, "best": best, versions.META_KEY: installed_versions}

    results: dict = dict(history[-1]) if history else {}
    step = start_step
    stop = False
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            for epoch in range(sum(end <= start_step for end in epoch_ends), len(epoch_ends)):
                begin, end = ([0] + epoch_ends)[epoch], epoch_ends[epoch]
                skip = step - begin  # batches of this epoch already trained
                bar = tqdm(total=end - begin, initial=skip, desc=f"{task.name} epoch {epoch + 1}",
                           disable=jax.process_index() > 0, dynamic_ncols=True)
                pending, window = [], time.time()
                train_sums = {"loss_sum": 0.0, "weight": 0.0}
                for batch in epoch_batches(epoch, step):
                    ahead.wait(("train", compile_ahead.signature(batch)))  # its program, if compiling ahead
                    global_batch = sharding.to_global(batch, mesh)
                    with jax.transfer_guard_host_to_device("disallow"):
                        state, metrics = p_train(state, global_batch)
                    step += 1
                    pending.append(metrics)
                    bar.update(1)
                    last = step == end
                    if step % config.log_every_steps == 0 or last:
                        _log(pending, step, window, writer, bar, config, train_sums)
                        pending, window = [], time.time()
                    # Saved after each epoch's evaluation; mid-epoch on SIGTERM / preemption and
                    # every `checkpoint_every_steps` (an epoch's batches are a function of the
                    # seed, so the run resumes mid-epoch).
                    stop = ckpt.should_stop(step)
                    if stop and not last:
                        ckpt.save(step, state, checkpoint_meta(), force=True)
                        break
                    if every and not last:
                        ckpt.save(step, state, checkpoint_meta())
                bar.close()
                if stop and step != end:
                    logging.warning("SIGTERM/preemption: saved step %d, exiting", step)
                    break
                # --- evaluation after the epoch ---
                results = {"epoch": epoch + 1, "step": step,
                           "train_loss": train_sums["loss_sum"] / max(train_sums["weight"], 1e-9)}
                split_predictions = []
                for n, split in enumerate(evals):
                    outputs, sums = predict(state.params, split)
                    predictions = task.postprocess(split.examples, split.features, outputs)
                    scores = task.score(split.examples, predictions)
                    if sums["weight"] > 0:
                        scores["loss"] = sums["loss_sum"] / sums["weight"]
                    prefix = "" if n == 0 else task.split_name(split.name) + "_"
                    results.update({prefix + k: float(v) for k, v in scores.items()})
                    writer.write_scalars(step, {f"eval_{split.name}/{k}": float(v) for k, v in scores.items()})
                    split_predictions.append((split, predictions))
                    if jax.process_index() == 0:
                        task.write_predictions(split.examples, predictions, workdir, split.name)
                metric = results.get(task.primary_metric)
                improved = metric is not None and (best is None or metric > best["value"])
                if improved:
                    best = {"value": metric, "epoch": epoch + 1, "metric": task.primary_metric}
                    best_ckpt.save(step, {"params": state.params}, {"epoch": epoch + 1, "results": results},
                                   force=True)
                    if jax.process_index() == 0:
                        best_dir = storage_paths.join(workdir, layout.BEST_PREDICTIONS)
                        storage.rmtree(best_dir)
                        for split, predictions in split_predictions:
                            task.write_predictions(split.examples, predictions, best_dir, split.name)
                    if modernbert_tasks.is_model(bert_config):  # W/transformers/: the best epoch, transformers'
                        modernbert_tasks.export(workdir, bert_config, task_description(task, config), state.params,
                                                p.vocab_file, p.do_lower_case)
                results["best_epoch"] = best["epoch"] if best else None
                # Not "best_<metric>": SQuAD v2's official metrics already have best_f1 (another quantity).
                results[f"best_epoch_{task.primary_metric}"] = best["value"] if best else None
                history.append(results)
                logging.info("epoch %d: %s", epoch + 1, json.dumps(results, sort_keys=True))
                ckpt.save(step, state, checkpoint_meta(), force=True)
                if stop:
                    logging.warning("SIGTERM/preemption: saved step %d after its evaluation, exiting", step)
                    break
            if not stop:
                for split_name in task.test_splits if config.predict_test else ():
                    split = _test_split(p, split_name, max_len)
                    if split is None:
                        continue
                    outputs, _ = predict(state.params, split)
                    if jax.process_index() == 0:
                        task.write_predictions(split.examples, task.postprocess(
                            split.examples, split.features, outputs), workdir, split_name)
    finally:
        try:
            writer.close()  # a gs:// workdir's events are uploaded here at the latest
        finally:
            ahead.close()
            ckpt.close()
            best_ckpt.close()
    if ahead.compiled:
        logging.info("compile ahead: %d programs compiled on a background thread in %.1fs; the run waited "
                     "%.1fs for them", len(ahead.compiled), sum(s for _, s in ahead.compiled), ahead.waited_s)
    if jax.process_index() == 0 and not stop:
        workdir_files.write_json(workdir, layout.EVAL_RESULTS, results, indent=2, sort_keys=True)
        workdir_files.write_json(workdir, layout.EVAL_HISTORY, history, indent=2)
        print(json.dumps(results, sort_keys=True))
    return results, not stop



# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


class _MeshContext:
    """The mesh and flax's logical axis rules, entered on the thread that compiles ahead."""

    def __init__(self, mesh, rules):
        self._contexts = (jax.set_mesh(mesh), nn.logical_axis_rules(rules))

    def __enter__(self):
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)


def _distinct_train_shapes(step_rows, trimming: dict, start_step: int) -> int:
    """How many training batch shapes the steps from `start_step` on can have: packed, one per row
    count; else one per trimming length (one without trimming)."""
    if step_rows is not None:
        return len(np.unique(np.asarray(step_rows)[start_step:]))
    return len(trimming.get("lengths") or ()) or 1


def _place_encoder(encoder: dict, shardings: dict) -> dict:
    """The pretrained encoder on the fresh encoder's shardings; shapes and names must match."""
    want = jax.tree_util.tree_structure(shardings)
    have = jax.tree_util.tree_structure(encoder)
    if want != have:
        raise ValueError("the checkpoint's encoder parameters do not match the model "
                         f"(expected {want}, got {have})")
    return sharding.place(encoder, shardings)


def _log(pending, step, window_start, writer, bar, config, train_sums) -> None:
    fetched = jax.device_get(pending)
    seconds = time.time() - window_start
    for i, m in enumerate(fetched):
        if float(m["finite"]) == 0.0:
            raise FloatingPointError(
                f"step {step - len(fetched) + i + 1}: non-finite loss or gradient (loss={float(m['loss'])}, "
                f"grad_norm={float(m['grad_norm'])}); the update was not applied")
    loss_sum = sum(float(m["loss_sum"]) for m in fetched)
    weight = sum(float(m["weight"]) for m in fetched)
    train_sums["loss_sum"] += loss_sum
    train_sums["weight"] += weight
    out = {"loss": loss_sum / max(weight, 1e-9),
           "grad_norm": float(fetched[-1]["grad_norm"]),
           "learning_rate": float(fetched[-1]["learning_rate"]),
           "sequences_per_second": len(fetched) * config.global_batch_size / max(seconds, 1e-9)}
    if "correct" in fetched[0]:  # not for regression (STS-B)
        out["accuracy"] = sum(float(m["correct"]) for m in fetched) / max(weight, 1e-9)
    writer.write_scalars(step, {f"train/{k}": v for k, v in out.items()})
    bar.set_postfix(loss=f"{out['loss']:.4f}", refresh=False)


def _test_split(prepared: preparation.Prepared, name: str, max_len: int):
    """Test split `name`, featurized once for every seed of a run; None (logged) when it has no file."""
    from data_pipeline import tasks as tasks_lib

    if name not in prepared.test_splits:
        try:
            prepared.test_splits[name] = tasks_lib.load_split(prepared.task, name, prepared.tokenizer, max_len,
                                                              training=False)
        except FileNotFoundError as e:
            logging.info("no %s split to predict: %s", name, e)
            prepared.test_splits[name] = None
    return prepared.test_splits[name]
