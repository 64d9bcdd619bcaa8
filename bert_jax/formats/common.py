"""What the checkpoint formats share: `Pretrained`, a checkpoint in memory, and small file helpers.

Every reader in `bert_jax.formats` returns a `Pretrained` and every writer takes one: a `BertConfig`,
the parameters as numpy float32 in `BertForPreTraining`'s layout with unrolled layers
(`bert/encoder/layer_{i}`; the "mlm" and "nsp" heads absent when the checkpoint has none), the vocab
file and the casing. A fine-tuned model also carries its task head: `params["head"]`
(`bert_jax.finetune.heads.BertForTask`'s output layer) and `task`, the `task.json` that says what it is
(`check_task`). The helpers here read and write what sits beside the weights in every format
(`vocab.txt`, `tokenizer_config.json`, `task.json`) and walk parameter trees.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np
from absl import logging

from bert_jax import layout
from bert_jax.layout import TASK_FILE
from bert_jax.model.model_config import BertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

FORMATS = ("bert_jax", "google", "hf")
HEADS = ("mlm", "nsp")
TASK_HEAD = "head"  # the fine-tuning head's key in the parameters (`bert_jax.finetune.heads.BertForTask`)
FINETUNED = ("best", "last")  # which parameters of a fine-tuning workdir: its best epoch, its last state


@dataclasses.dataclass
class Pretrained:
    """A checkpoint in memory, whatever format it came from."""

    config: BertConfig
    params: dict  # numpy float32, BertForPreTraining layout, unrolled layers
    vocab_file: Optional[str] = None
    do_lower_case: Optional[bool] = None
    format: str = "bert_jax"
    missing: tuple = ()  # heads the checkpoint does not have ("mlm", "nsp")
    skipped: tuple = ()  # source variable names that were not used
    task: Optional[dict] = None  # a fine-tuned model's task.json (`check_task`); params["head"] is its head
    finetuned: Optional[str] = None  # "best" or "last": which state of a fine-tuning workdir was read

    @property
    def heads(self) -> tuple:
        """The pretraining heads present (the fine-tuning head is `task_head`)."""
        return tuple(h for h in HEADS if h in self.params)

    @property
    def task_head(self) -> Optional[str]:
        """The fine-tuning head's kind ("classification", "span", ...), or None."""
        return self.task["head"] if self.task and TASK_HEAD in self.params else None


# ---------------------------------------------------------------------------------------------
# Parameter trees
# ---------------------------------------------------------------------------------------------


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def unrolled(params: dict) -> dict:
    """numpy float32 copy of a parameter tree with `encoder/layer_{i}` (unstacks scanned layers)."""
    import flax.linen as nn
    import jax

    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), nn.meta.unbox(params))
    holder = params["bert"] if "bert" in params else params
    enc = holder.get("encoder", {})
    if "layers" in enc:
        stacked = enc["layers"]
        n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
        holder["encoder"] = {f"layer_{i}": jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
                             for i in range(n)}
    return params


# ---------------------------------------------------------------------------------------------
# The fine-tuning head
# ---------------------------------------------------------------------------------------------


def head_width(task: dict) -> int:
    """Outputs of the head's dense layer: classes (classification, token), 1 (regression, one score
    per choice for multiple_choice), 2 (span: start and end)."""
    return {"span": 2, "multiple_choice": 1}.get(task["head"], task["num_outputs"])


def check_task(task, where: str) -> dict:
    """`task.json`'s content, checked: `{"task": name, "head": one of data_pipeline.tasks.HEAD_KINDS,
    "num_outputs": int, "labels": [...] in the order of the head's outputs (empty for regression and
    span), "max_seq_length": int}`; only "head" and "num_outputs" are required. Other keys are kept."""
    from data_pipeline.tasks import HEAD_KINDS

    if not isinstance(task, dict):
        raise ValueError(f"{where}: a task must be a JSON object, got {type(task).__name__}")
    task = {"task": None, "labels": [], **task}
    head, n, labels = task.get("head"), task.get("num_outputs"), task["labels"]
    if head not in HEAD_KINDS:
        raise ValueError(f"{where}: head={head!r} is not one of {HEAD_KINDS}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: num_outputs={n!r} must be a positive integer")
    if head == "regression" and n != 1:
        raise ValueError(f"{where}: a regression head has num_outputs=1, got {n}")
    if not isinstance(labels, (list, tuple)) or (labels and len(labels) != n):
        raise ValueError(f"{where}: labels={labels!r} must be a list of num_outputs={n} labels, or empty")
    task["labels"] = list(labels)
    return task


