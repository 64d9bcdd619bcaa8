"""Fixtures several tests/finetune/ modules share: XLA's persistent compilation cache of their runs
and the tiny "pretrained" encoder every run starts from."""

import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.model import model_config, modeling, pretraining_heads
from tests.helpers.finetune_inputs import WORDS


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """Each head kind compiles once (same shapes and hyper-parameters -> same HLO), in one folder for
    the modules that use this fixture (test_finetune.py, test_finetune_tasks.py, test_finetune_plan.py,
    test_finetune_seeds.py, each with `pytestmark = pytest.mark.usefixtures("compilation_cache")`):
    a test process's modules find each other's programs there."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    cache = str(tmp_path_factory.getbasetemp() / "finetune_xla_cache")
    os.makedirs(cache, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield cache
    for n, v in before.items():
        jax.config.update(n, v)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny encoder in bert_jax's export format and in HuggingFace's, with its vocab."""
    root = tmp_path_factory.mktemp("pretrained")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list(".,?!'-")) + "\n")
    cfg = model_config.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=64)
    params = pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **modeling.dummy_inputs(cfg))["params"]
    params = nn.meta.unbox(params)
    pretrained = convert.Pretrained(cfg, jax.tree_util.tree_map(np.asarray, params), str(vocab), True)
    paths = {fmt: convert.save_pretrained(pretrained, str(root / fmt), fmt) for fmt in ("bert_jax", "hf")}
    return {"vocab": str(vocab), "config": cfg, "params": pretrained.params, **paths}
