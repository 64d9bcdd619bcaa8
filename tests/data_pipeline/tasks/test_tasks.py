"""data_pipeline.tasks without a model: metrics against independent computations, reading the
distributed formats, bad input, featurization, post-processing (SQuAD: test_squad.py)."""

import json
import os

import numpy as np
import pytest

from bert_jax.finetune import bucketing, batches as finetune_batches
from data_pipeline import tasks
from data_pipeline.tasks import glue, multiple_choice, ner

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")


# ---------------------------------------------------------------------------------------------
# GLUE metrics vs scikit-learn / scipy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_metrics_match_sklearn(seed):
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.RandomState(seed)
    gold = [str(x) for x in rng.randint(0, 2, 50)]
    pred = [str(x) for x in rng.randint(0, 2, 50)]
    assert glue.accuracy(gold, pred) == pytest.approx(metrics.accuracy_score(gold, pred))
    assert glue.f1_binary(gold, pred) == pytest.approx(metrics.f1_score(gold, pred, pos_label="1"))
    assert glue.matthews_corrcoef(gold, pred) == pytest.approx(metrics.matthews_corrcoef(gold, pred))
    three_gold = list(rng.choice(["contradiction", "entailment", "neutral"], 40))
    three_pred = list(rng.choice(["contradiction", "entailment", "neutral"], 40))
    assert glue.matthews_corrcoef(three_gold, three_pred) == pytest.approx(
        metrics.matthews_corrcoef(three_gold, three_pred))
    # Degenerate cases: constant predictions give MCC 0 (as scikit-learn), no positives F1 0.
    assert glue.matthews_corrcoef(gold, ["1"] * 50) == metrics.matthews_corrcoef(gold, ["1"] * 50) == 0.0
    assert glue.f1_binary(["0", "0"], ["0", "0"]) == 0.0


def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.RandomState(3)
    x = np.round(rng.rand(60) * 5, 1)  # ties
    y = x + rng.randn(60)
    assert glue.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0])
    assert glue.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0])
    np.testing.assert_allclose(glue.rankdata([3, 1, 3, 2]), stats.rankdata([3, 1, 3, 2]))


# ---------------------------------------------------------------------------------------------
# GLUE files
# ---------------------------------------------------------------------------------------------


def test_glue_formats_as_distributed(tmp_path, vocab):
    cola = tmp_path / "CoLA"
    cola.mkdir()
    (cola / "train.tsv").write_text("gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\n")  # no header
    (cola / "dev.tsv").write_text("gj04\t1\t\tThe dog sat.\n")
    (cola / "test.tsv").write_text("index\tsentence\n0\tThe cat.\n1\tA dog.\n")
    task = tasks.get_task("cola", str(tmp_path))
    train = task.read("train")
    assert [(e.text_a, e.label) for e in train] == [("The cat sat.", "1"), ("Cat the sat.", "0")]
    test = task.read("test")
    assert [(e.guid, e.label) for e in test] == [("0", None), ("1", None)]
    mrpc = tmp_path / "MRPC"
    mrpc.mkdir()
    (mrpc / "msr_paraphrase_train.txt").write_text(
        "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tJohn sat.\tJohn was on the mat.\n",
        encoding="utf-8")
    (mrpc / "test.tsv").write_text("index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\ta\tb\n")
    task = tasks.get_task("mrpc", str(tmp_path))
    assert [(e.text_a, e.text_b, e.label) for e in task.read("train")] == [("John sat.", "John was on the mat.", "1")]
    assert task.read("test")[0].label is None
    # Features: [CLS] a [SEP] b [SEP], segments, padding; labels as indices.
    features = task.featurize(task.read("train"), task.make_tokenizer(vocab, True), 12, training=True)
    toks = task.make_tokenizer(vocab, True).convert_ids_to_tokens(features["input_ids"][0][:11])
    assert toks == ["[CLS]", "john", "sat", ".", "[SEP]", "john", "was", "on", "the", "mat", "."]
    np.testing.assert_array_equal(features["segment_ids"][0], [0] * 5 + [1] * 7)
    assert features["input_mask"][0].sum() == 12 and features["label"].tolist() == [1]
    # Submission files: index, prediction.
    paths = task.write_predictions(task.read("test"), ["1"], str(tmp_path / "out"), "test")
    assert open(paths[-1]).read() == "index\tprediction\n0\t1\n"


