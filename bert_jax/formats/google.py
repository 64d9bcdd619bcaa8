"""Google's TF1 checkpoints (google-research/bert): names, config, read, write.

On disk: `bert_model.ckpt.{index,data-*}` + `bert_config.json` + `vocab.txt`; read with
`tf.train.load_checkpoint` and written with `tf.raw_ops.SaveV2` (tensorflow is imported in those two
functions only, lazily).

The name table (`_table`) maps our parameter tree to Google's TF1 variable names
(`bert/encoder/layer_3/attention/self/query/kernel`, `[in, out]` kernels); HuggingFace's names are
derived from these by rule (`bert_jax.formats.hf`), so this table is the only one.

Google's `"gelu"` is ambiguous: google-research/bert computed the exact erf GELU until 2019-02-07
(the 2018 releases were trained with it) and the tanh approximation since. `google_gelu`
(`--google_gelu`) says which to read: `"erf"` (default) or `"tanh"`; a line in the log says which was
taken (see docs/checkpoints.md). Exports write `"gelu"` plus `"bert_jax_hidden_act"` naming our exact
activation, which Google's code ignores and our import honours over `google_gelu` (Google's current
TF1 code runs `"gelu"` as the tanh approximation: exporting an erf model warns so).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Optional

import numpy as np
from absl import logging

from bert_jax.formats.common import (HEADS, TASK_HEAD, Pretrained, _get, _load_json, _maybe, _prepare_dir,
                                     _read_casing, _require, _set, _write_tokenizer_files, casing_from_vocab,
                                     check_head, head_output, read_task, task_of, unrolled, write_task)
from bert_jax.model.model_config import BertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths, staging as storage_staging


# ---------------------------------------------------------------------------------------------
# Our tree <-> Google's TF1 names
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    google: str  # TF1 variable name
    path: tuple  # path in our parameter tree
    shape: tuple  # our shape
    google_shape: tuple
    transpose: bool = False  # Google stores it transposed relative to ours (NSP output_weights)
    group: str = "bert"  # "bert", "mlm" or "nsp"


def _table(config: BertConfig) -> list[_Entry]:
    """Every parameter of BertForPreTraining with its Google name, for `config`'s shapes."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    nh, hd = config.num_attention_heads, config.head_dim
    t = []

    def add(google, path, shape, google_shape=None, **kw):
        t.append(_Entry(google, tuple(path), tuple(shape), tuple(google_shape or shape), **kw))

    def dense(google, path, shape_in, shape_out, **kw):
        add(f"{google}/kernel", path + ("kernel",), shape_in + shape_out,
            (int(np.prod(shape_in)), int(np.prod(shape_out))), **kw)
        add(f"{google}/bias", path + ("bias",), shape_out, (int(np.prod(shape_out)),), **kw)

    def norm(google, path, **kw):
        add(f"{google}/gamma", path + ("scale",), (h,), **kw)
        add(f"{google}/beta", path + ("bias",), (h,), **kw)

    e = ("bert", "embeddings")
    add("bert/embeddings/word_embeddings", e + ("word_embeddings",), (v, h))
    add("bert/embeddings/token_type_embeddings", e + ("token_type_embeddings",), (config.type_vocab_size, h))
    add("bert/embeddings/position_embeddings", e + ("position_embeddings",),
        (config.max_position_embeddings, h))
    norm("bert/embeddings/LayerNorm", e + ("LayerNorm",))
    for n in range(config.num_hidden_layers):
        g, p = f"bert/encoder/layer_{n}", ("bert", "encoder", f"layer_{n}")
        for qkv in ("query", "key", "value"):
            dense(f"{g}/attention/self/{qkv}", p + ("attention", qkv), (h,), (nh, hd))
        dense(f"{g}/attention/output/dense", p + ("attention", "output"), (nh, hd), (h,))
        norm(f"{g}/attention/output/LayerNorm", p + ("attention", "output_norm"))
        dense(f"{g}/intermediate/dense", p + ("ffn", "intermediate"), (h,), (i,))
        dense(f"{g}/output/dense", p + ("ffn", "output"), (i,), (h,))
        norm(f"{g}/output/LayerNorm", p + ("ffn", "output_norm"))
    dense("bert/pooler/dense", ("bert", "pooler", "dense"), (h,), (h,))
    dense("cls/predictions/transform/dense", ("mlm", "transform"), (h,), (h,), group="mlm")
    norm("cls/predictions/transform/LayerNorm", ("mlm", "transform_norm"), group="mlm")
    add("cls/predictions/output_bias", ("mlm", "output_bias"), (v,), group="mlm")
    add("cls/seq_relationship/output_weights", ("nsp", "dense", "kernel"), (h, 2), (2, h),
        transpose=True, group="nsp")
    add("cls/seq_relationship/output_bias", ("nsp", "dense", "bias"), (2,), group="nsp")
    return t


