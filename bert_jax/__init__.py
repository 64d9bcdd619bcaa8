"""bert_jax: BERT (Devlin et al. 2018) in JAX/Flax, from one CPU to a TPU pod.

The model (`bert_jax.modeling`) and the train step never import tensorflow; everything
that touches text, tokens, files and tf.data lives in the sibling `data_pipeline` package.
"""

__version__ = "0.1.0"
