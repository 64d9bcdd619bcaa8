"""The old path of `bert_jax.model.modeling` (the encoder; `BertForPreTraining` and its heads are in
`bert_jax.model.pretraining_heads`): it still imports, with a DeprecationWarning, so that code
written against it keeps working. bert_jax itself imports the new paths."""

import warnings

from bert_jax.model.attention import ACT_HEADS, attention, make_attention_mask, make_sequence_ids  # noqa: F401
from bert_jax.model.dropout import Dropout, dropout, keep_mask, threefry_key  # noqa: F401
from bert_jax.model.model_config import (  # noqa: F401
    ACTIVATIONS, ATTENTION_IMPLS, DEFAULT_GOOGLE_GELU, DTYPES, GOOGLE_GELUS, REMAT_POLICIES, BertConfig)
from bert_jax.model.modeling import *  # noqa: F401,F403
from bert_jax.model.pretraining_heads import BertForPreTraining, PreTrainingOutput  # noqa: F401

warnings.warn("bert_jax.modeling moved to bert_jax.model.modeling (BertForPreTraining to "
              "bert_jax.model.pretraining_heads); the old path will be removed", DeprecationWarning, stacklevel=2)