def to_google(params: dict, config: BertConfig) -> dict[str, np.ndarray]:
    """Our parameters -> `{google_name: float32 array}` in TF1 layout (heads only if present)."""
    params = unrolled(params)
    out = {}
    for e in _table(config):
        if e.group != "bert" and e.group not in params:
            continue
        value = np.asarray(_get(params, e.path), np.float32)
        if value.shape != e.shape:
            raise ValueError(f"parameter {'/'.join(e.path)} has shape {value.shape}, expected {e.shape} "
                             f"for this BertConfig")
        out[e.google] = value.T if e.transpose else value.reshape(e.google_shape)
    return out


def from_google(variables: dict[str, np.ndarray], config: BertConfig, *,
                where: str = "checkpoint") -> tuple[dict, tuple, tuple]:
    """`{google_name: array}` -> (our parameters, missing heads, skipped names).

    The encoder must be complete (a missing variable is an error naming it); a head is taken
    whole or reported missing; names we have no place for are returned as skipped.
    """
    table = _table(config)
    params: dict = {}
    missing_heads = []
    for group in ("bert",) + HEADS:
        entries = [e for e in table if e.group == group]
        absent = [e.google for e in entries if e.google not in variables]
        if group != "bert" and len(absent) == len(entries):
            missing_heads.append(group)
            continue
        if absent:
            raise ValueError(f"{where}: missing {len(absent)} variable(s) of "
                             f"{'the encoder' if group == 'bert' else 'the ' + group + ' head'}: "
                             f"{', '.join(absent[:8])}{' ...' if len(absent) > 8 else ''}")
        for e in entries:
            value = np.asarray(variables[e.google], np.float32)
            if value.shape != e.google_shape:
                raise ValueError(
                    f"{where}: variable {e.google} has shape {value.shape}, but the config "
                    f"(hidden_size={config.hidden_size}, heads={config.num_attention_heads}, "
                    f"intermediate_size={config.intermediate_size}, vocab_size={config.vocab_size}, "
                    f"max_position_embeddings={config.max_position_embeddings}, "
                    f"type_vocab_size={config.type_vocab_size}) wants {e.google_shape}")
            _set(params, e.path, value.T.copy() if e.transpose else value.reshape(e.shape))
    known = {e.google for e in table}
    skipped = tuple(sorted(k for k in variables if k not in known))
    return params, tuple(missing_heads), skipped


# google-research/bert's names of a fine-tuning head's weights [n, hidden] and bias [n], per head kind.
_GOOGLE_HEAD = {"classification": "output", "regression": "output", "token": "output", "span": "cls/squad/output"}


def head_to_google(params: dict, task: dict) -> dict[str, np.ndarray]:
    """The fine-tuning head -> `{google_name: array}` (module docstring); a kind Google never named
    (multiple_choice) is a ValueError that says what to do instead."""
    prefix = _GOOGLE_HEAD.get(task["head"])
    if prefix is None:
        raise ValueError(f"a {task['head']} head has no name in Google's format (google-research/bert has no "
                         f"{task['head']} model): export it with --output_format=hf, or the encoder alone "
                         f"with --drop_heads")
    out = params[TASK_HEAD]["output"]
    return {f"{prefix}_weights": np.ascontiguousarray(np.asarray(out["kernel"], np.float32).T),
            f"{prefix}_bias": np.asarray(out["bias"], np.float32)}


