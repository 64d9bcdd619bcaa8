"""Modules that moved into folders (docs/architecture.md): the documented old paths,
`bert_jax.modeling` and `bert_jax.checkpointing`, still import (with a DeprecationWarning) the same
objects; every other old path fails with a message naming its new one, as `import` and as
`from bert_jax import`."""

import importlib
import sys

import pytest

import bert_jax
from bert_jax.checkpoints import checkpointing
from bert_jax.model import dropout, modeling, pretraining_heads


@pytest.mark.parametrize("old,new,names", [
    ("bert_jax.modeling", r"bert_jax\.model\.modeling", ("BertConfig", "BertModel", "keep_mask")),
    ("bert_jax.checkpointing", r"bert_jax\.checkpoints\.checkpointing",
     ("Checkpointer", "CheckpointRestoreError", "newest_intact_step", "saved_keys"))])
def test_the_documented_old_paths_still_import_the_same_objects(old, new, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        module = importlib.import_module(old)
    home = {"bert_jax.modeling": modeling, "bert_jax.checkpointing": checkpointing}[old]
    for name in names:
        assert getattr(module, name) is getattr(home, name), name
    if old == "bert_jax.modeling":
        assert module.keep_mask is dropout.keep_mask
        assert module.BertForPreTraining is pretraining_heads.BertForPreTraining


def test_the_other_old_paths_name_their_new_one():
    assert len(bert_jax.MOVED) == 23
    for old, new in bert_jax.MOVED.items():
        importlib.import_module(new)  # the new one imports
        with pytest.raises(ModuleNotFoundError, match=f"it moved to '{new}'"):
            importlib.import_module(old)
    with pytest.raises(ModuleNotFoundError, match=r"bert_jax\.model\.fused"):
        from bert_jax import fused  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"bert_jax\.checkpoints\.preemption"):
        from bert_jax import preemption  # noqa: F401
