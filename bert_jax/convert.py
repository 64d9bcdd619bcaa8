"""Checkpoint interop: Google TF1 <-> bert_jax <-> HuggingFace, and the conversion CLI.

    python -m bert_jax.convert --input=uncased_L-12_H-768_A-12 --output=/tmp/bert_base \\
        [--input_format=google|hf|bert_jax] --output_format=bert_jax|hf|google [--google_gelu=erf|tanh]

Every format passes through one in-memory form, `Pretrained`: a `BertConfig`, the parameters as
numpy float32 in `BertForPreTraining`'s layout with unrolled layers (`bert/encoder/layer_{i}`; the
"mlm" and "nsp" heads absent when the checkpoint has none), the vocab file and the casing.

Name mapping is one table: our tree <-> Google's TF1 variable names (`bert/encoder/layer_3/attention/
self/query/kernel`, `[in, out]` kernels) <-> HuggingFace's PyTorch names (`bert.encoder.layer.3.
attention.self.query.weight`, `[out, in]` weights), the latter derived from the former by rule, as
HF's own TF->PT converter does. HF's Flax `flax_model.msgpack` names are mapped to the PyTorch names
first (`kernel` -> transposed `weight`, `embedding`/`scale` -> `weight`).

Formats on disk:

* google: `bert_model.ckpt.{index,data-*}` + `bert_config.json` + `vocab.txt`; read with
  `tf.train.load_checkpoint` (tensorflow is imported here only, lazily). Google's `"gelu"` is
  ambiguous: google-research/bert computed the exact erf GELU until 2019-02-07 (the 2018 releases
  were trained with it) and the tanh approximation since. `google_gelu` (`--google_gelu`) says which
  to read: `"erf"` (default) or `"tanh"`; a line in the log says which was taken (see
  docs/checkpoints.md). Exports write `"gelu"` plus `"bert_jax_hidden_act"` naming our exact
  activation, which Google's code ignores and our import honours over `google_gelu` (Google's
  current TF1 code runs `"gelu"` as the tanh approximation: exporting an erf model warns so).
* hf: `config.json` + `model.safetensors` (or `model.safetensors.index.json` shards, or
  `flax_model.msgpack`) + `vocab.txt` + `tokenizer_config.json`. A PyTorch `pytorch_model.bin` is
  read only through `torch.load(weights_only=True)`, never unpickled otherwise.
* bert_jax: one directory with `bert_config.json`, `vocab.txt`, `tokenizer_config.json` and
  `params/` (an orbax checkpoint of the parameter tree); a pretraining or fine-tuning workdir
  (`checkpoints/<step>/state`) is read too (its newest committed step).

Encoder-only checkpoints report the missing heads; variables we have no place for (optimizer slots,
`global_step`, fine-tuning heads, HF's `position_ids` buffer) are listed and skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging as std_logging
import os
import re
import shutil
from typing import Optional, Sequence

import numpy as np
from absl import logging

from bert_jax.modeling import DEFAULT_GOOGLE_GELU, GOOGLE_GELUS, BertConfig

FORMATS = ("bert_jax", "google", "hf")
HEADS = ("mlm", "nsp")


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

    @property
    def heads(self) -> tuple:
        return tuple(h for h in HEADS if h in self.params)


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


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _has(tree: dict, path: tuple) -> bool:
    try:
        _get(tree, path)
        return True
    except (KeyError, TypeError):
        return False


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


def to_hf(params: dict, config: BertConfig) -> dict[str, np.ndarray]:
    """Our parameters -> `{hf_name: array}` as in transformers' PyTorch `BertForPreTraining`."""
    out = {}
    for google, value in to_google(params, config).items():
        name, transpose = hf_name(google)
        out[name] = np.ascontiguousarray(value.T if transpose else value)
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


def from_hf(tensors: dict[str, np.ndarray], config: BertConfig, *,
            where: str = "checkpoint") -> tuple[dict, tuple, tuple]:
    """`{hf_name: array}` (BertForPreTraining, BertModel, old gamma/beta names) -> like `from_google`."""
    tensors = _normalize_hf_names(tensors)
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
# Configs
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


