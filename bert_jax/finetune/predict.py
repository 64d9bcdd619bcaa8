"""`mode=predict`: a fine-tuned model on new text, predictions out.

    python -m bert_jax.main --config=configs/glue.py --config.mode=predict --workdir=runs/sst2 \\
        --config.predict_input=reviews.txt

The workdir is a fine-tuning run's (`bert_jax.finetune.loop`): its `task.json` names the task, the head
and the labels, `bert_config.json`, `vocab.txt` and `tokenizer_config.json` the encoder and its
tokenizer; the parameters are the best epoch's (`W/best/`, `config.predict_params="best"`) or the
last state (`"last"`). The task is the one fine-tuned (a different `--config.task` is refused). A run
of several seeds (`config.seeds`) keeps its best seed's best epoch in `W/best/`; each seed's last
state is in its own workdir, `W/seeds/<seed>/`.

`config.predict_input` is read
- as plain text (`config.predict_format="text"`): one example a line, unlabelled — a sentence, or
  for pair tasks two texts separated by a tab; for NER a sentence (words split at whitespace); for
  SQuAD a question, a tab, its context; for SWAG the context, the start and the endings, tab-separated;
- or in the task's own format (`"task"`): a GLUE tsv with its header (labelled or not), a SQuAD
  json, a CoNLL column file, a SWAG csv. With gold labels in it, the official scores are computed too.
`"auto"` (the default) takes the task's format for the file names and suffixes the task reads
(`.tsv`, `.json`, `.csv`, `.conll`, `dev.tsv`, `test.txt` ...) and plain text otherwise.

Predictions go to `config.predict_output_dir` (default `W/predictions/`) in the files the fine-tuning
loop writes for an eval split named after the input (e.g. `sst2_reviews_predictions.tsv`: id — the
line number for text —, prediction; SQuAD `reviews_predictions.json`), plus `<name>_scores.json`
when the input is labelled. A summary is printed as JSON.
"""

from __future__ import annotations

import functools
import json
import logging
import re

import flax.linen as nn
import jax
import ml_collections

from bert_jax import layout
from bert_jax.finetune import batches as finetune_batches, heads, modernbert_tasks, restarts, steps
from bert_jax.formats.common import read_task
from bert_jax.layout import TASK_FILE
from bert_jax.training import run_setup, sharding
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import tokenizer_json

PREDICT_FORMATS = ("auto", "text", "task")
PREDICT_PARAMS = ("best", "last")


def read_task_file(workdir: str) -> dict:
    """`W/task.json` of a fine-tuning run (checked: `formats.common.check_task`); a clear error when
    `workdir` is not one."""
    task = read_task(workdir)
    path = storage_paths.join(workdir, TASK_FILE)
    if task is None:
        raise FileNotFoundError(
            f"{path} not found: --workdir must be a fine-tuning run's workdir (mode=finetune writes "
            f"{TASK_FILE} there; a workdir fine-tuned before it existed: fine-tune again)")
    for key in ("task", "max_seq_length"):
        if task.get(key) is None:
            raise ValueError(f"{path}: no {key!r}")
    return task


def make_task(config: ml_collections.ConfigDict, description: dict, input_path: str):
    """The task fine-tuned in the workdir, with its task options (a `--config.task_options.x`
    given on the command line overrides the recorded one)."""
    from bert_jax.config_overrides import given_on_command_line
    from data_pipeline import tasks

    given = given_on_command_line()
    options = dict(description.get("task_options") or {})
    for key, value in config.task_options.to_dict().items():
        if f"config.task_options.{key}" in given:
            options[key] = value
    if description.get("labels") and tasks.labels_from_data(description["task"]):
        options["labels"] = list(description["labels"])  # your own data's labels, as fine-tuned
    task = tasks.get_task(description["task"], storage_paths.dirname(input_path) or ".", source="files",
                          skip_bad_rows=config.skip_bad_rows, **options)
    if "config.task" in given and tasks.get_task(config.task, ".").name != task.name:
        raise ValueError(f"--config.task={config.task}: the workdir was fine-tuned on {task.name} "
                         f"({TASK_FILE}); drop the flag or pick that run's workdir")
    if (task.head, task.num_outputs) != (description["head"], description["num_outputs"]):
        raise ValueError(f"{TASK_FILE}: task {task.name} has a {task.head} head with "
                         f"{task.num_outputs} outputs, the file says {description['head']} with "
                         f"{description['num_outputs']}")
    return task


def input_format(task, path: str, wanted: str) -> str:
    """"text" or "task" for `path` (module docstring)."""
    if wanted not in PREDICT_FORMATS:
        raise ValueError(f"config.predict_format must be one of {PREDICT_FORMATS}, got {wanted!r}")
    if wanted != "auto":
        return wanted
    name = storage_paths.basename(path)
    return "task" if name in task.file_names() or name.lower().endswith(task.file_suffixes) else "text"


def read_input(task, path: str, form: str) -> list:
    """The examples of `path`: plain text one a line, or the task's format (read as its first
    eval split, whose reader takes labelled and unlabelled files)."""
    if form == "text":
        examples = task.read_lines(path)
    else:
        split = task.eval_splits[0]
        task.split_files[split] = path
        examples = task.read(split)
    if not examples:
        raise ValueError(f"{path}: no example to predict" + (f" ({task.line_format} a line)" if form == "text"
                                                              else ""))
    return examples


def output_name(path: str) -> str:
    """A file-name-safe name of the input: `reviews.txt` -> `reviews`."""
    stem = storage_paths.basename(path).split(".")[0] or "input"
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem)


