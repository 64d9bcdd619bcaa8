"""HuggingFace checkpoints: names, config, read, write.

On disk: `config.json` + `model.safetensors` (or `model.safetensors.index.json` shards, or
`flax_model.msgpack`) + `vocab.txt` + `tokenizer_config.json`. A PyTorch `pytorch_model.bin` is read
only through `torch.load(weights_only=True)`, never unpickled otherwise. Writes are safetensors.

HF's PyTorch names (`bert.encoder.layer.3.attention.self.query.weight`, `[out, in]` weights) are
derived from Google's (`bert_jax.formats.google`) by rule, as HF's own TF->PT converter does. HF's
Flax `flax_model.msgpack` names are mapped to the PyTorch names first (`kernel` -> transposed
`weight`, `embedding`/`scale` -> `weight`).

A fine-tuned model (a `Pretrained` with a task head) is written as transformers' matching class:
classification and regression heads as `BertForSequenceClassification`, token as
`BertForTokenClassification`, multiple_choice as `BertForMultipleChoice` (all `classifier.weight`
[n, hidden] / `classifier.bias`) and span as `BertForQuestionAnswering` (`qa_outputs.*`, start
logits first); `config.json` says the class, `num_labels`, the labels (`id2label`/`label2id`),
`problem_type` and `finetuning_task`. Reading such a checkpoint takes its head back by the same
rules (HF's default `LABEL_i` names read as no labels).
"""

from __future__ import annotations

import json
import re
from typing import Optional, Sequence

import numpy as np
from absl import logging

from bert_jax.formats.common import (HEADS, TASK_HEAD, Pretrained, _load_json, _maybe, _prepare_dir, _read_casing,
                                     _require, _set, _write_tokenizer_files, casing_from_vocab, check_head,
                                     check_task, head_output, task_of)
from bert_jax.formats.google import _GOOGLE_FIELDS, _table, from_google, to_google
from bert_jax.model.model_config import BertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths, staging as storage_staging


# ---------------------------------------------------------------------------------------------
# Google names <-> HuggingFace (PyTorch) names
# ---------------------------------------------------------------------------------------------


def hf_name(google: str) -> tuple[str, bool]:
    """Google's TF1 name -> (HF PyTorch name, whether the array is transposed)."""
    special = {"cls/predictions/output_bias": "cls.predictions.bias",
               "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",
               "cls/seq_relationship/output_bias": "cls.seq_relationship.bias"}
    if google in special:
        return special[google], False
    name = re.sub(r"layer_(\d+)", r"layer.\1", google).replace("/", ".")
    if name.endswith("_embeddings"):
        return name + ".weight", False
    for old, new in ((".gamma", ".weight"), (".beta", ".bias"), (".kernel", ".weight")):
        if name.endswith(old):
            return name[: -len(old)] + new, old == ".kernel"
    return name, False


# The fine-tuning head in transformers: its class and the module holding its dense layer.
_HF_HEAD = {"classification": ("BertForSequenceClassification", "classifier"),
            "regression": ("BertForSequenceClassification", "classifier"),
            "token": ("BertForTokenClassification", "classifier"),
            "multiple_choice": ("BertForMultipleChoice", "classifier"),
            "span": ("BertForQuestionAnswering", "qa_outputs")}