def _load_json(path: str):
    from data_pipeline.tasks import read_json  # names the file, line and column of bad text
    return read_json(path)


def tokenizer_config_json(do_lower_case: bool) -> str:
    """`tokenizer_config.json`'s text: the casing, which this module and HF's BertTokenizer read."""
    return json.dumps({"do_lower_case": bool(do_lower_case), "tokenizer_class": "BertTokenizer"}, indent=2) + "\n"


def read_google_config(path: str, google_gelu: Optional[str] = None) -> BertConfig:
    """Google's `bert_config.json`; its `"gelu"` read as `google_gelu` says ("erf" by default or
    "tanh"; our export's `bert_jax_hidden_act` marker wins), see `BertConfig.from_dict`."""
    _load_json(path)  # names the file, line and column of bad text
    return BertConfig.from_json_file(path, google_format=True, google_gelu=google_gelu)


def hf_config_dict(config: BertConfig, heads: Sequence[str]) -> dict:
    if config.causal_attention:
        raise ValueError("a causal (left-to-right) model has no Google or HF BERT equivalent")
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "gelu_new": "gelu_new", "relu": "relu"}[config.hidden_act]
    d = {k: getattr(config, k) for k in _GOOGLE_FIELDS}
    d.update(hidden_act=act, layer_norm_eps=config.layer_norm_eps, model_type="bert", pad_token_id=0,
             position_embedding_type="absolute",
             architectures=["BertForPreTraining" if set(heads) == set(HEADS) else "BertModel"])
    return d


# ---------------------------------------------------------------------------------------------
# Format detection and loading
# ---------------------------------------------------------------------------------------------

_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "flax_model.msgpack", "pytorch_model.bin")


def _google_prefix(path: str) -> Optional[str]:
    """The TF checkpoint prefix at `path` (a prefix itself, or a directory holding one)."""
    if os.path.isfile(path + ".index"):
        return path
    if os.path.isdir(path):
        indexes = sorted(glob.glob(os.path.join(path, "*.index")))
        if os.path.isfile(os.path.join(path, "bert_model.ckpt.index")):
            return os.path.join(path, "bert_model.ckpt")
        if len(indexes) == 1:
            return indexes[0][: -len(".index")]
        if indexes:  # several: the one the `checkpoint` state file names, else the newest
            state = os.path.join(path, "checkpoint")
            if os.path.isfile(state):
                m = re.search(r'^model_checkpoint_path:\s*"(.*)"', open(state, encoding="utf-8").read(), re.M)
                if m:
                    p = m.group(1) if os.path.isabs(m.group(1)) else os.path.join(path, m.group(1))
                    if os.path.isfile(p + ".index"):
                        return p
            return max(indexes, key=os.path.getmtime)[: -len(".index")]
    return None


def _step_dirs(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory)
                  if d.isdigit() and os.path.isdir(os.path.join(directory, d, "state")))


def _bert_jax_source(path: str) -> Optional[tuple[str, str]]:
    """(kind, path): ("params", DIR/params) for an export, ("state", DIR/<step>/state) for a workdir."""
    if os.path.isdir(os.path.join(path, "params")):
        return "params", os.path.join(path, "params")
    for ckpt_dir in (os.path.join(path, "checkpoints"), path):
        steps = _step_dirs(ckpt_dir)
        if steps:
            return "state", os.path.join(ckpt_dir, str(steps[-1]), "state")
    return None


def detect_format(path: str) -> str:
    """"bert_jax", "google" or "hf" from the files at `path`; a clear error otherwise."""
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, w)) for w in _HF_WEIGHTS) \
            and os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if _google_prefix(path):
        return "google"
    if os.path.isdir(path) and _bert_jax_source(path):
        return "bert_jax"
    if not os.path.exists(path) and not os.path.exists(path + ".index"):
        raise FileNotFoundError(f"checkpoint {path}: no such file or directory")
    found = sorted(os.listdir(path))[:20] if os.path.isdir(path) else [os.path.basename(path)]
    raise ValueError(
        f"checkpoint {path}: format not recognized (found {found}). Expected a Google TF1 checkpoint "
        f"(bert_model.ckpt.index + bert_config.json), a HuggingFace directory (config.json + "
        f"model.safetensors or flax_model.msgpack) or a bert_jax directory (params/ or checkpoints/ + "
        f"bert_config.json)")