def check_head(params: dict, task: dict, config: BertConfig, where: str) -> None:
    """The head's `output/kernel` [hidden, width] and `output/bias` [width] for `task` (`head_width`)."""
    want = {"kernel": (config.hidden_size, head_width(task)), "bias": (head_width(task),)}
    got = params.get(TASK_HEAD, {}).get("output", {})
    for leaf, shape in want.items():
        if leaf not in got:
            raise ValueError(f"{where}: the {task['head']} head has no output/{leaf}")
        if tuple(np.shape(got[leaf])) != shape:
            raise ValueError(f"{where}: head/output/{leaf} has shape {tuple(np.shape(got[leaf]))}, but a "
                             f"{task['head']} head with num_outputs={task['num_outputs']} on hidden_size="
                             f"{config.hidden_size} has {shape}")


def task_of(p: Pretrained, where: str) -> Optional[dict]:
    """What a writer writes of the fine-tuning head: `p.task` (checked) when `p.params` has the head,
    else None. A head without its task is an error: its kind (hence its names) would be a guess."""
    if TASK_HEAD not in p.params:
        return None
    if p.task is None:
        raise ValueError(f"{where}: the parameters have a fine-tuning head but no task says what it is "
                         f"(Pretrained.task, task.json); drop it with --drop_heads")
    task = check_task(p.task, where)
    check_head(p.params, task, p.config, where)
    return task


def read_task(directory: str) -> Optional[dict]:
    """`directory/task.json` checked (`check_task`), or None when there is none."""
    path = storage_paths.join(directory, TASK_FILE)
    return check_task(_load_json(path), path) if storage.isfile(path) else None


def write_task(task: Optional[dict], directory: str) -> None:
    if task is not None:
        storage.write_text(storage_paths.join(directory, TASK_FILE), json.dumps(task, indent=2) + "\n")


def head_output(kernel, bias) -> dict:
    """`params["head"]` from its dense layer's kernel [hidden, width] and bias [width]."""
    return {"output": {"kernel": np.asarray(kernel, np.float32), "bias": np.asarray(bias, np.float32)}}


# ---------------------------------------------------------------------------------------------
# Files beside the weights
# ---------------------------------------------------------------------------------------------


def _load_json(path: str):
    from data_pipeline.tasks import read_json  # local or gs://; names the file, line and column of bad text
    return read_json(path)


def tokenizer_config_json(do_lower_case: bool) -> str:
    """`tokenizer_config.json`'s text: the casing, which this module and HF's BertTokenizer read."""
    return json.dumps({"do_lower_case": bool(do_lower_case), "tokenizer_class": "BertTokenizer"}, indent=2) + "\n"


def _read_casing(directory: str) -> Optional[bool]:
    p = storage_paths.join(directory, layout.TOKENIZER_CONFIG)
    if storage.isfile(p):
        value = _load_json(p)
        value = value.get("do_lower_case") if isinstance(value, dict) else None
        if isinstance(value, bool):
            return value
    return None


def casing_from_vocab(vocab_file: str) -> Optional[bool]:
    """do_lower_case as the vocabulary shows it: a cased WordPiece vocabulary holds thousands of
    tokens with capitals (bert-base-cased: 8,368 of 28,996), an uncased one none but a symbol or
    two (bert-base-uncased: 2 of 30,522; bert-base-chinese: `<S>`, `<T>`), whatever its folder is
    called. True (lower-case) below 1% of the tokens; None for an empty or unreadable file."""
    try:
        tokens = [line.rstrip("\n") for line in storage.read_text(vocab_file).splitlines()]
    except (OSError, UnicodeDecodeError):
        return None
    words = [t for t in tokens if t and not (t.startswith("[") and t.endswith("]"))]
    if not words:
        return None
    capitals = sum(any(c.isupper() for c in t) for t in words)
    return capitals < 0.01 * len(words)


def _maybe(path: str) -> Optional[str]:
    return path if storage.isfile(path) else None


def _require(path: str, what: str) -> str:
    if not storage.isfile(path):
        raise FileNotFoundError(f"{path}: {what} not found")
    return path


def _prepare_dir(path: str, overwrite: bool) -> None:
    """An output folder (local or gs://) that is empty, or `overwrite`; created locally."""
    if storage.exists(path) and storage.listdir(path) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (use overwrite=True / --overwrite)")
    storage.makedirs(path)


def _write_tokenizer_files(p: Pretrained, path: str) -> None:
    if p.vocab_file:
        target = storage_paths.join(path, layout.VOCAB)
        if storage_paths.abspath(p.vocab_file) != storage_paths.abspath(target):
            storage.copy(p.vocab_file, target)
    else:
        logging.warning("%s: no vocab.txt to write (pass vocab_file)", path)
    if p.do_lower_case is not None:
        storage.write_text(storage_paths.join(path, layout.TOKENIZER_CONFIG), tokenizer_config_json(p.do_lower_case))