def test_glue_bad_rows_name_file_and_row(tmp_path):
    rte = tmp_path / "RTE"
    rte.mkdir()
    (rte / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
                                   "1\ta\tb\tmaybe\n2\tonly two\n3\ta\tb\tnot_entailment\n")
    with pytest.raises(tasks.DataError, match=r"RTE/train.tsv: row 3: label 'maybe' is not one of"):
        tasks.get_task("rte", str(tmp_path)).read("train")
    lenient = tasks.get_task("rte", str(tmp_path), skip_bad_rows=True)
    assert [e.guid for e in lenient.read("train")] == ["0", "3"]
    assert lenient.skipped == {str(rte / "train.tsv"): 2}
    sts = tmp_path / "STS-B"
    sts.mkdir()
    (sts / "train.tsv").write_text("index\tsentence1\tsentence2\tscore\n0\ta\tb\t7.5\n")
    with pytest.raises(tasks.DataError, match=r"row 2: similarity score '7.5'"):
        tasks.get_task("stsb", str(tmp_path)).read("train")



def test_glue_row_with_extra_columns_is_a_bad_row_like_a_short_one(tmp_path):
    rte = tmp_path / "RTE"
    rte.mkdir()
    (rte / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
                                   "1\ta\tb\tc\tentailment\n2\ta\tb\tnot_entailment\t\n"
                                   "3\ta\tb\tnot_entailment\n")
    with pytest.raises(tasks.DataError, match=r"RTE/train.tsv: row 3: 5 tab-separated fields, expected 4"):
        tasks.get_task("rte", str(tmp_path)).read("train")
    lenient = tasks.get_task("rte", str(tmp_path), skip_bad_rows=True)
    assert [e.guid for e in lenient.read("train")] == ["0", "3"]
    assert lenient.skipped == {str(rte / "train.tsv"): 2}  # what the fine-tuning log's totals show
    cola = tmp_path / "CoLA"  # headerless: 4 positional columns
    cola.mkdir()
    (cola / "train.tsv").write_text("gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\textra\n")
    lenient = tasks.get_task("cola", str(tmp_path), skip_bad_rows=True)
    assert [e.text_a for e in lenient.read("train")] == ["The cat sat."]
    assert lenient.skipped == {str(cola / "train.tsv"): 1}


def test_glue_rows_end_at_newline_only_a_stray_carriage_return_stays_in_its_field(tmp_path):
    rte = tmp_path / "RTE"
    rte.mkdir()
    # A lone \r inside a field (it would split the row under universal newlines), CRLF endings.
    (rte / "train.tsv").write_bytes(b"index\tsentence1\tsentence2\tlabel\r\n"
                                    b"0\tone\rtwo\tb\tentailment\r\n1\ta\tb\r\tnot_entailment\n")
    examples = tasks.get_task("rte", str(tmp_path)).read("train")  # strict: no bad row
    assert [(e.guid, e.text_a, e.text_b, e.label) for e in examples] == [
        ("0", "one\rtwo", "b", "entailment"), ("1", "a", "b\r", "not_entailment")]
    assert tasks.read_tsv(str(rte / "train.tsv"))[1] == ["0", "one\rtwo", "b", "entailment"]


