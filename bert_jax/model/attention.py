"""Attention behind one call: the masks it takes, and the kernel that computes it.

This module owns `make_attention_mask` and `make_sequence_ids` (the same mask in the two forms the
kernels take) and `attention`, which dispatches on `BertConfig.attention_impl`:

* "einsum": explicit einsums with a float32 softmax and dropout on the probabilities (training);
* "dot_product": on TPU the Pallas splash (flash) kernel, on GPU cuDNN's fused kernel, each where
  it applies (probed here: `_splash_applies`, `_cudnn_applies`, `_cudnn_trains`), XLA's attention
  elsewhere.

A local (sliding-window) attention, `attention(..., local_window=half)` (ModernBERT's local layers),
goes to the same kernels where they take the window (`local_kernel`): splash with its `LocalMask`,
cuDNN with `local_window_size` (which jax 0.10.2 refuses for a two-sided window: see `local_kernel`);
elsewhere the window is the band mask `band` ANDed into the mask.

The projections around it (query, key, value, output) are `bert_jax.model.modeling.SelfAttention`'s.

This module must not import tensorflow.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model import mixed_precision
from bert_jax.model.dropout import dropout

Array = jax.Array

# Logical names of q, k and v, `[batch, length, heads, head_dim]` (see `bert_jax.training.sharding`): the
# layout `SelfAttention` constrains them to and the one the splash kernel is split by.
ACT_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def make_attention_mask(input_mask: Array, pack_ids: Optional[Array] = None,
                        causal: bool = False) -> Array:
    """Boolean attention mask `[batch, 1, query, key]`.

    Args:
      input_mask: `[batch, length]`, 1 for real tokens and 0 for padding. As in Google's reference,
        masking is on keys only: a padding query still attends to the real keys.
      pack_ids: optional `[batch, length]` id of the packed sequence each token belongs to
        (1, 2, ... and 0 for padding). Tokens attend only within their own sequence.
      causal: also forbid attending to later positions (left-to-right model).
    """
    keys = input_mask.astype(bool)[:, None, None, :]  # [batch, 1, 1, key]
    mask = keys
    if pack_ids is not None:
        same = pack_ids[:, :, None] == pack_ids[:, None, :]  # [batch, query, key]
        mask = jnp.logical_and(mask, same[:, None, :, :])
    if causal:
        length = input_mask.shape[-1]
        tril = jnp.tril(jnp.ones((length, length), dtype=bool))  # [query, key]
        mask = jnp.logical_and(mask, tril[None, None])
    return mask


def make_sequence_ids(input_mask: Array, pack_ids: Optional[Array] = None) -> Array:
    """The attention mask as one id per token, `[batch, length]` int32: what the TPU kernel takes.

    A query attends to exactly the keys with its own id (the splash kernel's `SegmentIds`; not
    BERT's token-type `segment_ids`). Real tokens get their pack id (1 when unpacked), padding 0.
    Every real query then sees the real keys of its own sequence, as `make_attention_mask` says.
    Padding queries differ: they attend to the padding keys instead of the real ones. Their
    outputs never reach a real token (no real query attends to a padding key) nor any loss, and
    this way no query is left without a key (the kernel's softmax needs one in every row).

    Example (one row, two packed sequences and one padding token):

        input_mask = [1, 1, 1, 1, 0], pack_ids = [1, 1, 2, 2, 0]  ->  [1, 1, 2, 2, 0]
    """
    ids = jnp.ones_like(input_mask, jnp.int32) if pack_ids is None else pack_ids.astype(jnp.int32)
    return jnp.where(input_mask.astype(bool), ids, 0)


def band(length: int, half_window: int) -> Array:
    """`[1, 1, length, length]`: True where `|query - key| <= half_window`, a local window (transformers'
    ModernBERT: `local_attention // 2` tokens on each side, bidirectional)."""
    i = np.arange(length)
    return jnp.asarray(np.abs(i[:, None] - i[None, :]) <= half_window)[None, None]


def banded_attention(query: Array, key: Array, value: Array, keys_ok: Array, pack_ids: Optional[Array],
                     half_window: int, dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None,
                     mixed_matmuls: bool = False) -> Array:
    """Local attention computed by blocks: what the band mask computes for every real query, at ~3/`L` of its cost.

    The row is cut into blocks of `half_window` tokens; a query's keys within `half_window` lie in its
    own block and the two beside it, so each block of queries scores only those `3 * half_window` keys
    (masked to the band, to real keys and to its own packed sequence) instead of all `L`. A real query's
    result equals the masked full attention's (the same keys, the same float32 softmax); a padding
    query with no real key in reach averages its window instead of the row (no real token reads it).

    query, key, value: `[batch, length, heads, head_dim]`; keys_ok: `[batch, length]` real keys;
    pack_ids: `[batch, length]` or None; mixed_matmuls: the two matmuls with bf16 inputs, float32 out.
    Returns `[batch, length, heads, head_dim]`.
    """
    batch, length, heads, head_dim = query.shape
    w = max(half_window, 1)
    n = -(-length // w)
    padded = n * w
    pad = lambda x, value=0: jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2),  # noqa: E731
                                     constant_values=value)
    ids = jnp.ones((batch, length), jnp.int32) if pack_ids is None else pack_ids.astype(jnp.int32)
    q = pad(query).reshape(batch, n, w, heads, head_dim)

    def context(x, value=0):  # [batch, n, 3w, ...]: blocks k-1, k, k+1 for every block k
        x = jnp.pad(pad(x, value), [(0, 0), (w, w)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
        x = x.reshape(batch, n + 2, w, *x.shape[2:])
        return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)

    k, v = context(key), context(value)
    k_ok, k_ids = context(keys_ok.astype(bool), False), context(ids, -1)
    q_ids = pad(ids, -2).reshape(batch, n, w)
    offsets = np.arange(w)[:, None] - (np.arange(3 * w)[None, :] - w)  # query - key, [w, 3w]
    mask = jnp.asarray(np.abs(offsets) <= half_window)[None, None]
    mask = mask & k_ok[:, :, None, :] & (q_ids[..., None] == k_ids[:, :, None, :])  # [batch, n, w, 3w]
    if mixed_matmuls:  # [batch, n, heads, w, 3w]
        logits = mixed_precision.einsum("bnqhd,bnkhd->bnhqk", q, k) / np.sqrt(head_dim)
    else:
        logits = jnp.einsum("bnqhd,bnkhd->bnhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(head_dim)
    logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    if dropout_rate > 0.0 and dropout_rng is not None:
        probs = dropout(probs, dropout_rate, dropout_rng)
    if mixed_matmuls:  # [batch, n, w, heads, head_dim]
        out = mixed_precision.einsum("bnhqk,bnkhd->bnqhd", probs, v).astype(value.dtype)
    else:
        out = jnp.einsum("bnhqk,bnkhd->bnqhd", probs.astype(value.dtype), v)
    return out.reshape(batch, padded, heads, head_dim)[:, :length]


# ---------------------------------------------------------------------------------------------
# The dispatch
# ---------------------------------------------------------------------------------------------


def attention(query: Array, key: Array, value: Array, mask: Array, *, impl: str,
              sequence_ids: Optional[Array] = None, causal: bool = False,
              local_window: Optional[int] = None,
              dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None,
              mixed_matmuls: bool = False) -> Array:
    """Scaled dot-product attention with a boolean mask; the softmax runs in float32.

    Args:
      query, key, value: `[batch, length, heads, head_dim]`.
      mask: boolean, broadcastable to `[batch, heads, query, key]`.
      impl: "einsum" (explicit einsum + float32 softmax) or "dot_product": on TPU the Pallas
        splash (flash) attention kernel where it applies (`_splash_applies`), on GPU
        `jax.nn.dot_product_attention` with cuDNN's fused kernel where it applies, XLA's
        attention elsewhere.
      sequence_ids: `[batch, length]` from `make_sequence_ids`, the same mask in the form the
        TPU kernel takes (without it the kernel is not used). Outputs at padding queries then
        differ from the other paths (see `make_sequence_ids`).
      causal: whether `mask` includes the left-to-right mask (the TPU kernel applies it itself).
      local_window: a local window of this many keys on each side: a query sees the keys with
        `|query - key| <= local_window` (`band`; `mask` need not hold it). With "dot_product" the
        kernel that takes the window computes it (`local_kernel`): splash's `LocalMask` on TPU,
        cuDNN's `local_window_size` on GPU where cuDNN takes it; elsewhere `band` is ANDed into
        `mask`. Self-attention only, not with `causal`.
      dropout_rate, dropout_rng: dropout on the attention probabilities (einsum only).
      mixed_matmuls: the two matmuls with bfloat16 inputs and float32 outputs
        (`bert_jax.model.mixed_precision`, `BertConfig.mixed_matmuls`); "dot_product" then runs
        "einsum"'s computation (XLA's attention on a CPU) unless the splash kernel applies.

    Masked logits get a large negative finite value (not -inf), so a fully padded row yields
    uniform weights instead of NaN.
    """
    head_dim = query.shape[-1]
    scale = 1.0 / np.sqrt(head_dim)
    if local_window is not None:
        if causal or local_window < 0 or query.shape[1] != key.shape[1]:
            raise ValueError(f"local_window={local_window}: a window >= 0 of self-attention (query length "
                             f"{query.shape[1]}, key length {key.shape[1]}), without causal (causal={causal})")
    if impl == "dot_product":
        if dropout_rate > 0.0 and dropout_rng is not None:
            raise ValueError(
                "attention_impl='dot_product' has no attention-probability dropout: set "
                "attention_probs_dropout_prob=0 or attention_impl='einsum' for training")
        if sequence_ids is not None and _splash_applies(query):
            return _splash_attention(query, key, value, sequence_ids, causal=causal, local_window=local_window)
        if local_window is not None and local_kernel(query, local_window, impl, sequence_ids) == "cudnn":
            full = jnp.broadcast_to(mask, (query.shape[0], 1, query.shape[1], key.shape[1]))
            return jax.nn.dot_product_attention(query, key, value, mask=full, scale=scale,
                                                local_window_size=(local_window, local_window),
                                                implementation="cudnn")
    if local_window is not None:  # no kernel takes the window: the band mask
        mask = jnp.logical_and(mask, band(query.shape[1], local_window))
    if impl == "dot_product":
        if not mixed_matmuls:
            return _dot_product_attention(query, key, value, mask, scale)
        # Mixed matmuls (a CPU): XLA's attention there is this einsum, softmax, einsum (below, without
        # dropout), its two matmuls in the mixed form.
    # [batch, heads, query, key], accumulated and kept in float32.
    if mixed_matmuls:
        logits = mixed_precision.einsum("bqhd,bkhd->bhqk", query, key)
    else:
        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    logits = logits * scale
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    if dropout_rate > 0.0 and dropout_rng is not None:
        probs = dropout(probs, dropout_rate, dropout_rng)
    # [batch, query, heads, head_dim]
    if mixed_matmuls:
        return mixed_precision.einsum("bhqk,bkhd->bqhd", probs, value).astype(value.dtype)
    probs = probs.astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


def local_kernel(query: Array, local_window: int, impl: str,
                 sequence_ids: Optional[Array] = None) -> Optional[str]:
    """The kernel that computes `attention(..., local_window=local_window)` by itself, or None.

    * "splash" (TPU): splash attention with `LocalMask((L, L), window_size=(w, w), offset=0)` per
      head, which skips the tiles outside the window, and the sequence ids for padding and packing
      (`_splash_applies`; needs `sequence_ids`);
    * "cudnn" (GPU): `jax.nn.dot_product_attention(..., local_window_size=(w, w),
      implementation="cudnn")` with the mask, where cuDNN takes it, probed with its gradient like
      every cuDNN shape (`_cudnn_trains`). jax 0.10.2 refuses it: cuDNN's sliding window is
      one-sided (`sliding_window_length`, keys `(q - w - 1, q]`, for causal masks only), and
      `dot_product_attention` raises "cuDNN doesn't support right window" for any right side
      above 0 without `is_causal`. The refusal is logged once per shape and the window falls back
      to the band mask, whatever XLA or cuDNN then computes with it (as on CPU), so a later jax
      that takes a two-sided window gets it with no change here;
    * None: the caller's band mask (`band`), or ModernBERT's blocks (`banded_attention`).

    Only `impl="dot_product"` uses the kernels.
    """
    if impl != "dot_product":
        return None
    if sequence_ids is not None and _splash_applies(query):
        return "splash"
    if _cudnn_applies(query):
        length = query.shape[1]
        shapes = ((tuple(query.shape), jnp.dtype(query.dtype)),) * 3 + (
            ((query.shape[0], 1, length, length), jnp.dtype(bool)),)
        if _cudnn_trains(shapes, float(1.0 / np.sqrt(query.shape[-1])), local_window):
            return "cudnn"
    return None


# ---------------------------------------------------------------------------------------------
# cuDNN fused attention (GPU)
# ---------------------------------------------------------------------------------------------


def _cudnn_applies(query: Array) -> bool:
    """cuDNN's fused (flash) attention: GPUs, 16-bit inputs, head sizes it has kernels for."""
    return (jax.default_backend() == "gpu" and query.dtype in (jnp.bfloat16, jnp.float16)
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 128)


@functools.lru_cache(maxsize=None)
def _cudnn_trains(shapes: tuple, scale: float, local_window: Optional[int] = None) -> bool:
    """Whether cuDNN's fused attention takes q, k, v and mask of these `(shape, dtype)`s with a
    gradient (and `local_window_size=(local_window, local_window)` if given), probed abstractly.

    cuDNN's rules for training (e.g. with a mask, even lengths only) run in its custom VJP's
    forward rule, which JAX traces only for a gradient, and, inside `jit`, `nn.scan` or `remat`,
    only once the forward pass has been traced: too late to fall back to another kernel. So the
    forward and its VJP are traced here with `jax.eval_shape` (no computation), once per set of
    shapes (every layer has the same). A refusal, whatever its type, is logged and sends the
    call to XLA's attention.
    """
    window = {} if local_window is None else {"local_window_size": (local_window, local_window)}

    def forward_and_vjp(q, k, v, m):
        fused = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=m, scale=scale,
                                                             implementation="cudnn", **window)
        out, pullback = jax.vjp(fused, q, k, v)
        return pullback(out)

    try:
        jax.eval_shape(forward_and_vjp, *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes))
        return True
    except Exception as e:  # noqa: BLE001  (any refusal: XLA's attention is always correct)
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if local_window is None:
            logging.warning("cuDNN fused attention refused q %s, kv %s (%s); using XLA's attention",
                            shapes[0][0], shapes[1][0], reason)
        else:
            logging.warning("cuDNN fused attention refused q %s, kv %s with local_window_size (%d, %d) "
                            "(%s); using the band mask", shapes[0][0], shapes[1][0], local_window,
                            local_window, reason)
        return False


