"""TensorFlow (and libraries built on it) imported without Keras, which nothing here uses.

TensorFlow 2.21's `__init__` ends by importing `keras.src.optimizers` (to register Keras
optimizers for SavedModel loading), inside a `try/except ImportError`: that loads the whole of
Keras into every process that reads records, and Keras loads scikit-learn and matplotlib's pyplot
with it. (TensorBoard's hparams API did the same through clu's metric writers, which bert_jax no
longer uses: `bert_jax.workdir` writes its events itself, without TensorFlow.)

That is 4-5 CPU seconds of each run's start on the 2-core development machine (2026-11-27:
`python -m bert_jax.main` of configs/test.py with a cached compile, 20 s in all), and on a host
whose home has no matplotlib font cache yet (a fresh TPU VM, each worker of
tests/pod/test_pod_rehearsal.py) another 20 s while matplotlib builds it.

`keras_deferred()` makes that import fail, as TensorFlow expects it may, while the code inside it
imports. When it exits, the name is taken out of `sys.modules`, so a later `import keras` in the
same process works as usual. `tests/data_pipeline/test_tf_import.py` checks both.

Every module of this project that needs TensorFlow imports it from here (`from
data_pipeline.tf_import import tf`), and so do the callers of libraries that import it themselves
(tensorflow_datasets); a process where something else imported TensorFlow
first simply has it already.
"""

import contextlib
import sys

_EAGER_KERAS = "keras.src.optimizers"  # what tensorflow/__init__.py imports in a try/except ImportError


@contextlib.contextmanager
def keras_deferred():
    """Imports inside the block do not load Keras (see the module's docstring)."""
    placed = _EAGER_KERAS not in sys.modules
    if placed:
        sys.modules[_EAGER_KERAS] = None  # a name bound to None in sys.modules fails to import
    try:
        yield
    finally:
        if placed and _EAGER_KERAS in sys.modules and sys.modules[_EAGER_KERAS] is None:
            del sys.modules[_EAGER_KERAS]  # not replaced by a real import meanwhile


def tensorflow():
    """The `tensorflow` module, imported without Keras if it was not imported yet."""
    if "tensorflow" not in sys.modules:
        with keras_deferred():
            __import__("tensorflow")
    return sys.modules["tensorflow"]


tf = tensorflow()