def test_glue_header_only_file_names_its_path(tmp_path):
    rte = tmp_path / "RTE"
    rte.mkdir()
    (rte / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    with pytest.raises(tasks.DataError, match=r"RTE/dev.tsv: no rows after the header"):
        tasks.get_task("rte", str(tmp_path)).read("dev")
    (rte / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n\n")
    with pytest.raises(tasks.DataError, match=r"RTE/dev.tsv: none of its 1 rows is usable \(1 skipped as bad\)"):
        tasks.get_task("rte", str(tmp_path), skip_bad_rows=True).read("dev")


def test_task_files_that_are_not_utf8_name_the_line_and_column(tmp_path):
    """Latin-1 bytes in a labelled file (GLUE tsv, CoNLL, SQuAD json, SWAG csv) are named, not
    decoded into U+FFFD or a bare UnicodeDecodeError; a UTF-8 BOM is still fine for GLUE."""
    rte = tmp_path / "RTE"
    rte.mkdir()
    (rte / "train.tsv").write_bytes("\ufeffindex\tsentence1\tsentence2\tlabel\n0\tcafé\tb\tentailment\n".encode())
    assert tasks.get_task("rte", str(tmp_path)).read("train")[0].text_a == "café"
    (rte / "train.tsv").write_bytes(b"index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\tcaf\xe9\tb\tentailment\n")
    with pytest.raises(tasks.DataError, match=r"RTE/train.tsv: line 3, column 6: byte 0xe9 is not valid UTF-8"):
        tasks.get_task("rte", str(tmp_path)).read("train")
    (rte / "train.tsv").write_bytes("\ufeffindex\tsentence1\tsentence2\tlabel\n".encode() + b"0\tcaf\xe9\tb\tentailment\n")
    with pytest.raises(tasks.DataError, match=r"RTE/train.tsv: line 2, column 6: byte 0xe9"):  # after a BOM
        tasks.get_task("rte", str(tmp_path)).read("train")
    (tmp_path / "train.txt").write_bytes(b"John NNP B-NP I-PER\n\nM\xfcller NNP B-NP I-PER\n")
    with pytest.raises(tasks.DataError, match=r"train.txt: line 3, column 2: byte 0xfc"):
        tasks.get_task("conll2003", str(tmp_path)).read("train")
    (tmp_path / "train-v1.1.json").write_bytes(b'{"data": [{"title": "caf\xe9"}]}')
    with pytest.raises(tasks.DataError, match=r"train-v1.1.json: line 1, column 25"):
        tasks.get_task("squad_v1", str(tmp_path)).read("train")
    (tmp_path / "train.csv").write_bytes(b"a,b\n1,caf\xe9\n")
    with pytest.raises(tasks.DataError, match=r"train.csv: line 2, column 6"):
        tasks.get_task("swag", str(tmp_path)).read("train")


def test_glue_scores_and_postprocess():
    task = tasks.get_task("mrpc", "/unused")
    examples = [glue.Example(str(i), "a", "b", lab) for i, lab in enumerate(["1", "0", "1", "1"])]
    predictions = task.postprocess(examples, {}, {"logits": np.array([[0, 1], [1, 0], [1, 0], [0, 1.]])})
    assert predictions == ["1", "0", "0", "1"]
    scores = task.score(examples, predictions)
    assert scores["accuracy"] == 0.75 and scores["f1"] == pytest.approx(0.8)
    assert scores["score"] == pytest.approx((0.75 + 0.8) / 2)
    stsb = tasks.get_task("stsb", "/unused")
    assert stsb.head == "regression" and stsb.num_outputs == 1
    assert stsb.postprocess(examples, {}, {"logits": np.array([1.0, 2.0])}) == [1.0, 2.0]
    mnli = tasks.get_task("mnli", "/unused")
    assert mnli.eval_splits == ("dev_matched", "dev_mismatched") and mnli.num_outputs == 3


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


def test_batches_pad_with_weight_zero_and_split_hosts():
    features = {"x": np.arange(10), "weight": np.ones(10, np.float32)}
    one = list(finetune_batches.batches(features, ["x"], 4, shuffle_seed=7))
    assert len(one) == 3 and [b["weight"].tolist() for b in one][-1] == [1, 1, 0, 0]
    seen = np.concatenate([b["x"][b["weight"] > 0] for b in one])
    assert sorted(seen.tolist()) == list(range(10))  # every row exactly once
    hosts = [list(finetune_batches.batches(features, ["x"], 4, process_index=p, process_count=2, shuffle_seed=7))
             for p in range(2)]
    for b in range(3):  # host rows, concatenated in process order, are the global batch
        np.testing.assert_array_equal(np.concatenate([hosts[0][b]["x"], hosts[1][b]["x"]]), one[b]["x"])
        np.testing.assert_array_equal(np.concatenate([hosts[0][b]["weight"], hosts[1][b]["weight"]]), one[b]["weight"])


def test_bucket_lengths_by_hand():
    assert bucketing.bucket_lengths(64, 4) == (16, 32, 48, 64)
    assert bucketing.bucket_lengths(128, 4) == (32, 64, 96, 128)
    assert bucketing.bucket_lengths(100, 3) == (40, 72, 100)  # 34 -> 40, 67 -> 72, then the length itself
    assert bucketing.bucket_lengths(10, 4) == (8, 10)
    assert bucketing.bucket_lengths(64, 0) == bucketing.bucket_lengths(64, 1) == (64,)
    with pytest.raises(ValueError, match="buckets=-1"):
        bucketing.bucket_lengths(64, -1)


def test_batch_needs_are_the_lengths_batches_cut_to():
    """Per batch, the longest real row: what `batches` cuts each batch to when every length is
    allowed (the last batch completed with row 0, as there)."""
    rng = np.random.RandomState(3)
    lengths = rng.randint(1, 33, size=37)
    mask = (np.arange(32)[None] < lengths[:, None]).astype(np.int32)
    features = {"input_ids": mask, "input_mask": mask, "weight": np.ones(37, np.float32)}
    for seed in (0, 1, 2):
        order = np.random.RandomState(seed).permutation(37)
        cut = [b["input_ids"].shape[1] for b in finetune_batches.batches(features, ["input_ids"], 8, order=order,
                                                               lengths=tuple(range(1, 33)), sequence_keys=("input_ids",))]
        assert bucketing.batch_needs(bucketing.row_lengths(mask), 8, order).tolist() == cut
    assert bucketing.batch_needs(np.array([5, 9, 3, 7, 2]), 2, np.array([4, 2, 0, 1, 3])).tolist() == [3, 9, 7]


def _set_cost(needs, chosen, top, compile_cost):
    """A brute-force reference: each batch at the shortest chosen length holding it."""
    chosen = sorted(chosen)
    return len(chosen) * compile_cost + sum(next(n for n in chosen if n >= need) / top for need in needs)


def test_choose_lengths_is_the_cheapest_set_of_all():
    """Against every subset of the lengths (holding the longest batch), on random runs: the chosen
    set costs the least, and no set as cheap has fewer lengths."""
    import itertools
    rng = np.random.RandomState(0)
    for trial in range(60):
        lengths = tuple(sorted(rng.choice(np.arange(8, 129, 8), size=rng.randint(1, 7), replace=False).tolist()))
        needs = rng.randint(0, lengths[-1] + 1, size=rng.randint(1, 80))
        cost = float(rng.choice([0, 0.5, 3, 8, 20, 1000]))
        chosen = bucketing.choose_lengths(needs, lengths, cost)
        valid = [c for r in range(1, len(lengths) + 1) for c in itertools.combinations(lengths, r)
                 if max(c) >= needs.max()]
        best = min(_set_cost(needs, c, lengths[-1], cost) for c in valid)
        assert _set_cost(needs, chosen, lengths[-1], cost) == pytest.approx(best, rel=1e-12), (lengths, cost)
        fewest = min(len(c) for c in valid if _set_cost(needs, c, lengths[-1], cost) <= best * (1 + 1e-12))
        assert len(chosen) == fewest
        assert set(chosen) <= set(lengths) and list(chosen) == sorted(chosen)


def test_choose_lengths_by_hand():
    # SST-2's first 2,000 shuffled rows at length 64, batch 32: 11 batches need 32, 43 need 48, 9 need 64.
    needs = [32] * 11 + [48] * 43 + [64] * 9
    assert bucketing.choose_lengths(needs, (16, 32, 48, 64), 8) == (48, 64)  # 65.5 against 71 and 70.75
    assert bucketing.choose_lengths(needs, (16, 32, 48, 64), 0) == (32, 48, 64)  # free compiles: every length used
    assert bucketing.choose_lengths(needs, (16, 32, 48, 64), 20) == (64,)
    assert bucketing.choose_lengths([3, 5], (8, 16), 0) == (8,)  # nothing needs 16: not compiled
    assert bucketing.choose_lengths([], (8, 16), 1) == (16,)
    with pytest.raises(ValueError, match="past the longest length 16"):
        bucketing.choose_lengths([17], (8, 16), 1)
    with pytest.raises(ValueError, match="ascending"):
        bucketing.choose_lengths([1], (16, 8), 1)
    with pytest.raises(ValueError, match="compile_cost=-1"):
        bucketing.choose_lengths([1], (8, 16), -1)


def test_batches_are_cut_to_the_global_batchs_longest_row_on_every_host():
    lengths = np.array([3, 9, 2, 4, 16, 5, 1, 7, 8, 2])  # real positions of each row
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.int32)
    features = {"input_ids": mask * (np.arange(10)[:, None] + 1), "input_mask": mask,
                "label_ids": mask * 2, "label": np.arange(10), "weight": np.ones(10, np.float32)}
    keys = ["input_ids", "input_mask", "label_ids", "label"]
    seq = ("input_ids", "input_mask", "label_ids")
    order = np.array([0, 2, 3, 6, 1, 7, 8, 5, 4, 9])  # batches of 4: longest 4, 9 and 16 (the last completed with row 0)
    whole = list(finetune_batches.batches(features, keys, 4, order=order, lengths=(8, 12, 16), sequence_keys=seq))
    assert [b["input_ids"].shape[1] for b in whole] == [8, 12, 16]
    padded = list(finetune_batches.batches(features, keys, 4, order=order))
    for cut, full in zip(whole, padded):
        n = cut["input_ids"].shape[1]
        for k in seq:  # the kept columns as they were; nothing real cut off
            np.testing.assert_array_equal(cut[k], full[k][:, :n])
            assert not full[k][:, n:].any()
        np.testing.assert_array_equal(cut["label"], full["label"])
    # Two hosts: each cuts its half to the global batch's length, even when its own rows are shorter.
    hosts = [list(finetune_batches.batches(features, keys, 4, order=order, lengths=(8, 12, 16), sequence_keys=seq,
                                process_index=p, process_count=2)) for p in range(2)]
    for b in range(3):
        for k in keys:
            np.testing.assert_array_equal(np.concatenate([hosts[0][b][k], hosts[1][b][k]]), whole[b][k])
    assert bucketing.row_lengths(mask).tolist() == lengths.tolist()
    # Multiple choice ([rows, choices, length]): the longest choice counts.
    choices = np.zeros((2, 3, 16), np.int32)
    choices[0, 1, :11] = 1
    assert bucketing.row_lengths(choices).tolist() == [11, 0] and bucketing.trimmed_length(choices, (8, 12, 16)) == 12


# ---------------------------------------------------------------------------------------------
# NER: conlleval semantics, reading, featurization
# ---------------------------------------------------------------------------------------------


def test_conlleval_hand_worked_iob1_and_iob2():
    # IOB1: "I-PER I-PER B-PER" is two persons; IOB2 writes them "B-PER I-PER B-PER".
    iob1 = [["I-PER", "I-PER", "B-PER", "O", "I-LOC"]]
    iob2 = [["B-PER", "I-PER", "B-PER", "O", "B-LOC"]]
    for gold in (iob1, iob2):
        assert ner.conlleval(gold, gold)["entities_gold"] == 3
        assert ner.conlleval(gold, iob1)["f1"] == 1.0 and ner.conlleval(gold, iob2)["f1"] == 1.0
    # One person merged into the other: predicted 2 entities (PER x3 -> one, LOC), 1 correct (LOC).
    out = ner.conlleval(iob2, [["B-PER", "I-PER", "I-PER", "O", "B-LOC"]])
    assert (out["entities_correct"], out["entities_predicted"], out["entities_gold"]) == (1, 2, 3)
    assert out["precision"] == 0.5 and out["recall"] == pytest.approx(1 / 3)
    assert out["f1"] == pytest.approx(0.4) and out["accuracy"] == pytest.approx(0.8)
    # Type mismatch inside a span is wrong; an I- after O starts an entity (conlleval, not seqeval strict).
    out = ner.conlleval([["B-ORG", "I-ORG", "O"]], [["B-ORG", "I-LOC", "O"]])
    assert out["entities_correct"] == 0 and out["entities_predicted"] == 2
    out = ner.conlleval([["O", "B-MISC", "O"]], [["O", "I-MISC", "O"]])
    assert out["f1"] == 1.0
    # A sentence boundary ends entities.
    assert ner.conlleval([["I-PER"], ["I-PER"]], [["I-PER"], ["I-PER"]])["entities_gold"] == 2
    assert ner.conlleval([["B-LOC"]], [["B-LOC"]])["f1_LOC"] == 1.0


def _official():
    with open(os.path.join(FIXTURES, "official_scorers.json"), encoding="utf-8") as fh:
        return json.load(fh)


def test_conlleval_matches_the_perl_script_on_perturbed_tags():
    """ner.conlleval against conlleval (Perl) on 60 CoNLL-2003 valid sentences with perturbed
    tags (wrong types, dropped entities, B/I swaps, spurious entities)."""
    ref = _official()["conlleval"]
    out = ner.conlleval(ref["gold"], ref["predicted"])
    for key in ("entities_gold", "entities_predicted", "entities_correct"):
        assert out[key] == ref[key], key
    for key in ("accuracy", "precision", "recall", "f1"):
        assert round(100 * out[key], 2) == ref[key], key
    for kind, f1 in ref["f1_per_type"].items():
        assert round(100 * out[f"f1_{kind}"], 2) == f1, kind


def test_conll_reading_and_bad_tags(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("-DOCSTART- -X- -X- O\n\nJohn NNP B-NP I-PER\nsat VBD B-VP O\n\nParis NNP B-NP I-LOC\n")
    task = tasks.get_task("conll2003", str(tmp_path))
    assert [(e.words, e.tags) for e in task.read("train")] == [
        (["John", "sat"], ["I-PER", "O"]), (["Paris"], ["I-LOC"])]
    path.write_text("John NNP B-NP I-PER\nsat VBD B-VP B-VERB\n\nParis NNP B-NP I-LOC\nbad\n")
    with pytest.raises(tasks.DataError, match=r"train.txt: row 2: tag 'B-VERB'"):
        task.read("train")
    lenient = tasks.get_task("conll2003", str(tmp_path), skip_bad_rows=True)
    assert lenient.read("train") == [] and sum(lenient.skipped.values()) == 2


def test_ner_labels_first_pieces_and_splits_long_sentences(tmp_path, vocab, capsys):
    task = tasks.get_task("conll2003", str(tmp_path))
    words = ["Unaffable", "John", "Smith", "sat", "in", "Paris", "."]
    tags = ["O", "B-PER", "I-PER", "O", "O", "B-LOC", "O"]
    examples = [ner.Example(words, tags)]
    tok = task.make_tokenizer(vocab, True)
    f = task.featurize(examples, tok, 32, training=True)
    pieces = tok.convert_ids_to_tokens(f["input_ids"][0][:11])
    assert pieces == ["[CLS]", "una", "##ffa", "##ble", "john", "smith", "sat", "in", "paris", ".", "[SEP]"]
    assert f["label_weights"][0][:11].tolist() == [0, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0]
    assert [task.labels[i] for i, w in zip(f["label_ids"][0], f["label_weights"][0]) if w] == tags
    # max_seq_length 6: rows of at most 4 pieces, cut between words, every word labelled once.
    short = task.featurize(examples, tok, 6, training=True)
    assert len(short["input_ids"]) == 3 and short["label_weights"].sum() == len(words)
    one_hot = np.eye(len(task.labels))[short["label_ids"]]
    assert task.postprocess(examples, short, {"logits": one_hot}) == [tags]
    task.show_progress = True
    shown = task.featurize(examples, tok, 6, training=True)
    assert all(np.array_equal(shown[k], short[k]) for k in short)
    assert "conll2003: featurize" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# SWAG
# ---------------------------------------------------------------------------------------------


def test_swag_csv(tmp_path, vocab):
    header = ",video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label\n"
    (tmp_path / "train.csv").write_text(header + '0,v,1,"x","The cat sat.","The dog",gold,sat.,ran.,"was, on",is.,2\n'
                                        + "1,v,2,x,a,b,gold,c,d,e,f,7\n")
    with pytest.raises(tasks.DataError, match=r"train.csv: row 3: label '7'"):
        tasks.get_task("swag", str(tmp_path)).read("train")
    task = tasks.get_task("swag", str(tmp_path), skip_bad_rows=True)
    examples = task.read("train")
    assert len(examples) == 1 and examples[0].endings[2] == "was, on" and examples[0].label == 2
    f = task.featurize(examples, task.make_tokenizer(vocab, True), 12, training=True)
    assert f["input_ids"].shape == (1, multiple_choice.NUM_CHOICES, 12)
    toks = task.make_tokenizer(vocab, True).convert_ids_to_tokens(f["input_ids"][0, 2][:11])
    assert toks == ["[CLS]", "the", "cat", "sat", ".", "[SEP]", "the", "dog", "was", ",", "on"]
    assert task.postprocess(examples, f, {"logits": np.array([[0.1, 0.2, 0.9, 0.0]])}) == [2]
    assert task.score(examples, [2]) == {"accuracy": 1.0}


def test_unknown_task_is_rejected():
    with pytest.raises(ValueError, match="config.task must be one of"):
        tasks.get_task("imagenet", "/x")
    assert tasks.get_task("SST-2", "/x").name == "sst2" and tasks.get_task("squad", "/x").name == "squad_v1"
