"""bert_jax: BERT (Devlin et al. 2018) in JAX/Flax, from one CPU to a TPU pod.

The model (`bert_jax.model.modeling`) and the train step never import tensorflow; everything
that touches text, tokens, files and tf.data lives in the sibling `data_pipeline` package.
Every file is read and written through `data_pipeline.storage` and its `storage_*` siblings
(local paths and gs://).
"""

# First: it points orbax's path library at the same gs:// client as ours (EPATH_USE_TF=false).
from data_pipeline.storage import gcs as _storage_gcs  # noqa: F401

__version__ = "0.1.0"