def _dot_product_attention(query: Array, key: Array, value: Array, mask: Array,
                           scale: float) -> Array:
    """`jax.nn.dot_product_attention` on cuDNN's fused kernel where it applies, XLA elsewhere.

    (`implementation=None` means XLA: cuDNN must be asked for by name.) The boolean mask becomes
    an additive bias inside the cuDNN kernel, so padding, packing and causal masks all keep their
    exact meaning; on an H100 this cost 1.4% of a BERT-base step against cuDNN's per-row length
    mask, which would assume the padding sits at the end of every row (benchmarks/step/RESULTS.md).
    Shapes cuDNN takes in inference but not in training go to XLA in both (`_cudnn_trains`):
    one program whether or not it is differentiated.
    """
    full = jnp.broadcast_to(mask, (query.shape[0], 1, query.shape[1], key.shape[1]))
    if _cudnn_applies(query) and _cudnn_trains(
            tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in (query, key, value, full)), float(scale)):
        return jax.nn.dot_product_attention(query, key, value, mask=full, scale=scale,
                                            implementation="cudnn")
    return jax.nn.dot_product_attention(query, key, value, mask=full, scale=scale,
                                        implementation="xla")


# ---------------------------------------------------------------------------------------------
# Pallas splash attention (TPU)
# ---------------------------------------------------------------------------------------------

