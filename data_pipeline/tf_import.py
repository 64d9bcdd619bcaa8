"""TensorFlow (and libraries built on it) imported without Keras, which nothing here uses.

Two imports load the whole of Keras into every process that reads records or writes TensorBoard
events, and Keras loads scikit-learn and matplotlib's pyplot with it:

* TensorFlow 2.21's `__init__` ends by importing `keras.src.optimizers` (to register Keras
  optimizers for SavedModel loading), inside a `try/except ImportError`;
* TensorBoard's hparams API (`tensorboard.plugins.hparams.api`, which clu's metric writers, used here
  before `bert_jax.workdir` wrote its events itself, import)
  imports its `_keras` module only to offer `KerasCallback`, a subclass of `tf.keras.callbacks.Callback`.

That is 4-5 CPU seconds of each run's start on the 2-core development machine (2026-11-27:
`python -m bert_jax.main` of configs/test.py with a cached compile, 20 s in all), and on a host
whose home has no matplotlib font cache yet (a fresh TPU VM, each worker of
tests/test_pod_rehearsal.py) another 20 s while matplotlib builds it.

`keras_deferred()` makes both imports skip Keras while the code inside it imports: the first fails
as TensorFlow expects it may, the second gets a stand-in `_keras` module whose `Callback` imports
the real one when it is first used. When it exits, both are taken out of `sys.modules`, so a later
`import keras` or `from tensorboard.plugins.hparams import _keras` in the same process works as
usual. `tests/test_tf_import.py` checks both.

Every module of this project that needs TensorFlow imports it from here (`from
data_pipeline.tf_import import tf`), and so do the callers of libraries that import it themselves
(tensorflow_datasets); a process where something else imported TensorFlow
first simply has it already.
"""

import contextlib
import sys
import types

_EAGER_KERAS = "keras.src.optimizers"  # what tensorflow/__init__.py imports in a try/except ImportError
_HPARAMS_KERAS = "tensorboard.plugins.hparams._keras"


class _KerasCallback:
    """Stands in for `tensorboard.plugins.hparams.api.KerasCallback`: the real one, made on first use."""

    def __new__(cls, *args, **kwargs):
        from tensorboard.plugins.hparams import _keras  # the real module (imports Keras)
        return _keras.Callback(*args, **kwargs)


@contextlib.contextmanager
def keras_deferred():
    """Imports inside the block do not load Keras (see the module's docstring)."""
    stand_in = types.ModuleType(_HPARAMS_KERAS, "a stand-in while data_pipeline.tf_import imports")
    stand_in.Callback = _KerasCallback
    placed = {name: value for name, value in ((_EAGER_KERAS, None), (_HPARAMS_KERAS, stand_in))
              if name not in sys.modules}
    sys.modules.update(placed)  # a name bound to None in sys.modules fails to import
    try:
        yield
    finally:
        for name, value in placed.items():
            if name in sys.modules and sys.modules[name] is value:  # not replaced by a real import
                del sys.modules[name]


def tensorflow():
    """The `tensorflow` module, imported without Keras if it was not imported yet."""
    if "tensorflow" not in sys.modules:
        with keras_deferred():
            __import__("tensorflow")
    return sys.modules["tensorflow"]


tf = tensorflow()