def to_hf(params: dict, config: BertConfig, task: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Our parameters -> `{hf_name: array}` as in transformers' PyTorch `BertForPreTraining`, or,
    with a fine-tuning head (`params["head"]`, which `task` describes), its task class."""
    out = {}
    for google, value in to_google(params, config).items():
        name, transpose = hf_name(google)
        out[name] = np.ascontiguousarray(value.T if transpose else value)
    if TASK_HEAD in params:
        if task is None:
            raise ValueError("a fine-tuning head needs its task (Pretrained.task) to be named")
        module = _HF_HEAD[task["head"]][1]
        head = params[TASK_HEAD]["output"]
        out[f"{module}.weight"] = np.ascontiguousarray(np.asarray(head["kernel"], np.float32).T)  # [n, hidden]
        out[f"{module}.bias"] = np.asarray(head["bias"], np.float32)
    return out


def _normalize_hf_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF variants -> `bert.`-prefixed PyTorch names with `.weight`/`.bias` LayerNorms."""
    bare = not any(k.startswith("bert.") for k in tensors)
    out = {}
    for name, value in tensors.items():
        if name.endswith(".gamma"):
            name = name[: -len(".gamma")] + ".weight"
        elif name.endswith(".beta"):
            name = name[: -len(".beta")] + ".bias"
        if bare and name.split(".")[0] in ("embeddings", "encoder", "pooler"):
            name = "bert." + name
        out[name] = value
    return out


def from_hf(tensors: dict[str, np.ndarray], config: BertConfig, *, where: str = "checkpoint",
            task: Optional[dict] = None) -> tuple[dict, tuple, tuple]:
    """`{hf_name: array}` (BertForPreTraining, BertModel, old gamma/beta names) -> like `from_google`;
    with `task` (`hf_task`), the task class's head too (`params["head"]`, when the tensors have it)."""
    tensors = _normalize_hf_names(tensors)
    head = None
    if task is not None:
        module = _HF_HEAD[task["head"]][1]
        weight, bias = tensors.get(f"{module}.weight"), tensors.get(f"{module}.bias")
        if weight is not None and bias is not None:
            head = head_output(np.asarray(weight, np.float32).T, bias)
            tensors = {k: v for k, v in tensors.items() if k not in (f"{module}.weight", f"{module}.bias")}
    by_hf = {hf_name(e.google)[0]: (e.google, hf_name(e.google)[1]) for e in _table(config)}
    variables, unknown = {}, []
    for name, value in tensors.items():
        if name in by_hf:
            google, transpose = by_hf[name]
            value = np.asarray(value, np.float32)
            variables[google] = value.T if transpose else value
        else:
            unknown.append(name)
    decoder = tensors.get("cls.predictions.decoder.weight")
    if decoder is not None and "bert.embeddings.word_embeddings.weight" in tensors and not np.array_equal(
            np.asarray(decoder, np.float32), np.asarray(tensors["bert.embeddings.word_embeddings.weight"], np.float32)):
        logging.warning("%s: cls.predictions.decoder.weight differs from the word embeddings; BERT ties "
                        "them, so the decoder matrix is dropped", where)
    params, missing, _ = from_google(variables, config, where=where)
    if head is not None:
        params[TASK_HEAD] = head
        check_head(params, task, config, where)
    return params, missing, tuple(sorted(unknown))


def flax_to_hf_names(tree: dict) -> dict[str, np.ndarray]:
    """HF Flax parameter tree (`flax_model.msgpack`) -> PyTorch-style names and layouts."""
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, prefix + (str(k),))
                continue
            v = np.asarray(v)
            name, leaf = ".".join(prefix), str(k)
            if leaf == "kernel":
                out[f"{name}.weight"] = v.T
            elif leaf in ("embedding", "scale"):
                out[f"{name}.weight"] = v
            else:
                out[f"{name}.{leaf}"] = v

    walk(tree, ())
    return out


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _hf_labels(task: dict) -> list[str]:
    n = task["num_outputs"] if task["head"] != "span" else 2
    labels = [str(label) for label in task["labels"]]
    return labels if len(labels) == n else [f"LABEL_{i}" for i in range(n)]  # HF's own default names