# Sequence tiles of the splash kernel, largest first: the length must be a multiple of one. Its
# key tiles must be multiples of the TPU's 128 lanes; 512 is MaxText's default tile.
_SPLASH_BLOCKS = (512, 256, 128)
# Head sizes: BERT's 64 and the common 128 and 256, each compiled ahead of time for v5e slices at
# lengths 128 to 1024 (smaller sizes compile too but leave most of the 128 lanes idle).
_SPLASH_HEAD_DIMS = (64, 128, 256)


def _target_platform() -> str:
    """The platform being compiled for: that of the mesh set with `jax.set_mesh` if any (an
    ahead-of-time compile on a CPU host targets TPU devices this way), else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.default_backend() if device is None else device.platform


def _splash_shards(query: Array) -> Optional[jax.sharding.PartitionSpec]:
    """The partition spec of `[batch, length, heads, head_dim]` activations on the current mesh
    (from the logical axis rules, as `SelfAttention` constrains q, k and v), or None when the
    kernel cannot run per shard: the length or head_dim sharded, or a size that does not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.sharding.PartitionSpec()
    spec = nn.logical_to_mesh_axes(ACT_HEADS)
    dims = [() if a is None else ((a,) if isinstance(a, str) else tuple(a)) for a in spec]
    if dims[1] or dims[3]:
        return None  # each shard must see whole sequences and whole heads
    for axes, size in zip(dims, query.shape):
        if any(a not in mesh.axis_names for a in axes):
            return None
        if size % int(np.prod([mesh.shape[a] for a in axes])):
            return None
    return jax.sharding.PartitionSpec(*(a or None for a in dims))