def head_from_google(variables: dict, task: dict) -> Optional[dict]:
    """`params["head"]` from Google's names (`head_to_google`), or None when they are absent."""
    prefix = _GOOGLE_HEAD.get(task["head"])
    if prefix is None or f"{prefix}_weights" not in variables or f"{prefix}_bias" not in variables:
        return None
    return head_output(np.asarray(variables[f"{prefix}_weights"]).T, variables[f"{prefix}_bias"])


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


_GOOGLE_FIELDS = ("attention_probs_dropout_prob", "hidden_act", "hidden_dropout_prob", "hidden_size",
                  "initializer_range", "intermediate_size", "max_position_embeddings",
                  "num_attention_heads", "num_hidden_layers", "type_vocab_size", "vocab_size")


def google_config_dict(config: BertConfig) -> dict:
    """`bert_config.json` in Google's words: every GELU is its `"gelu"`, and `"bert_jax_hidden_act"`
    names which one, so that our import reads it back exactly whatever `google_gelu` says."""
    d = {k: getattr(config, k) for k in _GOOGLE_FIELDS}
    if config.causal_attention:
        raise ValueError("a causal (left-to-right) model has no Google or HF BERT equivalent")
    if config.hidden_act in ("gelu", "gelu_tanh", "gelu_new"):
        d["hidden_act"] = "gelu"
        d["bert_jax_hidden_act"] = config.hidden_act
    if config.hidden_act == "gelu":
        logging.warning("exact-erf GELU model exported in Google's format: google-research/bert's code since "
                        "2019-02-07 runs hidden_act='gelu' as the tanh approximation (bert_jax reads it back "
                        "exactly)")
    return d


def read_google_config(path: str, google_gelu: Optional[str] = None) -> BertConfig:
    """Google's `bert_config.json`; its `"gelu"` read as `google_gelu` says ("erf" by default or
    "tanh"; our export's `bert_jax_hidden_act` marker wins), see `BertConfig.from_dict`."""
    _load_json(path)  # names the file, line and column of bad text
    return BertConfig.from_json_file(path, google_format=True, google_gelu=google_gelu)


# ---------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------


def _google_prefix(path: str) -> Optional[str]:
    """The TF checkpoint prefix at `path` (a prefix itself, or a directory holding one), local or gs://."""
    if storage.isfile(path + ".index"):
        return path
    if storage.isdir(path):
        indexes = storage.glob(storage_paths.join(path, "*.index"))
        if storage.isfile(storage_paths.join(path, "bert_model.ckpt.index")):
            return storage_paths.join(path, "bert_model.ckpt")
        if len(indexes) == 1:
            return indexes[0][: -len(".index")]
        if indexes:  # several: the one the `checkpoint` state file names, else the newest
            state = storage_paths.join(path, "checkpoint")
            if storage.isfile(state):
                m = re.search(r'^model_checkpoint_path:\s*"(.*)"', storage.read_text(state), re.M)
                if m:
                    named = m.group(1)
                    p = (named if storage_paths.is_remote(named) or os.path.isabs(named)
                         else storage_paths.join(path, named))
                    if storage.isfile(p + ".index"):
                        return p
            return max(indexes, key=storage.getmtime)[: -len(".index")]
    return None


def _casing_from_name(path: str) -> Optional[bool]:
    """Google's release names say the casing ("uncased_L-12_H-768_A-12", "cased_L-24_...")."""
    remote = storage_paths.is_remote(path)
    name = (storage_paths.basename(path) if remote else os.path.basename(os.path.normpath(path))).lower()
    if "uncased" in name:
        return True
    if "cased" in name:
        return False
    return None


