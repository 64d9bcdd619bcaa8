"""ModernBERT in transformers' format: `config.json` + `model.safetensors`, read and written.

transformers' names (`model.layers.3.attn.Wqkv.weight`, `[out, in]` weights) map one to one onto
`bert_jax.model.modernbert`'s parameters (`[in, out]` kernels). Layer 0 has no `attn_norm`; the MLM
decoder's weight is the token embedding (transformers drops `decoder.weight` when it saves: tied),
its bias is `decoder.bias`. What `write` produces `transformers.AutoModelForMaskedLM` loads as
`ModernBertForMaskedLM` (tests/model/test_modernbert.py).
"""

from __future__ import annotations

import json
import os

import numpy as np
import safetensors.numpy

from bert_jax.model.modernbert import ModernBertConfig
from data_pipeline import storage

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def names(config: ModernBertConfig) -> list[tuple[str, tuple, bool]]:
    """Every parameter: (transformers' name, our path in the params tree, transposed)."""
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
    if config.decoder_bias:
        table.append(("decoder.bias", ("decoder_bias",), False))
    return table


def from_hf(tensors: dict, config: ModernBertConfig, where: str = "checkpoint") -> dict:
    """transformers' tensors -> our params tree (float32). Missing or unexpected names are errors that name them."""
    params: dict = {}
    table = names(config)
    expected = {hf for hf, _, _ in table}
    tied = {"decoder.weight"}  # the token embedding again, when a writer kept it
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


def to_hf(params: dict, config: ModernBertConfig) -> dict:
    out = {}
    for hf, path, transposed in names(config):
        value = params
        for key in path:
            value = value[key]
        value = np.asarray(value, np.float32)
        out[hf] = np.ascontiguousarray(value.T if transposed else value)
    return out


def load(directory: str, **ours) -> tuple[ModernBertConfig, dict]:
    """(config, params) from a transformers ModernBERT folder (local or gs://)."""
    config_path = os.path.join(directory, CONFIG)
    if not storage.exists(config_path):
        raise FileNotFoundError(f"{config_path}: no config.json (a transformers ModernBERT folder has one)")
    config = ModernBertConfig.from_hf_dict(json.loads(storage.read_text(config_path)), **ours)
    weights = os.path.join(directory, WEIGHTS)
    if not storage.exists(weights):
        raise FileNotFoundError(f"{weights}: no model.safetensors")
    return config, from_hf(safetensors.numpy.load(storage.read_bytes(weights)), config, where=weights)


def save(directory: str, config: ModernBertConfig, params: dict) -> None:
    """Writes `config.json` + `model.safetensors` that transformers loads as `ModernBertForMaskedLM`."""
    storage.makedirs(directory)
    storage.write_bytes(os.path.join(directory, WEIGHTS),
                        safetensors.numpy.save(to_hf(params, config), metadata={"format": "pt"}))
    storage.write_text(os.path.join(directory, CONFIG), json.dumps(config.to_hf_dict(), indent=2, sort_keys=True))

