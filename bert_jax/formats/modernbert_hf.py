"""ModernBERT in transformers' format: `config.json` + `model.safetensors`, read and written.

transformers' names (`model.layers.3.attn.Wqkv.weight`, `[out, in]` weights) map one to one onto
`bert_jax.model.modernbert`'s parameters (`[in, out]` kernels). Layer 0 has no `attn_norm`; the MLM
decoder's weight is the token embedding (transformers drops `decoder.weight` when it saves: tied),
its bias is `decoder.bias`. What `write` produces `transformers.AutoModelForMaskedLM` loads as
`ModernBertForMaskedLM` (tests/model/test_modernbert.py).

A ModernBERT pretraining workdir (`config.model_family="modernbert"`) holds `modernbert_config.json`
(`workdir_config_json`: this `config.json` and, under "bert_jax", the fields transformers has no key
for) beside its orbax `checkpoints/`; `load_workdir` reads its newest intact step's parameters, which
`bert_jax.convert --output_format=hf` writes with `save`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np
import safetensors.numpy

from bert_jax.model.modernbert import TASK_CLASSES, ModernBertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

CONFIG, WEIGHTS = "config.json", "model.safetensors"
# ModernBertConfig's fields transformers' config.json has no key for (a workdir keeps them under "bert_jax").
OWN_FIELDS = ("dtype", "attention_impl", "local_blocks")


def names(config: ModernBertConfig, kind: Optional[str] = None) -> list[tuple[str, tuple, bool]]:
    """Every parameter: (transformers' name, our path in the params tree, transposed), of the MLM model
    (`kind` None) or of a task model (`ModernBertForTask`'s kinds: a `classifier` with a bias instead of
    the decoder's bias)."""
    table = [("model.embeddings.tok_embeddings.weight", ("model", "tok_embeddings", "embedding"), False)]
    norms = lambda hf, ours: [(f"{hf}.weight", (*ours, "scale"), False)] + (  # noqa: E731
        [(f"{hf}.bias", (*ours, "bias"), False)] if config.norm_bias else [])
    dense = lambda hf, ours, bias: [(f"{hf}.weight", (*ours, "kernel"), True)] + (  # noqa: E731
        [(f"{hf}.bias", (*ours, "bias"), False)] if bias else [])
    table += norms("model.embeddings.norm", ("model", "embedding_norm"))
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", ("model", f"layers_{i}")
        if i:
            table += norms(f"{hf}.attn_norm", (*ours, "attn_norm"))
        table += dense(f"{hf}.attn.Wqkv", (*ours, "attn", "Wqkv"), config.attention_bias)
        table += dense(f"{hf}.attn.Wo", (*ours, "attn", "Wo"), config.attention_bias)
        table += norms(f"{hf}.mlp_norm", (*ours, "mlp_norm"))
        table += dense(f"{hf}.mlp.Wi", (*ours, "mlp", "Wi"), config.mlp_bias)
        table += dense(f"{hf}.mlp.Wo", (*ours, "mlp", "Wo"), config.mlp_bias)
    table += norms("model.final_norm", ("model", "final_norm"))
    table += dense("head.dense", ("head", "dense"), config.classifier_bias)
    table += norms("head.norm", ("head", "norm"))
    if kind is not None:
        table += dense("classifier", ("classifier",), True)
    elif config.decoder_bias:
        table.append(("decoder.bias", ("decoder_bias",), False))
    return table


def from_hf(tensors: dict, config: ModernBertConfig, where: str = "checkpoint", kind: Optional[str] = None) -> dict:
    """transformers' tensors -> our params tree (float32). Missing or unexpected names are errors that name them."""
    params: dict = {}
    table = names(config, kind)
    expected = {hf for hf, _, _ in table}
    tied = {"decoder.weight"} if kind is None else set()  # the token embedding again, when a writer kept it
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected - tied)
    if missing or unexpected:
        raise ValueError(f"{where}: not the ModernBERT of its config.json: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    if "decoder.weight" in tensors and not np.array_equal(
            tensors["decoder.weight"], tensors["model.embeddings.tok_embeddings.weight"]):
        raise ValueError(f"{where}: decoder.weight differs from the token embedding (an untied decoder is not "
                         "supported)")
    for hf, path, transposed in table:
        value = np.asarray(tensors[hf], np.float32)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value.T if transposed else value
    return params


def to_hf(params: dict, config: ModernBertConfig, kind: Optional[str] = None) -> dict:
    out = {}
    for hf, path, transposed in names(config, kind):
        value = params
        for key in path:
            value = value[key]
        value = np.asarray(value, np.float32)
        out[hf] = np.ascontiguousarray(value.T if transposed else value)
    return out


def task_of(d: dict, where: str) -> Optional[dict]:
    """A task model's `config.json` -> `{"kind", "num_outputs", "labels"}`; None for the MLM model."""
    by_class = {cls: kind for kind, cls in TASK_CLASSES.items()}
    arch = (d.get("architectures") or ["ModernBertForMaskedLM"])[0]
    if arch in ("ModernBertForMaskedLM", "ModernBertModel"):
        return None
    if arch not in by_class:
        raise ValueError(f"{where}: architectures={d.get('architectures')}: not a ModernBERT model transformers defines")
    kind = by_class[arch]
    id2label = d.get("id2label") or {}
    labels = [id2label[k] for k in sorted(id2label, key=int)] if id2label else []
    num = int(d.get("num_labels", len(labels) or 2))
    if kind == "span":
        num = 2
    return {"kind": kind, "num_outputs": 1 if kind == "multiple_choice" else num,
            "labels": [] if all(re.fullmatch(r"LABEL_\d+", x) for x in labels) else labels}


def load(directory: str, **ours) -> tuple[ModernBertConfig, dict, Optional[dict]]:
    """(config, params, task) from a transformers ModernBERT folder (local or gs://); task None: the MLM model."""
    config_path = os.path.join(directory, CONFIG)
    if not storage.exists(config_path):
        raise FileNotFoundError(f"{config_path}: no config.json (a transformers ModernBERT folder has one)")
    d = json.loads(storage.read_text(config_path))
    config = ModernBertConfig.from_hf_dict(d, **ours)
    task = task_of(d, config_path)
    weights = os.path.join(directory, WEIGHTS)
    if not storage.exists(weights):
        raise FileNotFoundError(f"{weights}: no model.safetensors")
    params = from_hf(safetensors.numpy.load(storage.read_bytes(weights)), config, where=weights,
                     kind=task and task["kind"])
    return config, params, task


def save(directory: str, config: ModernBertConfig, params: dict, task: Optional[dict] = None) -> None:
    """Writes `config.json` + `model.safetensors` that transformers loads as `ModernBertForMaskedLM`, or, with
    `task` (`{"kind", "num_outputs", "labels"}`), as the matching `ModernBertFor...` class."""
    d = config.to_hf_dict()
    kind = task and task["kind"]
    if task is not None:
        if kind not in TASK_CLASSES:
            raise ValueError(f"task kind {kind!r}: one of {sorted(TASK_CLASSES)}")
        num = {"span": 2, "multiple_choice": 1}.get(kind, task["num_outputs"])
        labels = list(task.get("labels") or []) or [f"LABEL_{i}" for i in range(num)]
        d.update(architectures=[TASK_CLASSES[kind]], num_labels=num, id2label={str(i): x for i, x in enumerate(labels)},
                 label2id={x: i for i, x in enumerate(labels)})
        if kind == "sequence" and num == 1:
            d["problem_type"] = "regression"
    storage.makedirs(directory)
    storage.write_bytes(os.path.join(directory, WEIGHTS),
                        safetensors.numpy.save(to_hf(params, config, kind), metadata={"format": "pt"}))
    storage.write_text(os.path.join(directory, CONFIG), json.dumps(d, indent=2, sort_keys=True))


def workdir_config_json(config: ModernBertConfig) -> bytes:
    """A pretraining workdir's `modernbert_config.json`: transformers' `config.json` + `{"bert_jax": OWN_FIELDS}`."""
    d = dict(config.to_hf_dict(), bert_jax={k: getattr(config, k) for k in OWN_FIELDS})
    return json.dumps(d, indent=2, sort_keys=True).encode()


def is_workdir(directory: str) -> bool:
    from bert_jax import layout
    return storage.isfile(os.path.join(directory, layout.MODERNBERT_CONFIG))


def load_workdir(directory: str) -> tuple[ModernBertConfig, dict, int]:
    """(config, params, step) of a ModernBERT pretraining workdir: its newest intact checkpoint's parameters."""
    import orbax.checkpoint as ocp

    from bert_jax import layout
    from bert_jax.checkpoints import saved_state
    d = json.loads(storage.read_text(os.path.join(directory, layout.MODERNBERT_CONFIG)))
    config = ModernBertConfig.from_hf_dict(d, **d.get("bert_jax", {}))
    ckpt_dir = storage_paths.join(directory, layout.CHECKPOINTS)
    steps = sorted(int(x) for x in storage.listdir(ckpt_dir) if x.isdigit()
                   and storage.isdir(storage_paths.join(ckpt_dir, x, "state"))) if storage.isdir(ckpt_dir) else []
    step = saved_state.newest_intact_step(ckpt_dir, steps)
    if step is None:
        raise FileNotFoundError(f"{directory}: no committed checkpoints/<step>/state to export")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(storage_paths.abspath(storage_paths.join(ckpt_dir, str(step), "state")))
    params = jax_free(tree["params"])
    from_hf(to_hf(params, config), config, where=f"{ckpt_dir}/{step}")  # every tensor present, none extra
    return config, params, step


def jax_free(tree):
    """Nested dicts of numpy float32 arrays."""
    if isinstance(tree, dict):
        return {k: jax_free(v) for k, v in tree.items()}
    return np.asarray(tree, np.float32)
