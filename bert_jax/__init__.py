"""bert_jax: BERT (Devlin et al. 2018) in JAX/Flax, from one CPU to a TPU pod.

The model (`bert_jax.model.modeling`) and the train step never import tensorflow; everything
that touches text, tokens, files and tf.data lives in the sibling `data_pipeline` package.
Every file is read and written through `data_pipeline.storage` and its `storage_*` siblings
(local paths and gs://).
"""

import sys as _sys

# First: it points orbax's path library at the same gs:// client as ours (EPATH_USE_TF=false).
from data_pipeline import storage_gcs as _storage_gcs  # noqa: F401

__version__ = "0.1.0"

# Modules that moved into folders (docs/architecture.md): importing an old path fails with a message
# that names the new one (`bert_jax.modeling` and `bert_jax.checkpointing`, the documented ones, still
# import: bert_jax/modeling.py, bert_jax/checkpointing.py).
MOVED = {f"bert_jax.{name}": f"bert_jax.{folder}.{name}" for folder, names in (
    ("model", ("model_config", "attention", "dropout", "fused", "fused_ffn", "mixed_precision", "pretraining_heads")),
    ("checkpoints", ("checkpoint_steps", "checkpoint_reading", "checkpoint_integrity", "preemption",
                     "save_deadline")),
    ("pretrain", ("pretrain_input", "pretrain_checks", "phases", "steps")),
    ("finetune", ("heads", "predict")),
    ("training", ("optim", "sharding", "compile_cache", "host_memory"))) for name in names}
MOVED["bert_jax.finetune_batches"] = "bert_jax.finetune.batches"
# `bert_jax.pretrain` and `bert_jax.finetune` were modules and are folders now: their loops are
# `bert_jax.pretrain.loop` and `bert_jax.finetune.loop`; an attribute of the old module (`pretrain.run`)
# fails naming its new home (`moved_attribute`).


def _moved(fullname: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {fullname!r}: it moved to {MOVED[fullname]!r}", name=fullname)


class _MovedModules:
    """A last import finder: an old module path, which no file holds any more, fails naming its new one."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        del path, target
        if fullname in MOVED:
            raise _moved(fullname)
        return None


def moved_attribute(package: str, name: str, homes: tuple) -> AttributeError:
    """`bert_jax.pretrain.run` (a name of the module that `package` replaced): an AttributeError that
    names the module of `homes` holding it now. The package's own modules are not looked for here
    (the import system asks for them before importing them)."""
    import importlib
    import importlib.util
    if name.startswith("_"):  # dunder lookups (`__path__`, ...) and private names: nothing moved
        return AttributeError(f"module {package!r} has no attribute {name!r}")
    folder = "__path__" in vars(_sys.modules[package])
    if not (folder and importlib.util.find_spec(f"{package}.{name}") is not None):
        found = [home for home in homes if hasattr(importlib.import_module(home), name)]
        # The module that defines it, when that is one of `homes` (a loop may import it from there).
        defining = [home for home in found if getattr(getattr(_sys.modules[home], name), "__module__", None) == home]
        if found:
            home = (defining or found)[0]
            return AttributeError(f"module {package!r} has no attribute {name!r}: it moved to '{home}.{name}'")
    return AttributeError(f"module {package!r} has no attribute {name!r}")


def __getattr__(name):
    """`from bert_jax import fused` (an old module, as an attribute): the same message."""
    if f"bert_jax.{name}" in MOVED:
        raise _moved(f"bert_jax.{name}")
    raise AttributeError(f"module 'bert_jax' has no attribute {name!r}")


if not any(isinstance(f, _MovedModules) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedModules())
