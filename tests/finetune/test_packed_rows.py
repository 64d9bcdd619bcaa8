"""Fine-tuning rows packed several to a row (bert_jax/finetune/row_packing.py, config.packing).

The reference for packed steps is the unpacked model (itself checked against HF's Flax BERT in
test_modeling.py): the same rows give the same logits, loss and gradients, packed or not.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.finetune import batches as finetune_batches, heads
from bert_jax.model import model_config
from bert_jax.finetune import row_packing


def test_first_fit_places_longest_first_in_the_first_row_with_room():
    # By hand: 9 opens row 0, 7 opens row 1 (9 + 7 > 12), 5 joins row 1 (7 + 5 = 12), 3 joins row 0.
    rows, offsets, slots = row_packing.first_fit([5, 9, 3, 7], 12)
    assert rows.tolist() == [1, 0, 0, 1]
    assert offsets.tolist() == [7, 0, 9, 0]
    assert slots.tolist() == [1, 0, 1, 0]
    # Ties keep their order; a sequence of the row's whole length is alone.
    rows, offsets, slots = row_packing.first_fit([4, 4, 8, 4], 8)
    assert rows.tolist() == [1, 1, 0, 2] and offsets.tolist() == [0, 4, 0, 0] and slots.tolist() == [0, 1, 0, 0]
    with pytest.raises(ValueError, match="1..8"):
        row_packing.first_fit([9], 8)


def _first_fit_by_hand(lengths, row_length):
    """The rule as a plain loop over the sequences (the module packs every batch at once)."""
    rows, offsets, slots = {}, {}, {}
    fill, count = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # sorted() is stable
        n = lengths[i]
        r = next((r for r, f in enumerate(fill) if f + n <= row_length), len(fill))
        if r == len(fill):
            fill.append(0)
            count.append(0)
        rows[i], offsets[i], slots[i] = r, fill[r], count[r]
        fill[r] += n
        count[r] += 1
    return rows, offsets, slots


def test_first_fit_of_many_batches_at_once_is_the_plain_loop_on_each():
    rng = np.random.RandomState(7)
    lengths = rng.randint(1, 17, size=(50, 12)) * (rng.rand(50, 12) < 0.8)  # 0: no sequence
    rows, offsets, slots = row_packing.first_fit(lengths, 16)
    for b in range(50):
        present = [int(x) for x in np.flatnonzero(lengths[b])]
        want = _first_fit_by_hand([int(lengths[b, i]) for i in present], 16)
        for k, i in enumerate(present):
            assert (rows[b, i], offsets[b, i], slots[b, i]) == (want[0][k], want[1][k], want[2][k]), (b, i)
        assert (rows[b][lengths[b] == 0] == -1).all()
    need_rows, need_slots = row_packing.needs(lengths, np.ones_like(lengths), 16)
    np.testing.assert_array_equal(need_rows, rows.max(axis=1) + 1)
    np.testing.assert_array_equal(need_slots, slots.max(axis=1) + 1)


def _optimal_rows(lengths, row_length):
    """The fewest rows, by trying every assignment (small inputs only)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for assignment in itertools.product(range(k), repeat=n):
            fill = np.bincount(assignment, weights=lengths, minlength=k)
            if fill.max() <= row_length:
                return k
    return n


def test_first_fit_rows_are_disjoint_and_within_first_fit_decreasings_bound():
    """Random cases: no two sequences overlap, every one fits its row, slots count up from 0 in
    each row, and the rows used are within first-fit-decreasing's bound 11/9 OPT + 6/9 (Dosa
    2007) of the optimum found by brute force."""
    rng = np.random.RandomState(0)
    for _ in range(40):
        row_length = int(rng.choice([8, 12, 16]))
        lengths = rng.randint(1, row_length + 1, size=rng.randint(1, 8))
        rows, offsets, slots = row_packing.first_fit(lengths, row_length)
        for r in np.unique(rows):
            here = np.flatnonzero(rows == r)
            taken = np.zeros(row_length, int)
            for i in here:
                assert offsets[i] + lengths[i] <= row_length
                taken[offsets[i]:offsets[i] + lengths[i]] += 1
            assert taken.max() == 1
            assert sorted(slots[here].tolist()) == list(range(len(here)))
        assert sorted(np.unique(rows).tolist()) == list(range(rows.max() + 1))
        assert rows.max() + 1 <= 11 / 9 * _optimal_rows(lengths, row_length) + 6 / 9