def hf_config_dict(config: BertConfig, heads: Sequence[str], task: Optional[dict] = None) -> dict:
    """`config.json` for transformers: `BertForPreTraining` (both pretraining heads), `BertModel`,
    or with `task` (a fine-tuned model) its task class, labels and problem type (module docstring)."""
    if config.causal_attention:
        raise ValueError("a causal (left-to-right) model has no Google or HF BERT equivalent")
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "gelu_new": "gelu_new", "relu": "relu"}[config.hidden_act]
    d = {k: getattr(config, k) for k in _GOOGLE_FIELDS}
    d.update(hidden_act=act, layer_norm_eps=config.layer_norm_eps, model_type="bert", pad_token_id=0,
             position_embedding_type="absolute",
             architectures=["BertForPreTraining" if set(heads) == set(HEADS) else "BertModel"])
    if task is not None:
        labels = _hf_labels(task)
        d.update(architectures=[_HF_HEAD[task["head"]][0]], num_labels=len(labels),
                 id2label={str(i): label for i, label in enumerate(labels)},
                 label2id={label: i for i, label in enumerate(labels)})
        if task["head"] in ("classification", "regression"):
            d["problem_type"] = "regression" if task["head"] == "regression" else "single_label_classification"
        if task.get("task"):
            d["finetuning_task"] = task["task"]
    return d


def hf_task(d: dict, where: str) -> Optional[dict]:
    """The task (`common.check_task`) of an HF `config.json` dict whose architecture is a task class
    we have a head for, else None. A sequence classifier is a regression when its `problem_type`
    says so, or with one label and no `problem_type` (HF's own rule)."""
    arch = next(iter(d.get("architectures") or []), "")
    arch = arch[len("Flax"):] if arch.startswith("Flax") else arch[len("TF"):] if arch.startswith("TF") else arch
    kinds = {cls: kind for kind, (cls, _) in _HF_HEAD.items() if kind != "regression"}  # a classifier, then:
    if arch not in kinds:
        return None
    id2label = d.get("id2label") or {}
    labels = [id2label[k] for k in sorted(id2label, key=int)] if id2label else []
    n = int(d.get("num_labels") or len(labels) or 2)
    kind = kinds[arch]
    if kind == "classification" and (d.get("problem_type") == "regression"
                                      or (d.get("problem_type") is None and n == 1)):
        kind = "regression"
    if kind == "classification" and d.get("problem_type") == "multi_label_classification":
        logging.warning("%s: a multi-label classifier (sigmoid per label) is read as a single-label one", where)
    if labels == [f"LABEL_{i}" for i in range(len(labels))] or len(labels) != n or kind in ("regression", "span"):
        labels = []  # HF's default names: the checkpoint says nothing about its labels
    try:
        return check_task({"task": d.get("finetuning_task"), "head": kind,
                           "num_outputs": 2 if kind == "span" else n, "labels": labels}, where)
    except ValueError as e:  # e.g. a multi-output regression: the encoder still loads, the head is skipped
        logging.warning("%s; its head is skipped", e)
        return None


def _read_hf_config(path: str) -> BertConfig:
    return _read_hf_config_and_task(path)[0]


def _read_hf_config_and_task(path: str) -> tuple[BertConfig, Optional[dict]]:
    config_path = _require(storage_paths.join(path, "config.json"), "config.json")
    d = _load_json(config_path)
    if d.get("model_type", "bert") != "bert":
        raise ValueError(f"{config_path}: model_type={d.get('model_type')!r}, expected 'bert'")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{config_path}: position_embedding_type={d['position_embedding_type']!r} "
                         f"is not supported (BERT uses 'absolute')")
    # HF's names for the two GELUs (both tanh variants are the same formula).
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python": "gelu"}
    try:
        config = BertConfig.from_dict({**d, "hidden_act": act.get(d.get("hidden_act"), d.get("hidden_act", "gelu"))})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {e}") from e
    return config, hf_task(d, config_path)


# ---------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------


_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "flax_model.msgpack", "pytorch_model.bin")


