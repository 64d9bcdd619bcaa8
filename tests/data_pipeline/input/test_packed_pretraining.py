"""Packed pretraining rows (data_pipeline.input.packing, the pipeline's `packing=True`): several
sequences laid end to end in a row hold the original sequences, the XLA packer equals the plain
loop, and a packed batch runs and trains the model like the same sequences unpacked (losses and
gradients, scanned or not, with `sparse_last_layer`), next-sentence labels included.

The test records and their helpers are tests/helpers/numbered_records.py's.
"""

import numpy as np
import pytest
import tensorflow as tf

from data_pipeline.input import packing as packing_module
from tests.helpers.numbered_records import CLS, ID_BASE, L, P, SEP, VOCAB, make_record, originals, stack_records


# A small world of its own: a 100-token vocabulary, rows of L = 24 tokens, P = 3 predictions per
# sequence; packed rows of up to S = 4 sequences and Pp = 9 predictions.
_LOSS_L, _LOSS_P, _LOSS_S, _LOSS_PP = 24, 3, 4, 9
_LOSS_CLS, _LOSS_SEP, _LOSS_MASK = 1, 2, 3


def test_pack_window_by_hand():
    # The docstring example: L=8, S=3.
    def rec(tokens, label, masked):
        f = {"input_ids": tokens + [0] * (8 - len(tokens)), "input_mask": [1] * len(tokens) + [0] * (8 - len(tokens)),
             "segment_ids": [0] * 8, "masked_lm_positions": [masked, 0],
             "masked_lm_ids": [77, 0], "masked_lm_weights": [1.0, 0.0],
             "next_sentence_labels": [label]}
        return {k: np.array(v) for k, v in f.items()}
    a, b = rec([CLS, 5, SEP], 0, 1), rec([CLS, 6, 7, SEP], 1, 2)
    out = {k: v.numpy() for k, v in packing_module.pack_window(
        stack_records([a, b]), max_seq_length=8, max_seqs_per_pack=3, max_predictions_per_pack=4).items()}
    assert out["input_ids"].tolist() == [[CLS, 6, 7, SEP, CLS, 5, SEP, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert out["pack_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0]]
    assert out["input_mask"].tolist() == [[1] * 7 + [0]]
    assert out["cls_positions"].tolist() == [[0, 4, 0]]
    assert out["next_sentence_labels"].tolist() == [[1, 0, 0]]
    assert out["next_sentence_weights"].tolist() == [[1, 1, 0]]
    assert out["masked_lm_positions"].tolist() == [[2, 5, 0, 0]]  # b's 2, a's 1 + offset 4
    assert out["masked_lm_ids"].tolist() == [[77, 77, 0, 0]]
    assert out["masked_lm_weights"].tolist() == [[1, 1, 0, 0]]


@pytest.mark.parametrize("max_seqs,max_preds", [(3, 15), (4, 7), (1, 5)])
def test_packed_rows_hold_the_original_sequences(max_seqs, max_preds):
    records = [make_record(rid) for rid in range(60)]
    out = {k: v.numpy() for k, v in packing_module.pack_window(
        stack_records(records), max_seq_length=L, max_seqs_per_pack=max_seqs,
        max_predictions_per_pack=max_preds).items()}
    rows = len(out["input_ids"])
    assert rows < len(records) if max_seqs > 1 else rows == len(records)  # something was packed
    restored = originals(out)  # the static masks may cover the id token
    seen = []
    for r in range(rows):
        slots = np.flatnonzero(out["next_sentence_weights"][r])
        assert 1 <= len(slots) <= max_seqs and np.array_equal(slots, np.arange(len(slots)))
        assert np.array_equal(out["pack_ids"][r] > 0, out["input_mask"][r] > 0)
        assert out["masked_lm_weights"][r].sum() <= max_preds
        for s in slots:
            where = np.flatnonzero(out["pack_ids"][r] == s + 1)
            start = out["cls_positions"][r, s]
            assert where[0] == start and np.array_equal(where, start + np.arange(len(where)))
            rid = int(restored[r, start + 1]) - ID_BASE
            rec = records[rid]
            n = int(rec["input_mask"].sum())
            assert len(where) == n
            np.testing.assert_array_equal(out["input_ids"][r, where], rec["input_ids"][:n])
            np.testing.assert_array_equal(out["segment_ids"][r, where], rec["segment_ids"][:n])
            np.testing.assert_array_equal(out["position_ids"][r, where], np.arange(n))
            assert out["next_sentence_labels"][r, s] == rec["next_sentence_labels"][0]
            # This sequence's predictions, shifted by its start.
            mine = (out["masked_lm_weights"][r] > 0) & np.isin(out["masked_lm_positions"][r], where)
            k = int(rec["masked_lm_weights"].sum())
            np.testing.assert_array_equal(out["masked_lm_positions"][r][mine] - start,
                                          rec["masked_lm_positions"][:k])
            np.testing.assert_array_equal(out["masked_lm_ids"][r][mine], rec["masked_lm_ids"][:k])
            seen.append(rid)
        assert np.all(out["masked_lm_positions"][r][out["masked_lm_weights"][r] == 0] == 0)
    assert sorted(seen) == list(range(len(records)))  # none lost, none duplicated
    assert out["input_mask"].sum() == sum(int(r["input_mask"].sum()) for r in records)


def test_xla_packer_equals_the_plain_loop():
    rng = np.random.default_rng(1)
    for trial in range(4):
        n = 40
        lengths = tf.constant(rng.integers(3, L + 1, n), tf.int32)
        preds = tf.constant(rng.integers(0, P + 1, n), tf.int32)
        groups = tf.constant(np.sort(rng.integers(0, 2, n)), tf.int32)
        args = (lengths, preds, groups, tf.constant(L), tf.constant(1 + trial), tf.constant(2 * P))
        plain = [x.numpy() for x in packing_module._first_fit_loop(*args)]
        xla = [x.numpy() for x in packing_module._first_fit_xla(*args)]
        for a, b in zip(plain, xla):
            np.testing.assert_array_equal(a, b)


def test_packed_batch_runs_the_model_like_separate_sequences():
    """The model sees each packed sequence as if alone: same hidden states, own [CLS] pooling."""
    import jax
    import jax.numpy as jnp
    from bert_jax.model import model_config, modeling, pretraining_heads

    cfg = model_config.BertConfig(vocab_size=VOCAB + ID_BASE, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=L)
    model = pretraining_heads.BertForPreTraining(cfg)
    records = [make_record(rid, length=n) for rid, n in enumerate([9, 12, 7])]
    packed = {k: jnp.asarray(v.numpy()) for k, v in packing_module.pack_window(
        stack_records(records), max_seq_length=L, max_seqs_per_pack=3, max_predictions_per_pack=15).items()}
    assert packed["input_ids"].shape[0] == 1
    inputs = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "position_ids",
              "pack_ids", "cls_positions")
    params = jax.jit(model.init)(jax.random.key(0), **{k: packed[k] for k in inputs})
    apply = jax.jit(model.apply)
    out = apply(params, **{k: packed[k] for k in inputs})
    separate = {k: jnp.asarray(v.numpy()) for k, v in stack_records(records).items()}
    alone = apply(params, separate["input_ids"], separate["input_mask"], separate["segment_ids"],
                  separate["masked_lm_positions"])  # the three records as ordinary rows
    # Every position's hidden state: the encoder alone (the pretraining model's last layer runs at
    # the masked positions and [CLS] only).
    bert = jax.jit(modeling.BertModel(cfg).apply)
    bert_params = {"params": params["params"]["bert"]}
    seq = bert(bert_params, *(packed[k] for k in inputs if k != "masked_lm_positions")).sequence_output
    seq_alone = bert(bert_params, separate["input_ids"], separate["input_mask"],
                     separate["segment_ids"]).sequence_output
    restored = originals({k: np.asarray(v) for k, v in packed.items()})
    for s in range(3):
        start = int(packed["cls_positions"][0, s])
        rid = int(restored[0, start + 1]) - ID_BASE
        n = int(records[rid]["input_mask"].sum())
        np.testing.assert_allclose(seq[0, start:start + n], seq_alone[rid, :n], atol=2e-5)
        np.testing.assert_allclose(out.nsp_logits[0, s], alone.nsp_logits[rid], atol=2e-5)


# Weights drawn 5x wider than BERT's 0.02: at 0.02 the fresh model attends almost uniformly and its
# loss hardly depends on context (attention leaking across packed sequences moved the MLM loss by
# 1.6e-5 only; at 0.1 by 4e-3).
_LOSS_CONFIG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, initializer_range=0.1, dtype="float32")


def _loss_record(rid: int, n: int) -> dict:
    """Sequence `rid`: `[CLS] a.. [SEP] b.. [SEP]`, n tokens of ids 5..99, 1 to 3 of them masked."""
    rng = np.random.default_rng(100 + rid)
    ids = np.zeros(_LOSS_L, np.int64)
    ids[:n] = rng.integers(5, 100, n)
    sep_a = n // 2
    ids[0], ids[sep_a], ids[n - 1] = _LOSS_CLS, _LOSS_SEP, _LOSS_SEP
    segment = np.zeros(_LOSS_L, np.int64)
    segment[sep_a + 1:n] = 1
    k = min(_LOSS_P, max(1, (n - 3) // 2))
    positions = np.sort(rng.choice([i for i in range(1, n - 1) if i != sep_a], k, replace=False))
    record = {
        "input_ids": ids.copy(), "input_mask": (np.arange(_LOSS_L) < n).astype(np.int64),
        "segment_ids": segment,
        "masked_lm_positions": np.zeros(_LOSS_P, np.int64),
        "masked_lm_ids": np.zeros(_LOSS_P, np.int64),
        "masked_lm_weights": np.zeros(_LOSS_P, np.float32),
        "next_sentence_labels": np.array([rid % 3 == 0], np.int64),  # 1, 0, 0, 1, 0, 0
    }
    record["masked_lm_positions"][:k] = positions
    record["masked_lm_ids"][:k] = ids[positions]
    record["masked_lm_weights"][:k] = 1.0
    record["input_ids"][positions] = _LOSS_MASK
    return record


def _gradient_catcher():
    """An "optimizer" whose state after a step is that step's gradient (its updates are zero):
    `train_step` itself then hands back the gradient it computed, bit for bit."""
    import jax
    import jax.numpy as jnp
    import optax

    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@pytest.fixture(scope="module")
def unrolled_loss_params():
    """The pretraining model's parameters for `_LOSS_CONFIG`, unrolled layers (initialized once:
    the scanned cases stack the same ones)."""
    import flax.linen as nn
    import jax
    from bert_jax.model import model_config, modeling, pretraining_heads

    cfg = model_config.BertConfig(**_LOSS_CONFIG)
    return nn.meta.unbox(jax.jit(pretraining_heads.BertForPreTraining(cfg).init)(
        jax.random.key(0), **modeling.dummy_inputs(cfg, batch=1, length=8, predictions=1)))["params"]


# `sparse_last_layer` is ignored with `scan_layers` (`BertConfig`; the test checks that the scanned
# encoder then runs every position): three cases cover the three code paths.
@pytest.mark.parametrize("scan_layers,sparse_last_layer", [(False, False), (False, True), (True, True)],
                         ids=["unrolled", "unrolled-sparse", "scanned"])
def test_packed_batch_trains_like_separate_sequences(unrolled_loss_params, scan_layers,
                                                     sparse_last_layer):
    """`train_step` on a packed batch gives the loss and the gradients of the same sequences as
    ordinary rows: block-diagonal attention, restarted positions, one NSP prediction per [CLS].

    The losses are comparable as they stand: `train_step` normalizes MLM by the batch's total
    prediction weight and NSP by its total sequence weight (Google's means over predictions and
    over sequences), not per row, so 12 predictions and 6 sequences count the same whether they
    sit in 6 rows or in 2.
    """
    import functools

    import jax
    from bert_jax.model import model_config, modeling, pretraining_heads
    from bert_jax.pretrain import steps
    from bert_jax.training import train_state

    cfg = model_config.BertConfig(**_LOSS_CONFIG, scan_layers=scan_layers,
                              sparse_last_layer=sparse_last_layer)
    # 6 sequences of 5..10 tokens, 12 predictions; packed (first-fit decreasing) into 2 rows of 3
    # sequences, 8 + 7 + 6 and 10 + 9 + 5 tokens, each row with an empty 4th slot (weight 0).
    records = [_loss_record(rid, n) for rid, n in enumerate([7, 10, 5, 9, 6, 8])]
    unpacked = {k: v.numpy() for k, v in stack_records(records).items()}  # [6, L]: the pipeline's rows
    unpacked["next_sentence_weights"] = np.ones(len(records), np.float32)
    packed = {k: v.numpy() for k, v in packing_module.pack_window(
        stack_records(records), max_seq_length=_LOSS_L, max_seqs_per_pack=_LOSS_S,
        max_predictions_per_pack=_LOSS_PP).items()}
    assert packed["input_ids"].shape == (2, _LOSS_L)
    assert packed["input_mask"].sum(1).tolist() == [21, 24]  # rows in order of their first record
    assert packed["next_sentence_weights"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert packed["masked_lm_weights"].sum() == unpacked["masked_lm_weights"].sum() == 12
    # The last layer runs as configured: at the [CLS] and masked positions only, or everywhere.
    queries = [modeling.last_layer_queries(cfg, _LOSS_L, _LOSS_P, 1),
               modeling.last_layer_queries(cfg, _LOSS_L, _LOSS_PP, _LOSS_S)]
    assert queries == ([1 + _LOSS_P, _LOSS_S + _LOSS_PP] if sparse_last_layer and not scan_layers
                       else [None, None])

    params = unrolled_loss_params
    if scan_layers:
        params = modeling.stack_layers(params, cfg.num_hidden_layers)
    tx = _gradient_catcher()
    state = train_state.create_train_state(params, tx, jax.random.key(1))
    step = functools.partial(steps.train_step, model=pretraining_heads.BertForPreTraining(cfg), tx=tx,
                             schedule=lambda s: 0.0)
    # Both steps from the same state, in one program (one compilation: ~15% less CPU time).
    (s_unpacked, m_unpacked), (s_packed, m_packed) = jax.jit(
        lambda state, a, b: (step(state, a), step(state, b)))(state, unpacked, packed)
    assert m_unpacked["finite"] == m_packed["finite"] == 1
    assert m_unpacked["mlm_weight"] == m_packed["mlm_weight"] == 12
    assert m_unpacked["nsp_weight"] == m_packed["nsp_weight"] == 6

    # Measured on CPU (float32, all three cases): the MLM losses (4.80) differ by up to 3.2e-7, the
    # NSP losses (0.66) by 0, the totals by 4.8e-7; the gradients by up to 1.4e-7 (the largest is
    # 0.60), a tenth of their tolerance at most. Attention leaking across the packed sequences
    # moves the MLM loss by 4e-3 and a gradient by 2e-2.
    unpacked_loss, packed_loss = steps.summarize(m_unpacked), steps.summarize(m_packed)
    for name in ("masked_lm_loss", "next_sentence_loss"):
        np.testing.assert_allclose(packed_loss[name], unpacked_loss[name], rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    np.testing.assert_allclose(m_packed["loss"], m_unpacked["loss"], rtol=1e-6, atol=1e-6)
    grads_unpacked, grads_packed = s_unpacked.opt_state, s_packed.opt_state
    assert jax.tree.structure(grads_packed) == jax.tree.structure(grads_unpacked)
    leaves = jax.tree_util.tree_leaves_with_path(grads_unpacked)
    assert len(leaves) == (30 if scan_layers else 46)  # every parameter
    for (path, want), got in zip(leaves, jax.tree.leaves(grads_packed)):
        assert np.any(np.asarray(want) != 0), jax.tree_util.keystr(path)  # a real gradient
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_nsp_labels_and_weights_of_packed_and_unpacked_batches():
    """One NSP label per sequence: Google's `[B, 1]` squeezed to `[B]` for ordinary rows; a packed
    row's `[S]` slots kept as they are (even S = 1) with the packer's weights, 0 for empty slots."""
    import jax.numpy as jnp
    from bert_jax.pretrain import steps

    def check(batch, labels, weights):
        got_labels, got_weights = steps.nsp_labels_and_weights(
            {k: jnp.asarray(v) for k, v in batch.items()})
        assert got_labels.tolist() == labels
        assert got_weights.dtype == jnp.float32 and got_weights.tolist() == weights

    # What the packer makes of `[CLS] a [SEP]` (label 0) and `[CLS] b c [SEP]` (label 1) in a row
    # of 3 slots: the longer first, the third slot empty (test_pack_window_by_hand).
    def rec(tokens, label):
        pad = [0] * (8 - len(tokens))
        return {"input_ids": np.array(tokens + pad), "input_mask": np.array([1] * len(tokens) + pad),
                "segment_ids": np.zeros(8, int), "masked_lm_positions": np.array([1, 0]),
                "masked_lm_ids": np.array([77, 0]), "masked_lm_weights": np.array([1.0, 0.0]),
                "next_sentence_labels": np.array([label])}
    packed = {k: v.numpy() for k, v in packing_module.pack_window(
        stack_records([rec([CLS, 5, SEP], 0), rec([CLS, 6, 7, SEP], 1)]), max_seq_length=8,
        max_seqs_per_pack=3, max_predictions_per_pack=4).items()}
    check(packed, [[1, 0, 0]], [[1.0, 1.0, 0.0]])
    # Two packed rows by hand, the second full.
    two_rows = {"next_sentence_labels": [[1, 0, 0], [0, 1, 1]],
                "next_sentence_weights": [[1, 1, 0], [1, 1, 1]],
                "pack_ids": [[1, 1, 2, 2, 0], [1, 2, 2, 3, 3]]}
    check(two_rows, [[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [1, 1, 1]])
    # One sequence per packed row: `[R, 1]` stays `[R, 1]`, like the model's `[R, 1, 2]` NSP logits.
    check({"next_sentence_labels": [[1], [0]], "next_sentence_weights": [[1], [1]],
           "pack_ids": [[1, 1, 0], [1, 1, 1]]}, [[1], [0]], [[1], [1]])
    # Ordinary rows: Google's `[B, 1]` labels, weights 1 when absent, 0 on eval padding rows.
    check({"next_sentence_labels": [[1], [0], [1]]}, [1, 0, 1], [1, 1, 1])
    check({"next_sentence_labels": [[1], [0], [0]], "next_sentence_weights": [1, 1, 0]},
          [1, 0, 0], [1, 1, 0])
