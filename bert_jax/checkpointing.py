"""The old path of `bert_jax.checkpoints.checkpointing` (`Checkpointer` and its errors): it still
imports, with a DeprecationWarning, so that code written against it keeps working. bert_jax itself
imports the new path."""

import warnings

from bert_jax.checkpoints.checkpointing import *  # noqa: F401,F403

warnings.warn("bert_jax.checkpointing moved to bert_jax.checkpoints.checkpointing; the old path will be removed",
              DeprecationWarning, stacklevel=2)
