"""`BertConfig`: the model's shape and options, and how Google's, HF's and our config files read.

A frozen dataclass with the fields of Google's `bert_config.json` plus our performance options,
checked when it is built (heads divide the hidden size, known activation, attention and remat
choices, ...). `from_json_file` tells Google's files, HF's `config.json` and ours apart, and reads
Google's `hidden_act="gelu"` as `google_gelu` says (the exact erf form by default: the checkpoints
Google released in 2018 were trained with it; docs/checkpoints.md).

`bert_jax.model.modeling` builds the network from it and re-exports it. This module must not import
tensorflow.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Optional

import jax.numpy as jnp
import numpy as np

from data_pipeline import storage

ACTIVATIONS = ("gelu", "gelu_tanh", "gelu_new", "relu")
ATTENTION_IMPLS = ("einsum", "dot_product")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")

# What Google's `bert_config.json` `hidden_act="gelu"` means, by `google_gelu`: google-research/bert
# computed the exact erf GELU until its commit bee6030 (2019-02-07) and the tanh approximation since.
# The released checkpoints of 2018 were trained with the erf form, which is the default.
GOOGLE_GELUS = {"erf": "gelu", "tanh": "gelu_tanh"}
DEFAULT_GOOGLE_GELU = "erf"


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Model hyper-parameters.

    The first block of fields is Google's `bert_config.json` (same names, same meaning, except that
    `hidden_act="gelu"` here always means the exact erf GELU as in HuggingFace and `"gelu_tanh"` the
    tanh approximation; Google's `"gelu"` means either, depending on when the checkpoint was trained,
    and `from_json_file` resolves it with `google_gelu` when it reads a Google file, see
    `GOOGLE_GELUS` and docs/checkpoints.md). The second block is ours.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    # --- ours ---
    dtype: str = "float32"  # compute dtype of matmuls and activations ("bfloat16" on accelerators)
    param_dtype: str = "float32"  # storage dtype of parameters
    layer_norm_eps: float = 1e-12
    scan_layers: bool = False  # nn.scan over layers: compile time flat in depth
    remat_policy: str = "none"  # none | full | dots | dots_no_batch (what each layer saves for backprop)
    attention_impl: str = "einsum"  # einsum (float32 softmax) | dot_product (cuDNN on GPU, Pallas splash on TPU)
    vocab_pad_multiple: int = 128  # pad the MLM decoder matmul's vocab dim (parameters keep the real size)
    causal_attention: bool = False  # left-to-right encoder (the paper's Table 5 "LTR" ablation)
    # Heads that read a few positions (pretraining's masked LM + NSP, sentence classification): the
    # last layer's queries run at those positions only. Exact; ignored with scan_layers.
    sparse_last_layer: bool = True
    # FP8 matmuls for training on Hopper GPUs (flax's `fp8_ops`: e4m3 inputs and weights, e5m2
    # gradients, per-tensor scales from a 1,024-step amax history, "delayed scaling"). The scaling
    # state lives in the `_overwrite_with_gradient` variable collection (`FP8_COLLECTION`), which the
    # pretraining step carries and checkpoints; the parameters are unchanged. A training-time
    # option, not part of the model: `to_dict` (and so bert_config.json) leaves it out, and a model
    # applied without that collection cannot run with it (fine-tuning and inference run without).
    fp8: bool = False
    # Dropout + residual add + LayerNorm at the end of each sub-layer as one Pallas kernel each way
    # (`bert_jax.model.kernels.fused`; Triton on GPUs). The same parameters, masks and arithmetic; where the
    # kernels do not apply (a hidden size `fused.supported` refuses) the layer is unfused. On a mesh
    # each device runs them on its own examples (`bert_jax.model.kernels.per_device`).
    fused_ops: bool = False
    # The feed-forward block's first GEMM with its bias and GELU in the GEMM's epilogue, and in the
    # backward the GELU's derivative and the bias gradient in the epilogue of the GEMM that produces
    # the activation's gradient (`bert_jax.model.kernels.fused_ffn`; Triton on GPUs). The same parameters; sizes
    # that do not divide by its blocks and FP8 run the layer unfused. Slower than XLA + cuBLAS on an
    # H200 (0.90x BERT-Large's step, benchmarks/kernels/RESULTS.md 2026-11-28): off unless measured to pay.
    fused_ffn: bool = False
    # Every matmul with bfloat16 inputs and float32 accumulation and output, forward and backward,
    # the rest of the model in float32 (`bert_jax.model.mixed_precision`): the form XLA's CPU backend runs
    # fast on CPUs with bf16 units (avx512_bf16, amx_bf16). Needs dtype="float32"; not with fp8.
    mixed_matmuls: bool = False
    # Q, K and V as three matmuls, each into its own [batch, length, heads, head_dim] array with its
    # bias, instead of one matmul against the three kernels stacked and three strided slices of
    # its output (and, backward, their gradients stacked again). The same parameters and values.
    # 0.99x the step on an H200 (benchmarks/kernels/RESULTS.md, 2026-11-28): XLA's dot merger joins the
    # three matmuls again; off unless measured to pay.
    separate_qkv: bool = False
    # Q, K and V as one Pallas GEMM kernel each way (`bert_jax.model.kernels.fused_qkv`; Triton on GPUs):
    # q, k and v written with their biases from the GEMM's program (no slices), the bias gradients
    # summed inside the kernels' gradients' GEMM. The same parameters; hidden sizes that 64 does not
    # divide and FP8 run the projections unfused. Not yet timed on a GPU: off unless measured to pay.
    fused_qkv: bool = False

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "type_vocab_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"BertConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"BertConfig.num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BertConfig.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"BertConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"BertConfig.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"BertConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("fp8", "fused_ops", "fused_ffn", "mixed_matmuls", "separate_qkv", "fused_qkv"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"BertConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.mixed_matmuls and (self.dtype != "float32" or self.fp8):
            raise ValueError("BertConfig.mixed_matmuls runs the matmuls in bfloat16 within a float32 model: it needs "
                             f"dtype='float32' and fp8=False, got dtype={self.dtype!r}, fp8={self.fp8}")
        if self.vocab_pad_multiple < 1:
            raise ValueError(f"BertConfig.vocab_pad_multiple must be >= 1, got {self.vocab_pad_multiple}")

    # --- derived ---
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m

    def replace(self, **changes) -> "BertConfig":
        return dataclasses.replace(self, **changes)

    # --- files ---
    @classmethod
    def from_dict(cls, d: dict, *, google_format: bool = False, google_gelu: Optional[str] = None,
                  **overrides) -> "BertConfig":
        """Builds a config from a dict of hyper-parameters; unknown keys are ignored.

        Args:
          d: Google's `bert_config.json`, HF's `config.json` or our own `to_dict()`, parsed.
          google_format: `d` is Google's: its `hidden_act="gelu"` is resolved by `google_gelu`,
            unless `d` carries the `"bert_jax_hidden_act"` marker our Google exports write, which
            wins (it names the exact GELU the weights were trained with).
          google_gelu: what Google's `"gelu"` means: `"erf"` (the default: the exact GELU of the
            2018 releases, our and HF's `"gelu"`) or `"tanh"` (the approximation google-research/bert
            computes since 2019-02-07, our `"gelu_tanh"`, HF's `"gelu_new"`). Ignored unless
            `google_format`.
          **overrides: fields applied last (dtype, scan_layers, ...).

        Example: `BertConfig.from_dict({"hidden_act": "gelu"}, google_format=True).hidden_act` is
        `"gelu"`; with `google_gelu="tanh"` it is `"gelu_tanh"`.
        """
        if google_gelu is not None and google_gelu not in GOOGLE_GELUS:
            raise ValueError(f"google_gelu must be one of {tuple(GOOGLE_GELUS)}, got {google_gelu!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: d[k] for k in names if k in d}
        if google_format and kwargs.get("hidden_act") == "gelu":
            kwargs["hidden_act"] = _google_hidden_act(d, google_gelu)
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path, *, google_format: Optional[bool] = None, google_gelu: Optional[str] = None,
                       **overrides) -> "BertConfig":
        """Reads Google's `bert_config.json`, HF's `config.json` or ours (extra keys ignored).

        `google_format=None` tells them apart: HF's files carry `model_type`, ours carry
        `"bert_jax": true`; anything else is Google's, whose `"gelu"` is read as `google_gelu`
        says (see `from_dict`; default `"erf"`).
        """
        try:
            d = json.loads(storage.read_text(path))  # local or gs://
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object of model hyper-parameters")
        if google_format is None:
            google_format = not ("model_type" in d or d.get("bert_jax", False))
        try:
            return cls.from_dict(d, google_format=google_format, google_gelu=google_gelu, **overrides)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e

    def to_dict(self) -> dict:
        """Our fields in our meaning, marked so that `from_json_file` reads them back exactly
        (all but `fp8`, a training-time option)."""
        d = dataclasses.asdict(self)
        del d["fp8"]  # how a run trains, not what the model is (see the field)
        return {**d, "bert_jax": True}

    def to_json_file(self, path) -> None:
        storage.write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")  # local or gs://


def _google_hidden_act(d: dict, google_gelu: Optional[str]) -> str:
    """Our `hidden_act` for a Google config whose `hidden_act` is "gelu"; logs the choice once."""
    log = logging.getLogger("bert_jax.model.modeling")  # named, so that a CLI can show its INFO lines alone
    marker = d.get("bert_jax_hidden_act")
    if marker:  # written by our Google export: exact whatever the flag says
        same = {"gelu_new": "gelu_tanh"}.get(marker, marker)  # two names of the tanh form
        if google_gelu is not None and GOOGLE_GELUS[google_gelu] != same:
            log.warning("Google config: google_gelu=%r ignored: the file's bert_jax_hidden_act=%r "
                        "(written by bert_jax's export) names the GELU its weights use", google_gelu, marker)
        else:
            log.info("Google config: hidden_act=%r from the file's bert_jax_hidden_act marker", marker)
        return marker
    chosen = google_gelu or DEFAULT_GOOGLE_GELU
    how = "the default" if google_gelu is None else "chosen"
    if chosen == "erf":
        line = (f'Google config: hidden_act="gelu" read as the exact erf GELU (google_gelu="erf", {how}; '
                f'right for the 2018 releases); for a checkpoint trained with google-research/bert code of '
                f'2019-02-07 or later pass google_gelu="tanh" (convert CLI: --google_gelu=tanh)')
    else:
        line = (f'Google config: hidden_act="gelu" read as the tanh-approximated GELU (google_gelu="tanh", '
                f'{how}); for a checkpoint trained before 2019-02-07, e.g. the 2018 releases, pass '
                f'google_gelu="erf" (convert CLI: --google_gelu=erf)')
    # The default is a guess about how the checkpoint was trained: say it where it is seen.
    (log.warning if google_gelu is None else log.info)(line)
    return GOOGLE_GELUS[chosen]