def _read_hf_tensors(directory: str) -> dict[str, np.ndarray]:
    def read_safetensors(path, promised=(), index=None):
        from safetensors import SafetensorError, safe_open
        out = {}
        local = storage_staging.local_copy(path)  # the file itself, or a cached download of a gs:// one
        try:
            try:
                with safe_open(local, framework="np") as f:  # storage: local (storage_staging.local_copy)
                    flax_names = (f.metadata() or {}).get("format") == "flax"
                    for k in f.keys():
                        out[k] = f.get_tensor(k)
            except (TypeError, ValueError):  # bfloat16 has no numpy dtype: read through jax
                with safe_open(local, framework="flax") as f:  # storage: local (storage_staging.local_copy)
                    flax_names = (f.metadata() or {}).get("format") == "flax"
                    for k in f.keys():
                        out[k] = np.asarray(f.get_tensor(k), np.float32)
        except SafetensorError as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e}); a truncated or damaged "
                             "download?") from None
        absent = [k for k in promised if k not in out]
        if absent:  # else a head missing whole would read as a checkpoint without that head
            raise ValueError(f"{path}: missing {len(absent)} tensor(s) that {index} puts in it: "
                             f"{', '.join(absent[:8])}{' ...' if len(absent) > 8 else ''}")
        if flax_names:  # written by a transformers Flax model: Flax leaf names and layouts
            tree: dict = {}
            for k, v in out.items():
                _set(tree, tuple(k.split(".")), v)
            return flax_to_hf_names(tree)
        return out

    p = storage_paths.join(directory, "model.safetensors")
    if storage.isfile(p):
        return read_safetensors(p)
    p = storage_paths.join(directory, "model.safetensors.index.json")
    if storage.isfile(p):
        index = _load_json(p)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f'{p}: no "weight_map" (tensor name -> shard file): not a safetensors index')
        by_shard: dict = {}
        for tensor, name in weight_map.items():
            by_shard.setdefault(name, []).append(tensor)
        out = {}
        for name in sorted(by_shard):
            shard = storage_paths.join(directory, name)
            if not storage.isfile(shard):
                raise FileNotFoundError(f"{p} names shard {name}, which is not in {directory}: an "
                                        "incomplete download?")
            out.update(read_safetensors(shard, by_shard[name], p))
        return out
    p = storage_paths.join(directory, "flax_model.msgpack")
    if storage.isfile(p):
        from flax import serialization
        tree = serialization.msgpack_restore(storage.read_bytes(p))
        return flax_to_hf_names(tree)
    p = storage_paths.join(directory, "pytorch_model.bin")
    if storage.isfile(p):
        try:
            import torch
        except ImportError:
            raise ValueError(
                f"{p} is a PyTorch pickle and torch is not installed. bert_jax never unpickles files "
                f"itself: install torch (the file is then read with torch.load(weights_only=True)), or "
                f"convert it to model.safetensors where torch is available, e.g. "
                f"transformers.BertModel.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
            ) from None
        with storage.open(p, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)  # storage: local (a file storage opened)
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(f"{directory}: no model.safetensors, flax_model.msgpack or pytorch_model.bin")


def load_hf(path: str) -> Pretrained:
    config, task = _read_hf_config_and_task(path)
    params, missing, skipped = from_hf(_read_hf_tensors(path), config, where=path, task=task)
    if task is not None and TASK_HEAD not in params:
        logging.warning("%s: config.json names a %s head, but the weights have none", path, task["head"])
        task = None
    vocab, casing = _maybe(storage_paths.join(path, "vocab.txt")), _read_casing(path)
    if casing is None and vocab:  # no tokenizer_config.json: the vocabulary says it
        casing = casing_from_vocab(vocab)
    return Pretrained(config, params, vocab, casing, "hf", missing, skipped, task)


def save_hf(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `config.json` + `model.safetensors` (PyTorch names) + `vocab.txt` + `tokenizer_config.json`;
    a fine-tuned model as its transformers task class (module docstring)."""
    from safetensors.numpy import save

    task = task_of(p, path)
    _prepare_dir(path, overwrite)
    storage.write_bytes(storage_paths.join(path, "model.safetensors"),
                        save(to_hf(p.params, p.config, task), metadata={"format": "pt"}))
    storage.write_text(storage_paths.join(path, "config.json"),
                       json.dumps(hf_config_dict(p.config, p.heads, task), indent=2, sort_keys=True) + "\n")
    _write_tokenizer_files(p, path)
    return path