def _random_batch(rng, b, length, head="classification"):
    lengths = rng.randint(3, length + 1, size=b)
    ids, mask, segments = (np.zeros((b, length), np.int32) for _ in range(3))
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.randint(5, 96, n)
        ids[i, 0] = 2  # [CLS]
        mask[i, :n] = 1
        segments[i, n // 2:n] = 1
    weight = np.ones(b, np.float32)
    weight[rng.choice(b, 2, replace=False)] = 0.0
    batch = dict(input_ids=ids, input_mask=mask, segment_ids=segments, weight=weight)
    if head == "token":  # a label at some real positions, as a word's first piece
        batch["label_ids"] = rng.randint(0, 3, (b, length)).astype(np.int32) * mask
        batch["label_weights"] = ((rng.rand(b, length) < 0.6) * mask).astype(np.float32)
    else:
        batch["label"] = (rng.randint(0, 3, b).astype(np.int32) if head == "classification"
                          else rng.rand(b).astype(np.float32))
    return batch, lengths


def test_pack_lays_every_weighted_row_end_to_end_and_leaves_out_the_others():
    rng = np.random.RandomState(1)
    batch, lengths = _random_batch(rng, 16, 16)
    need_rows, need_slots = row_packing.needs(row_packing.sequence_lengths(batch["input_mask"]), batch["weight"], 16)
    out = row_packing.pack(batch, need_rows + 1, need_slots)
    assert out["input_ids"].shape == (need_rows + 1, 16) and out["cls_positions"].shape == (need_rows + 1, need_slots)
    found = 0
    for r, s in zip(*np.nonzero(out["weight"])):
        start = out["cls_positions"][r, s]
        where = np.flatnonzero(out["pack_ids"][r] == s + 1)
        n = len(where)
        assert where.tolist() == list(range(start, start + n))  # one contiguous run from its [CLS]
        assert out["position_ids"][r, where].tolist() == list(range(n))
        # The batch row it came from: its tokens, segments, label and weight.
        i = [i for i in range(16) if lengths[i] == n and batch["weight"][i] != 0
             and (batch["input_ids"][i, :n] == out["input_ids"][r, where]).all()]
        assert i, (r, s)
        i = i[0]
        assert (out["segment_ids"][r, where] == batch["segment_ids"][i, :n]).all()
        assert out["input_mask"][r, where].all()
        assert out["label"][r, s] == batch["label"][i] and out["weight"][r, s] == batch["weight"][i]
        found += 1
    assert found == int((batch["weight"] != 0).sum()) == 14
    # Nothing else: positions outside the sequences are padding, empty slots weigh nothing.
    assert out["input_mask"].sum() == lengths[batch["weight"] != 0].sum()
    assert ((out["pack_ids"] > 0) == (out["input_mask"] > 0)).all()
    assert out["input_ids"][-1].sum() == 0 and out["weight"][-1].sum() == 0  # the spare row
    assert need_rows < 14  # fewer rows than it had
    with pytest.raises(ValueError, match="past the"):
        row_packing.pack(batch, need_rows - 1, need_slots)


def test_a_packed_token_batch_carries_each_rows_labels_and_weights_at_its_positions():
    rng = np.random.RandomState(4)
    batch, lengths = _random_batch(rng, 12, 16, "token")
    batch["weight"][np.flatnonzero(batch["weight"])[0]] = 0.5  # a weight other than 1 is carried too
    out = row_packing.pack(batch, 12, 12)
    assert "cls_positions" not in out and "label" not in out
    assert out["weight"].tolist() == (out["pack_ids"].max(axis=1) > 0).tolist()  # rows in use
    for i in np.flatnonzero(batch["weight"]):
        n = lengths[i]
        (r, o), = [(r, o) for r in range(12) for o in range(16 - n + 1)
                   if out["position_ids"][r, o] == 0 and out["input_mask"][r, o]
                   and (out["input_ids"][r, o:o + n] == batch["input_ids"][i, :n]).all()
                   and (out["label_ids"][r, o:o + n] == batch["label_ids"][i, :n]).all()][:1]
        np.testing.assert_array_equal(out["label_weights"][r, o:o + n],
                                      batch["label_weights"][i, :n] * batch["weight"][i])
    assert out["label_weights"].sum() == pytest.approx((batch["label_weights"] * batch["weight"][:, None]).sum())


@pytest.mark.parametrize("head,outputs", [("classification", 3), ("regression", 1), ("token", 3)])
def test_a_packed_batch_gives_the_unpacked_logits_loss_and_gradients(head, outputs):
    """Dropout off: the same rows, packed or padded one to a row, give the same logits (each
    slot's, or each position's, against its row's), loss and parameter gradients, to float
    rounding; empty slots and the left-out weight-0 rows change nothing."""
    cfg = model_config.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
    rng = np.random.RandomState(2)
    batch, _ = _random_batch(rng, 12, 16, head)
    model = heads.BertForTask(cfg, head, outputs)
    params = nn.meta.unbox(model.init(jax.random.key(0), *(batch[k][:1] for k in heads.MODEL_INPUTS))["params"])
    need_rows, need_slots = row_packing.needs(row_packing.sequence_lengths(batch["input_mask"]), batch["weight"], 16)
    pack = row_packing.pack(batch, need_rows + 1, need_slots + 1)

    def loss(p, b):
        out = model.apply({"params": p}, **heads.model_inputs(b))
        sums = heads.loss_sums(head, out, b)
        return sums["loss_sum"] / sums["weight"], out["logits"]

    loss_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (loss_padded, logits_padded), grads_padded = loss_and_grad(params, batch)
    (loss_packed, logits_packed), grads_packed = loss_and_grad(params, pack)
    keep = np.flatnonzero(batch["weight"])
    lengths = row_packing.sequence_lengths(batch["input_mask"][keep])
    rows, offsets, slots = row_packing.first_fit(lengths, 16)
    if head == "token":
        for i, n, r, o in zip(keep, lengths, rows, offsets):
            np.testing.assert_allclose(np.asarray(logits_packed)[r, o:o + n], np.asarray(logits_padded)[i, :n],
                                       atol=1e-6, rtol=1e-6)
        assert logits_packed.shape[:2] == (need_rows + 1, 16)
    else:
        np.testing.assert_allclose(np.asarray(logits_packed)[rows, slots], np.asarray(logits_padded)[keep],
                                   atol=1e-6, rtol=1e-6)
        assert logits_packed.shape[:2] == (need_rows + 1, need_slots + 1)
    np.testing.assert_allclose(float(loss_packed), float(loss_padded), rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
                           grads_packed, grads_padded)
    assert float(jnp.abs(grads_padded["head"]["output"]["kernel"]).max()) > 1e-3  # a real gradient


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("process_count", [1, 2])
def test_the_packing_plan_holds_every_hosts_batch_of_every_step(stream, process_count):
    """`plan_packing` sizes each step from the rows the loop's batches really hold (of
    `batches.batches` per epoch, or `stream_batches`), per host: every host's slice packs into its
    share of the step's rows, the most sequences a row ever holds is the plan's slots, and with
    free compiles each step gets the fewest rows (rounded to the mesh) that hold every slice."""
    rng = np.random.RandomState(3)
    n, batch, length = 37, 8, 16
    lengths = np.where(rng.rand(n) < 0.7, rng.randint(3, 6, n), rng.randint(9, 17, n))
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
    features = {"input_ids": mask * 7, "input_mask": mask, "segment_ids": 0 * mask,
                "label": np.arange(n) % 2, "weight": np.ones(n, np.float32)}
    features["weight"][5] = 0.0  # an unlabelled row
    keys = ("input_ids", "input_mask", "segment_ids", "label")
    total, epochs = (11, 3) if stream else (15, 3)
    rows, real = finetune_batches.training_rows(n, batch, 4, total, epochs, stream)
    assert rows.shape == (total, batch)
    for cost in (0.0, 1e9):
        step_rows, slots = finetune_batches.plan_packing(features, rows, real, length, cost=cost, batch_shards=2,
                                                 process_count=process_count)
        assert len(step_rows) == total and (step_rows % 2 == 0).all() and (step_rows % process_count == 0).all()
        if cost:
            assert len(set(step_rows.tolist())) == 1  # one program
        most_slots, fewest = 0, []
        for p in range(process_count):
            hosts = dict(process_index=p, process_count=process_count)
            if stream:
                host_batches = finetune_batches.stream_batches(features, keys, batch, range(total), seed=4, **hosts)
            else:
                host_batches = (b for e in range(epochs)
                                for b in finetune_batches.batches(features, keys, batch, shuffle_seed=4 + e, **hosts))
            for k, b in enumerate(host_batches):
                out = row_packing.pack(b, int(step_rows[k]) // process_count, slots)  # fits, or raises
                used = out["pack_ids"].max(axis=1)
                most_slots = max(most_slots, int(used.max()))
                fewest.append((k, int((used > 0).sum())))
        assert most_slots == slots
        if not cost:
            per_step = np.zeros(total, int)
            for k, r in fewest:
                per_step[k] = max(per_step[k], r)
            unit = int(np.lcm(2, process_count))
            np.testing.assert_array_equal(step_rows, -(-np.maximum(per_step, 1) * process_count // unit) * unit)


@pytest.mark.parametrize("head", ["span", "multiple_choice"])
def test_heads_that_read_a_whole_row_refuse_packed_rows(head):
    cfg = model_config.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32)
    ids = np.ones((2, 2, 8) if head == "multiple_choice" else (2, 8), np.int32)
    with pytest.raises(ValueError, match="packed rows are for"):
        heads.BertForTask(cfg, head, 2).init(jax.random.key(0), ids, ids, 0 * ids, pack_ids=ids)