def _casing_from_name(path: str) -> Optional[bool]:
    """Google's release names say the casing ("uncased_L-12_H-768_A-12", "cased_L-24_...")."""
    name = os.path.basename(os.path.normpath(path)).lower()
    if "uncased" in name:
        return True
    if "cased" in name:
        return False
    return None


def _read_casing(directory: str) -> Optional[bool]:
    p = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(p):
        value = _load_json(p)
        value = value.get("do_lower_case") if isinstance(value, dict) else None
        if isinstance(value, bool):
            return value
    return None


def _maybe(path: str) -> Optional[str]:
    return path if os.path.isfile(path) else None


def _require(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: {what} not found")
    return path


def load_google(path: str, google_gelu: Optional[str] = None) -> Pretrained:
    """A Google TF1 checkpoint; `google_gelu` ("erf", the default, or "tanh") says what its "gelu" is."""
    prefix = _google_prefix(path)
    if prefix is None:
        raise FileNotFoundError(f"{path}: no TF checkpoint (*.index) found")
    directory = os.path.dirname(prefix)
    config = read_google_config(_require(os.path.join(directory, "bert_config.json"), "bert_config.json"),
                                google_gelu)
    import tensorflow as tf  # only here: reading TF checkpoints

    reader = tf.train.load_checkpoint(prefix)
    names = reader.get_variable_to_shape_map()
    variables = {n: reader.get_tensor(n) for n in names
                 if not re.search(r"/(adam_[mv]|Adam(_1)?|LAMB(_1)?|Momentum)$", n) and n != "global_step"}
    params, missing, skipped = from_google(variables, config, where=prefix)
    skipped = tuple(sorted(set(skipped) | (set(names) - set(variables))))
    return Pretrained(config, params, _maybe(os.path.join(directory, "vocab.txt")),
                      _read_casing(directory) if _read_casing(directory) is not None else _casing_from_name(directory),
                      "google", missing, skipped)


def _read_hf_tensors(directory: str) -> dict[str, np.ndarray]:
    def read_safetensors(path):
        from safetensors import SafetensorError, safe_open
        out = {}
        try:
            try:
                with safe_open(path, framework="np") as f:
                    flax_names = (f.metadata() or {}).get("format") == "flax"
                    for k in f.keys():
                        out[k] = f.get_tensor(k)
            except (TypeError, ValueError):  # bfloat16 has no numpy dtype: read through jax
                with safe_open(path, framework="flax") as f:
                    flax_names = (f.metadata() or {}).get("format") == "flax"
                    for k in f.keys():
                        out[k] = np.asarray(f.get_tensor(k), np.float32)
        except SafetensorError as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e}); a truncated or damaged "
                             "download?") from None
        if flax_names:  # written by a transformers Flax model: Flax leaf names and layouts
            tree: dict = {}
            for k, v in out.items():
                _set(tree, tuple(k.split(".")), v)
            return flax_to_hf_names(tree)
        return out

    p = os.path.join(directory, "model.safetensors")
    if os.path.isfile(p):
        return read_safetensors(p)
    p = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(p):
        with open(p, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(read_safetensors(os.path.join(directory, name)))
        return out
    p = os.path.join(directory, "flax_model.msgpack")
    if os.path.isfile(p):
        from flax import serialization
        with open(p, "rb") as f:
            tree = serialization.msgpack_restore(f.read())
        return flax_to_hf_names(tree)
    p = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(p):
        try:
            import torch
        except ImportError:
            raise ValueError(
                f"{p} is a PyTorch pickle and torch is not installed. bert_jax never unpickles files "
                f"itself: install torch (the file is then read with torch.load(weights_only=True)), or "
                f"convert it to model.safetensors where torch is available, e.g. "
                f"transformers.BertModel.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
            ) from None
        state = torch.load(p, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(f"{directory}: no model.safetensors, flax_model.msgpack or pytorch_model.bin")


def _read_hf_config(path: str) -> BertConfig:
    config_path = _require(os.path.join(path, "config.json"), "config.json")
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
    return config


def load_hf(path: str) -> Pretrained:
    config = _read_hf_config(path)
    params, missing, skipped = from_hf(_read_hf_tensors(path), config, where=path)
    return Pretrained(config, params, _maybe(os.path.join(path, "vocab.txt")), _read_casing(path), "hf",
                      missing, skipped)


def load_bert_jax(path: str) -> Pretrained:
    source = _bert_jax_source(path)
    if source is None:
        raise FileNotFoundError(f"{path}: no params/ or committed checkpoints/<step>/state")
    config = BertConfig.from_json_file(_require(os.path.join(path, "bert_config.json"), "bert_config.json"))
    import orbax.checkpoint as ocp

    kind, ckpt = source
    if kind == "state":  # the newest step that passes its integrity manifest; damaged ones are named
        from bert_jax import checkpointing
        ckpt_dir = os.path.dirname(os.path.dirname(ckpt))
        ckpt = os.path.join(ckpt_dir, str(checkpointing.newest_intact_step(ckpt_dir, _step_dirs(ckpt_dir))),
                            "state")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(os.path.abspath(ckpt))
    if kind == "state":  # a TrainState: keep its params
        tree = tree["params"]
    params = unrolled(tree)
    heads = [h for h in HEADS if h in params]
    other = sorted(k for k in params if k not in ("bert",) + HEADS)
    kept = {"bert": params["bert"], **{h: params[h] for h in heads}}
    # Validate shapes (and the encoder's completeness) through the Google table.
    checked, missing, _ = from_google(to_google(kept, config), config, where=ckpt)
    del checked
    return Pretrained(config, kept, _maybe(os.path.join(path, "vocab.txt")), _read_casing(path),
                      "bert_jax", missing, tuple(other))


def fetch(source: str, cache_dir: str) -> str:
    """A local checkpoint directory for `source`: a path (returned as is) or a URL of a .zip such as
    Google's releases (`https://storage.googleapis.com/bert_models/2020_02_20/uncased_L-4_H-256_A-4.zip`),
    downloaded into `cache_dir` once, unpacked, and the folder holding its files returned (named
    after the archive, so that casing detection by name works)."""
    import urllib.parse
    import urllib.request
    import zipfile

    if "://" not in source:
        return source
    name = os.path.basename(urllib.parse.urlparse(source).path)
    if not name.endswith(".zip"):
        raise ValueError(f"{source}: only .zip archives are fetched (Google's checkpoint releases)")
    target = os.path.join(cache_dir, name[: -len(".zip")])
    if not os.path.isdir(target):
        os.makedirs(cache_dir, exist_ok=True)
        archive = target + ".zip.part"
        from tqdm import tqdm
        with urllib.request.urlopen(source) as response, open(archive, "wb") as f:  # noqa: S310
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=name) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        tmp = target + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(archive) as z:
            for member in z.namelist():  # no absolute paths or ".." in an archive we unpack
                if member.startswith("/") or ".." in member.split("/"):
                    raise ValueError(f"{source}: unsafe path {member!r} in the archive")
            z.extractall(tmp)
        os.remove(archive)
        os.replace(tmp, target)
    configs = sorted(glob.glob(os.path.join(target, "**", "bert_config.json"), recursive=True)
                     + glob.glob(os.path.join(target, "**", "config.json"), recursive=True))
    if not configs:
        raise ValueError(f"{source}: the archive holds no bert_config.json or config.json")
    return os.path.dirname(min(configs, key=len))  # the 2018 releases have their own top folder


def _check_google_gelu(google_gelu: Optional[str]) -> None:
    """A bad value is an error whatever the format (only Google's reads it)."""
    if google_gelu is not None and google_gelu not in GOOGLE_GELUS:
        raise ValueError(f"google_gelu must be one of {tuple(GOOGLE_GELUS)}, got {google_gelu!r}")


def load_pretrained(path: str, format: Optional[str] = None, *,  # pylint: disable=redefined-builtin
                    google_gelu: Optional[str] = None) -> Pretrained:
    """Reads a checkpoint in any supported format (detected from its files when `format` is None).

    `google_gelu` says what a Google checkpoint's `hidden_act="gelu"` is: "erf" (default: the 2018
    releases) or "tanh" (trained with google-research/bert code of 2019-02-07 or later); HF and
    bert_jax checkpoints name their GELU exactly and ignore it.
    """
    _check_google_gelu(google_gelu)
    path = os.path.expanduser(path)
    format = format or detect_format(path)
    loaders = {"google": functools.partial(load_google, google_gelu=google_gelu), "hf": load_hf,
               "bert_jax": load_bert_jax}
    if format not in loaders:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    pretrained = loaders[format](path)
    if pretrained.missing:
        logging.info("%s: no %s head(s) in the checkpoint", path, ", ".join(pretrained.missing))
    if pretrained.skipped:
        logging.info("%s: skipped %d variable(s) with no place in BERT: %s", path, len(pretrained.skipped),
                     ", ".join(pretrained.skipped[:10]) + (" ..." if len(pretrained.skipped) > 10 else ""))
    return pretrained


def load_config(path: str, format: Optional[str] = None, *,  # pylint: disable=redefined-builtin
                google_gelu: Optional[str] = None, **overrides) -> BertConfig:
    """Only the `BertConfig` of a checkpoint in any format (no weights are read); `google_gelu` as
    in `load_pretrained`."""
    _check_google_gelu(google_gelu)
    path = os.path.expanduser(path)
    format = format or detect_format(path)
    if format == "google":
        config = read_google_config(os.path.join(os.path.dirname(_google_prefix(path)), "bert_config.json"),
                                    google_gelu)
    elif format == "hf":
        config = _read_hf_config(path)
    else:
        config = BertConfig.from_json_file(_require(os.path.join(path, "bert_config.json"), "bert_config.json"))
    return config.replace(**overrides) if overrides else config


def model_params(pretrained: Pretrained, config: Optional[BertConfig] = None, *, heads: bool = True) -> dict:
    """The parameters as the model with `config` (default: the checkpoint's) wants them: cast to
    its `param_dtype`, layers stacked when it scans; heads dropped when `heads=False`."""
    import jax
    from bert_jax import modeling

    config = config or pretrained.config
    params = {k: v for k, v in pretrained.params.items() if heads or k == "bert"}
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, config.param_dtype), params)
    if config.scan_layers:
        params = modeling.stack_layers(params, config.num_hidden_layers)
        params = jax.tree_util.tree_map(np.asarray, params)
    return params


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def _prepare_dir(path: str, overwrite: bool) -> None:
    if os.path.exists(path) and os.listdir(path) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (use overwrite=True / --overwrite)")
    os.makedirs(path, exist_ok=True)