def _splash_applies(query: Array) -> bool:
    """The splash kernel: compiling for TPU, a length that tiles, a head size and dtype it has
    kernels for, and q/k/v that split over the mesh by whole sequences and heads."""
    length, head_dim = query.shape[1], query.shape[-1]
    return (_target_platform() == "tpu" and query.dtype in (jnp.bfloat16, jnp.float32)
            and any(length % b == 0 for b in _SPLASH_BLOCKS) and head_dim in _SPLASH_HEAD_DIMS
            and _splash_shards(query) is not None)


def _splash_block(length: int, local_window: Optional[int] = None) -> int:
    """The kernel's tile: the largest that divides `length`; with a local window, the largest not
    above `max(128, 2 * local_window)`, so that a query tile scores about its window's keys (three
    tiles) rather than three 512-key tiles (a window of 64 a side: 384 keys a query instead of
    1,536; chosen by this count, not timed on a TPU)."""
    cap = _SPLASH_BLOCKS[0] if local_window is None else max(_SPLASH_BLOCKS[-1], 2 * local_window)
    return next(b for b in _SPLASH_BLOCKS if length % b == 0 and b <= cap)


def _splash_kernel(heads: int, length: int, causal: bool, interpret: bool,
                   local_window: Optional[int] = None):
    """The splash kernel for one example's `[heads, length, head_dim]`: the full, causal or local
    (`|query - key| <= local_window`: `LocalMask` with `window_size=(w, w)`, `offset=0`) mask.

    Built afresh in every trace (a few small numpy block tables): its tables become arrays of
    the trace being built, which must not outlive it (so no cache).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = _splash_block(length, local_window)
    if local_window is not None:
        static = splash.LocalMask((length, length), window_size=(local_window, local_window), offset=0)
    else:
        static = splash.CausalMask((length, length)) if causal else splash.FullMask((length, length))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(splash.MultiHeadMask([static] * heads), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_attention(query: Array, key: Array, value: Array, sequence_ids: Array, *,
                      causal: bool, local_window: Optional[int] = None, interpret: bool = False) -> Array:
    """Pallas splash attention on TPU: `[batch, length, heads, head_dim]` in and out.

    The kernel takes one example's heads-major q, k, v (vmapped over the batch), computes the
    logits and softmax in float32 and does not scale the logits, so the queries are scaled here.
    `sequence_ids` (`make_sequence_ids`) is the mask; `causal` adds the kernel's causal mask and
    `local_window` its local one (`|query - key| <= local_window`), whose all-masked tiles it
    skips. XLA cannot partition a Mosaic kernel, so on the mesh of
    `jax.set_mesh` it runs under `jax.shard_map`, each device on its own examples and heads
    (`_splash_shards`); without a mesh it is one call, right for a program on one device (a
    program sharded without `jax.set_mesh` fails to compile: our loops all set the mesh).
    `interpret=True` runs the kernel as ordinary JAX ops, on any backend (the tests, on CPU).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    length = query.shape[1]
    query = query * jnp.asarray(1.0 / np.sqrt(query.shape[-1]), query.dtype)

    def per_shard(q, k, v, ids):
        kernel = _splash_kernel(q.shape[2], length, causal, interpret, local_window)
        one = lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash.SegmentIds(ids, ids))
        # [batch, length, heads, head_dim] -> [batch, heads, length, head_dim] and back.
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        return jnp.swapaxes(jax.vmap(one)(q, k, v, ids), 1, 2)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_shard(query, key, value, sequence_ids)
    spec = _splash_shards(query)
    ids_spec = jax.sharding.PartitionSpec(spec[0], None)  # [batch, length]: split as the batch
    # check_vma=False: the kernel's pallas_calls do not declare how their outputs vary over the
    # mesh, which the check requires; every output is per shard, as out_specs says.
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec, ids_spec),
                         out_specs=spec, check_vma=False)(query, key, value, sequence_ids)
