"""What the checkpoint formats share: `Pretrained`, a checkpoint in memory, and small file helpers.

Every reader in `bert_jax.formats` returns a `Pretrained` and every writer takes one: a `BertConfig`,
the parameters as numpy float32 in `BertForPreTraining`'s layout with unrolled layers
(`bert/encoder/layer_{i}`; the "mlm" and "nsp" heads absent when the checkpoint has none), the vocab
file and the casing. The helpers here read and write what sits beside the weights in every format
(`vocab.txt`, `tokenizer_config.json`) and walk parameter trees.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np
from absl import logging

from bert_jax.modeling import BertConfig
from data_pipeline import storage

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
# Files beside the weights
# ---------------------------------------------------------------------------------------------


def _load_json(path: str):
    from data_pipeline.tasks import read_json  # local or gs://; names the file, line and column of bad text
    return read_json(path)


def tokenizer_config_json(do_lower_case: bool) -> str:
    """`tokenizer_config.json`'s text: the casing, which this module and HF's BertTokenizer read."""
    return json.dumps({"do_lower_case": bool(do_lower_case), "tokenizer_class": "BertTokenizer"}, indent=2) + "\n"


def _read_casing(directory: str) -> Optional[bool]:
    p = storage.join(directory, "tokenizer_config.json")
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
        target = storage.join(path, "vocab.txt")
        if storage.abspath(p.vocab_file) != storage.abspath(target):
            storage.copy(p.vocab_file, target)
    else:
        logging.warning("%s: no vocab.txt to write (pass vocab_file)", path)
    if p.do_lower_case is not None:
        storage.write_text(storage.join(path, "tokenizer_config.json"), tokenizer_config_json(p.do_lower_case))