def _write_tokenizer_files(p: Pretrained, path: str) -> None:
    if p.vocab_file:
        target = os.path.join(path, "vocab.txt")
        if os.path.abspath(p.vocab_file) != os.path.abspath(target):
            shutil.copyfile(p.vocab_file, target)
    else:
        logging.warning("%s: no vocab.txt to write (pass vocab_file)", path)
    if p.do_lower_case is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_config_json(p.do_lower_case))


def save_google(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `bert_model.ckpt.{index,data-00000-of-00001}` + `bert_config.json` + `vocab.txt`."""
    _prepare_dir(path, overwrite)
    variables = to_google(p.params, p.config)
    with open(os.path.join(path, "bert_config.json"), "w", encoding="utf-8") as f:
        json.dump(google_config_dict(p.config), f, indent=2, sort_keys=True)
        f.write("\n")
    import tensorflow as tf  # only here: writing TF checkpoints

    names = sorted(variables)
    prefix = os.path.join(path, "bert_model.ckpt")
    with tf.device("/cpu:0"):
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                          tensors=[tf.constant(variables[n]) for n in names])
    with open(os.path.join(path, "checkpoint"), "w", encoding="utf-8") as f:
        f.write('model_checkpoint_path: "bert_model.ckpt"\nall_model_checkpoint_paths: "bert_model.ckpt"\n')
    _write_tokenizer_files(p, path)
    return path


def save_hf(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `config.json` + `model.safetensors` (PyTorch names) + `vocab.txt` + `tokenizer_config.json`."""
    from safetensors.numpy import save_file

    _prepare_dir(path, overwrite)
    save_file(to_hf(p.params, p.config), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(p.config, p.heads), f, indent=2, sort_keys=True)
        f.write("\n")
    _write_tokenizer_files(p, path)
    return path


def save_bert_jax(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `bert_config.json` + `params/` (orbax) + `vocab.txt` + `tokenizer_config.json`."""
    import orbax.checkpoint as ocp

    _prepare_dir(path, overwrite)
    params = unrolled({k: v for k, v in p.params.items() if k in ("bert",) + HEADS})
    to_google(params, p.config)  # validates every shape against the config
    p.config.to_json_file(os.path.join(path, "bert_config.json"))
    target = os.path.abspath(os.path.join(path, "params"))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(target, params, force=True)
        checkpointer.wait_until_finished()
    _write_tokenizer_files(p, path)
    return path


def save_pretrained(p: Pretrained, path: str, format: str, *, overwrite: bool = False) -> str:  # pylint: disable=redefined-builtin
    savers = {"google": save_google, "hf": save_hf, "bert_jax": save_bert_jax}
    if format not in savers:
        raise ValueError(f"output format must be one of {FORMATS}, got {format!r}")
    return savers[format](p, path, overwrite=overwrite)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


class _NotOrbaxInfo(std_logging.Filter):
    """Keeps orbax's warnings and errors, drops its per-read INFO lines (throughput, handlers)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bert_jax.convert",
        description="Convert BERT checkpoints between Google TF1, HuggingFace and bert_jax formats.")
    parser.add_argument("--input", required=True, help="checkpoint directory (or TF checkpoint prefix)")
    parser.add_argument("--input_format", choices=FORMATS, default=None, help="default: detected")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--output_format", choices=FORMATS, required=True)
    parser.add_argument("--vocab_file", default=None, help="vocab.txt when the input has none next to it")
    parser.add_argument("--do_lower_case", choices=("true", "false"), default=None,
                        help="casing to record (default: the input's, when it says)")
    parser.add_argument("--drop_heads", action="store_true", help="write the encoder only")
    parser.add_argument("--google_gelu", choices=tuple(GOOGLE_GELUS), default=None,
                        help=f"what a Google checkpoint's hidden_act='gelu' is: 'erf' (default "
                             f"{DEFAULT_GOOGLE_GELU!r}: the 2018 releases) or 'tanh' (trained with "
                             f"google-research/bert code of 2019-02-07 or later); see docs/checkpoints.md")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.INFO)  # ours: missing heads, skipped variables; not orbax's chatter
    logging.get_absl_logger().addFilter(_NotOrbaxInfo())
    std_logging.getLogger("bert_jax").setLevel(std_logging.INFO)  # e.g. the Google GELU chosen
    if not std_logging.getLogger().handlers:
        std_logging.basicConfig()
    p = load_pretrained(args.input, args.input_format, google_gelu=args.google_gelu)
    if args.vocab_file:
        p.vocab_file = _require(args.vocab_file, "--vocab_file")
    if args.do_lower_case is not None:
        p.do_lower_case = args.do_lower_case == "true"
    if args.drop_heads:
        p.params = {"bert": p.params["bert"]}
    if p.vocab_file:
        with open(p.vocab_file, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > p.config.vocab_size:
            raise ValueError(f"{p.vocab_file} has {n} tokens but the model's vocab_size is only "
                             f"{p.config.vocab_size}: is it the model's vocabulary?")
        if n == 0:
            raise ValueError(f"{p.vocab_file} is empty: pass the model's vocab.txt with --vocab_file")
    save_pretrained(p, args.output, args.output_format, overwrite=args.overwrite)
    from bert_jax.modeling import count_params
    print(json.dumps({"input": args.input, "input_format": p.format, "output": args.output,
                      "output_format": args.output_format, "hidden_act": p.config.hidden_act,
                      "parameters": count_params(p.params),
                      "heads": list(p.heads), "missing_heads": list(p.missing),
                      "skipped": list(p.skipped)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
