"""Modules that moved into folders (docs/architecture.md): the documented old paths,
`bert_jax.modeling` and `bert_jax.checkpointing`, still import (with a DeprecationWarning) the same
objects (each from the module that defines it now, with every name the old path offered before the
Checkpointer's parts left `checkpointing.py`); every other old path fails with a message naming
its new one, as `import` and as `from bert_jax import`."""

import importlib
import sys

import pytest

import bert_jax
from bert_jax.checkpoints import checkpoint_reading, checkpoint_steps, checkpointing
from bert_jax.model import dropout, modeling, pretraining_heads

# Every public name `bert_jax.checkpointing` offered when it star-imported `checkpoints.checkpointing`,
# which re-exported the read-only helpers and carried its own imports along.
OLD_CHECKPOINTING_NAMES = (
    "Any", "Callable", "CheckpointCorruptError", "CheckpointRestoreError", "CheckpointSaveError", "Checkpointer",
    "FORMAT_VERSION", "INFO", "INPUT_STATE", "META", "ON_DAMAGED", "Optional", "Preemption", "PyTree", "STATE",
    "SaveDeadline", "annotations", "check_against_metadata", "check_step", "corrupt_error", "flat", "hashlib",
    "input_dir", "integrity", "is_read_failure", "is_typed_key", "jax", "json", "listed", "logging", "move_aside",
    "newest_intact_step", "ocp", "os", "read_error", "rebuild_like", "restore_part", "saved_keys", "storage",
    "to_abstract", "warnings")


@pytest.mark.parametrize("old,new,names", [
    ("bert_jax.modeling", r"bert_jax\.model\.modeling", ("BertConfig", "BertModel", "keep_mask")),
    ("bert_jax.checkpointing", r"bert_jax\.checkpoints\.checkpointing",
     ("Checkpointer", "CheckpointRestoreError", "newest_intact_step", "saved_keys"))])
def test_the_documented_old_paths_still_import_the_same_objects(old, new, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        module = importlib.import_module(old)
    home = {"BertConfig": modeling, "BertModel": modeling, "keep_mask": dropout, "Checkpointer": checkpointing,
            "CheckpointRestoreError": checkpoint_steps, "newest_intact_step": checkpoint_reading,
            "saved_keys": checkpoint_reading}
    for name in names:
        assert getattr(module, name) is getattr(home[name], name), name
    if old == "bert_jax.modeling":
        assert module.keep_mask is dropout.keep_mask
        assert module.BertForPreTraining is pretraining_heads.BertForPreTraining
    else:
        missing = [name for name in OLD_CHECKPOINTING_NAMES if not hasattr(module, name)]
        assert not missing, f"bert_jax.checkpointing no longer offers {missing}"


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


def test_names_of_the_modules_that_became_folders_name_their_new_home():
    """`bert_jax.pretrain` and `bert_jax.finetune` were modules and are folders: their old names fail
    naming the module that holds them now, as do the names `modeling` re-exported until 2026-11-29."""
    import bert_jax.finetune
    import bert_jax.pretrain
    for package, name, home in ((bert_jax.pretrain, "run", "bert_jax.pretrain.loop"),
                                (bert_jax.pretrain, "bert_config_from", "bert_jax.training.run_setup"),
                                (bert_jax.pretrain, "write_model_files", "bert_jax.workdir"),
                                (bert_jax.finetune, "train_and_evaluate", "bert_jax.finetune.loop"),
                                (bert_jax.finetune, "train_plan", "bert_jax.finetune.batches"),
                                (modeling, "ATTENTION_IMPLS", "bert_jax.model.model_config"),
                                (modeling, "DTYPES", "bert_jax.model.model_config"),
                                (modeling, "dropout", "bert_jax.model.dropout")):
        with pytest.raises(AttributeError, match=f"it moved to '{home}.{name}'"):
            getattr(package, name)
        assert getattr(importlib.import_module(home), name) is not None
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_name'$"):
        bert_jax.pretrain.no_such_name  # noqa: B018
    from bert_jax.pretrain import loop  # the folder's own modules import as usual
    assert loop.run is bert_jax.pretrain.loop.run