def _bert_finetuned(config: ml_collections.ConfigDict, workdir: str, which: str) -> tuple:
    """(BertConfig, `{"bert", "head"}` parameters, vocab file, casing) of a BERT fine-tuning workdir."""
    from bert_jax import convert

    try:
        pretrained = convert.load_finetuned(workdir, which=which)
    except FileNotFoundError:
        best_seed = restarts.best_seed_of(workdir) if which == "last" else None
        if best_seed is None:
            raise
        raise FileNotFoundError(  # W/best/ is the best seed's; each seed's last state is in its own folder
            f"{workdir} is a run of several seeds (config.seeds): no last state of its own; "
            f"--workdir={restarts.seed_dir(workdir, best_seed)} predicts with the best seed's") from None
    with_checkpoint = ml_collections.ConfigDict(config.to_dict())
    with_checkpoint.init_checkpoint = workdir
    bert_config = run_setup.bert_config_from(with_checkpoint)
    vocab_file = config.vocab_file or pretrained.vocab_file
    if not vocab_file:
        raise FileNotFoundError(f"{workdir}: no vocab.txt (set config.vocab_file)")
    do_lower_case = config.do_lower_case if config.do_lower_case is not None else pretrained.do_lower_case
    if do_lower_case is None:
        raise ValueError(f"{workdir}: no tokenizer_config.json to say the casing (set config.do_lower_case)")
    params = convert.model_params(pretrained, bert_config)
    return bert_config, {"bert": params["bert"], "head": params["head"]}, vocab_file, do_lower_case


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Predicts `config.predict_input` with the fine-tuned model in `workdir`; returns the summary."""
    from data_pipeline import tasks as tasks_lib
    from bert_jax.config_overrides import given_on_command_line

    path = config.get("predict_input", "")
    if not path:
        raise ValueError("config.predict_input is empty: the file to predict (module bert_jax.finetune.predict)")
    storage_paths.check(path, "config.predict_input")
    if not storage.isfile(path):
        raise FileNotFoundError(f"config.predict_input={path}: no such file")
    which = config.get("predict_params", "best")
    if which not in PREDICT_PARAMS:
        raise ValueError(f"config.predict_params must be one of {PREDICT_PARAMS}, got {which!r}")
    description = read_task_file(workdir)
    task = make_task(config, description, path)
    form = input_format(task, path, config.get("predict_format", "auto"))
    examples = read_input(task, path, form)

    if description.get("model_family") == "modernbert":  # its best epoch in W/transformers/
        bert_config, params, vocab_file, do_lower_case = modernbert_tasks.finetuned(workdir, which, config)
        model = modernbert_tasks.TaskModel(bert_config, task.head, task.num_outputs)
    else:
        bert_config, params, vocab_file, do_lower_case = _bert_finetuned(config, workdir, which)
        model = heads.BertForTask(bert_config, task.head, task.num_outputs)
    max_len = (config.max_seq_length if "config.max_seq_length" in given_on_command_line()
               else int(description["max_seq_length"]))
    if max_len > bert_config.max_position_embeddings:
        raise ValueError(f"max_seq_length={max_len} exceeds the model's max_position_embeddings="
                         f"{bert_config.max_position_embeddings}")
    tokenizer = tokenizer_json.make_tokenizer(task, vocab_file, do_lower_case)  # vocab.txt or tokenizer.json
    split = tasks_lib.Split(output_name(path), examples,
                            task.featurize(examples, tokenizer, max_len, training=False))

    mesh = sharding.create_mesh(config.mesh.to_dict(), config.dcn_mesh.to_dict())
    batch_size = config.eval_batch_size or config.global_batch_size
    sharding.check_divisibility(mesh, global_batch_size=batch_size, batch_field="config.eval_batch_size",
                                num_attention_heads=bert_config.num_attention_heads,
                                intermediate_size=bert_config.intermediate_size,
                                hidden_size=bert_config.hidden_size)
    dummy = heads.dummy_batch(task.head, max_len, task.num_outputs)
    abstract = jax.eval_shape(  # boxed with logical axis names (ModernBERT's too: modernbert_tasks.init_params)
        lambda r: modernbert_tasks.init_params(model, r, *(dummy[k] for k in heads.MODEL_INPUTS)), jax.random.key(0))
    rules = sharding.DEFAULT_RULES
    shardings = sharding.logical_to_sharding(abstract, mesh, rules)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(shardings):
        raise ValueError(f"{workdir}: its parameters do not match a {task.head} head on its model config")
    params = sharding.place(params, shardings)
    p_eval = jax.jit(functools.partial(steps.eval_step, model=model),
                     in_shardings=(shardings, sharding.batch_sharding(mesh)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        outputs, _ = steps.predict_split(p_eval, params, split, mesh=mesh, keys=heads.batch_keys(task.head),
                                       batch_size=batch_size, **finetune_batches.trim_arguments(
                                           config.get("trim_padding_buckets", 0), max_len, task.head))
    predictions = task.postprocess(split.examples, split.features, outputs)
    out_dir = config.get("predict_output_dir", "") or storage_paths.join(workdir, layout.PREDICTIONS)
    summary = {"input": path, "format": form, "task": task.name, "params": which, "examples": len(examples),
               "skipped_bad_rows": task.skipped}
    if jax.process_index() == 0:
        summary["files"] = task.write_predictions(split.examples, predictions, out_dir, split.name)
        if task.is_labelled(examples):
            summary["scores"] = {k: float(v) for k, v in task.score(examples, predictions).items()}
            summary["files"].append(storage_paths.join(out_dir, layout.scores_file(split.name)))
            storage.write_json(summary["files"][-1], summary["scores"], indent=2, sort_keys=True)
        print(json.dumps(summary, indent=2))
    logging.info("predicted %d examples of %s into %s", len(examples), path, out_dir)
    return summary