def _read_tf_checkpoint(prefix: str) -> tuple[dict, list]:
    """(`{name: array}` without optimizer slots and `global_step`, every name in the checkpoint) of
    the TF checkpoint `prefix`; a remote one is read from a local copy of its `.index` and
    `.data-*` files (TensorFlow's own GCS client cannot be pointed at our endpoint)."""
    from data_pipeline.tf_import import tf  # only here: reading TF checkpoints

    def read(local_prefix):
        reader = tf.train.load_checkpoint(local_prefix)  # storage: local (a local prefix, or a tempfile copy)
        names = list(reader.get_variable_to_shape_map())
        variables = {n: reader.get_tensor(n) for n in names
                     if not re.search(r"/(adam_[mv]|Adam(_1)?|LAMB(_1)?|Momentum)$", n) and n != "global_step"}
        return variables, names

    if not storage_paths.is_remote(prefix):
        return read(prefix)
    with tempfile.TemporaryDirectory(prefix="bert_jax_tf_checkpoint_") as tmp:
        local = os.path.join(tmp, storage_paths.basename(prefix))
        for f in [prefix + ".index"] + storage.glob(prefix + ".data-*"):
            storage.copy(f, local + f[len(prefix):])
        return read(local)


def load_google(path: str, google_gelu: Optional[str] = None) -> Pretrained:
    """A Google TF1 checkpoint; `google_gelu` ("erf", the default, or "tanh") says what its "gelu" is."""
    prefix = _google_prefix(path)
    if prefix is None:
        raise FileNotFoundError(f"{path}: no TF checkpoint (*.index) found")
    directory = storage_paths.dirname(prefix)
    config = read_google_config(_require(storage_paths.join(directory, "bert_config.json"), "bert_config.json"),
                                google_gelu)
    variables, names = _read_tf_checkpoint(prefix)
    params, missing, skipped = from_google(variables, config, where=prefix)
    task = read_task(directory)  # a fine-tuned model we exported: its head (else skipped, as any variable)
    head = head_from_google(variables, task) if task is not None else None
    if head is not None:
        params[TASK_HEAD] = head
        check_head(params, task, config, prefix)
        skipped = tuple(k for k in skipped if k not in head_to_google(params, task))
    elif task is not None:
        logging.warning("%s: task.json names a %s head, but the checkpoint has no weights of it", prefix,
                        task["head"])
        task = None
    skipped = tuple(sorted(set(skipped) | (set(names) - set(variables))))
    casing, vocab = _read_casing(directory), _maybe(storage_paths.join(directory, "vocab.txt"))
    if casing is None and vocab:  # the vocabulary says it (a release's folder may be renamed)
        casing = casing_from_vocab(vocab)
    return Pretrained(config, params, vocab,
                      casing if casing is not None else _casing_from_name(directory),
                      "google", missing, skipped, task)


def save_google(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `bert_model.ckpt.{index,data-00000-of-00001}` + `bert_config.json` + `vocab.txt`
    (into a local folder, or gs://: the checkpoint is written locally by TensorFlow, then uploaded),
    and `task.json` beside a fine-tuned model's head (module docstring)."""
    task = task_of(p, path)
    head = head_to_google(p.params, task) if task is not None else {}  # refused before anything is written
    _prepare_dir(path, overwrite)
    variables = {**to_google(p.params, p.config), **head}
    storage.write_text(storage_paths.join(path, "bert_config.json"),
                       json.dumps(google_config_dict(p.config), indent=2, sort_keys=True) + "\n")
    from data_pipeline.tf_import import tf  # only here: writing TF checkpoints

    names = sorted(variables)
    with storage_staging.writing_dir(path) as local:  # the folder itself, or a staging folder uploaded at the end
        prefix = os.path.join(local, "bert_model.ckpt")
        with tf.device("/cpu:0"):
            tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),  # storage: local (writing_dir)
                              tensors=[tf.constant(variables[n]) for n in names])
    storage.write_text(storage_paths.join(path, "checkpoint"),
                       'model_checkpoint_path: "bert_model.ckpt"\nall_model_checkpoint_paths: "bert_model.ckpt"\n')
    _write_tokenizer_files(p, path)
    write_task(task, path)
    return path
