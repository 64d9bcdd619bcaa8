"""The old path of `bert_jax.checkpoints.checkpointing` (`Checkpointer` and its errors): it still
imports, with a DeprecationWarning, so that code written against it keeps working. bert_jax itself
imports the new paths.

It offers every name it offered when it star-imported that module (tests/docs/test_moved_modules.py),
each from the module that defines it now: the Checkpointer's errors and layout from
checkpoint_steps, the read-only helpers from checkpoint_reading, and the modules the old one had
imported (a star import carried them along).
"""

from __future__ import annotations

import hashlib  # noqa: F401
import json  # noqa: F401
import logging  # noqa: F401
import os  # noqa: F401
import warnings
from typing import Any, Callable, Optional  # noqa: F401

import jax  # noqa: F401
import orbax.checkpoint as ocp  # noqa: F401

from bert_jax.checkpoints import checkpoint_integrity as integrity  # noqa: F401
from bert_jax.checkpoints.checkpoint_reading import (PyTree, check_against_metadata, flat, is_typed_key,  # noqa: F401
                                                     listed, newest_intact_step, rebuild_like, restore_part,
                                                     saved_keys, to_abstract)
from bert_jax.checkpoints.checkpoint_steps import (FORMAT_VERSION, INFO, INPUT_STATE, META, ON_DAMAGED,  # noqa: F401
                                                   STATE, CheckpointCorruptError, CheckpointRestoreError,
                                                   CheckpointSaveError, check_step, corrupt_error, input_dir,
                                                   is_read_failure, move_aside, read_error)
from bert_jax.checkpoints.checkpointing import Checkpointer  # noqa: F401
from bert_jax.checkpoints.preemption import Preemption  # noqa: F401
from bert_jax.checkpoints.save_deadline import Deadline as SaveDeadline  # noqa: F401  (its old name)
from data_pipeline import storage  # noqa: F401

warnings.warn("bert_jax.checkpointing moved to bert_jax.checkpoints.checkpointing; the old path will be removed",
              DeprecationWarning, stacklevel=2)
