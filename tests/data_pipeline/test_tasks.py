"""data_pipeline.tasks without a model: metrics against independent computations, reading the
distributed formats, bad input, featurization, post-processing, the SQuAD scorer's CLI."""

import hashlib
import json
import os

import numpy as np
import pytest

from bert_jax.finetune import bucketing, batches as finetune_batches
from data_pipeline import tasks, tokenization
from data_pipeline.tasks import glue, multiple_choice, ner, squad, squad_eval

WORDS = ["the", "cat", "sat", "on", "mat", "john", "smith", "lives", "in", "paris", "cafe", "una", "##ffa",
         "##ble", "who", "where", "is", "was", "a", "dog", ".", ",", "?", "1996", "-", "08"]
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


@pytest.fixture
def vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    return str(path)


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
# SQuAD
# ---------------------------------------------------------------------------------------------


def test_squad_normalization_and_f1_hand_worked():
    assert squad_eval.normalize_answer("The  Cat, sat!") == "cat sat"
    assert squad_eval.normalize_answer("an apple a day") == "apple day"
    assert squad_eval.normalize_answer("theater") == "theater"  # articles only as whole words
    assert squad_eval.normalize_answer("Hello-World") == "helloworld"  # punctuation removed, not split
    assert squad_eval.exact_match_score("the Eiffel Tower.", "Eiffel tower") == 1.0
    # pred "the big red dog" -> [big, red, dog]; gold "red dog" -> [red, dog]: P 2/3, R 1, F1 0.8.
    assert squad_eval.f1_score_v1("the big red dog", "red dog") == pytest.approx(0.8)
    assert squad_eval.f1_score_v1("cat", "dog") == 0.0
    assert squad_eval.f1_score_v2("", "") == 1.0 and squad_eval.f1_score_v2("dog", "") == 0.0
    gold = [("q1", ["red dog", "a dog"]), ("q2", ["Paris"]), ("q3", ["1996"])]
    out = squad_eval.evaluate_v1(gold, {"q1": "the big red dog", "q2": "paris", "q3": "1996"})
    assert out == pytest.approx({"exact_match": 200 / 3, "f1": 100 * (0.8 + 1.0 + 1.0) / 3})


def test_squad_partial_predictions_fail_unless_allowed(tmp_path, capsys):
    gold = [("q1", ["red dog", "a dog"]), ("q2", ["Paris"]), ("q3", ["1996"]), ("q4", [])]
    preds = {"q1": "the big red dog", "q2": "paris"}
    for evaluate in (squad_eval.evaluate_v1, squad_eval.evaluate_v2):
        with pytest.raises(ValueError, match=r"2 of 4 questions have no prediction \(e.g. q3, q4\).*allow_partial"):
            evaluate(gold, preds)
    # v1.1's official rule: a missing question scores 0 and stays in the total.
    assert squad_eval.evaluate_v1(gold[:3], preds, allow_partial=True) == pytest.approx(
        {"exact_match": 100 / 3, "f1": 100 * 1.8 / 3})
    assert "scoring a partial prediction file: 1 of 3 questions" in capsys.readouterr().err
    # v2.0's official rule: only the predicted questions count (the script then fails on HasAns).
    out = squad_eval.evaluate_v2(gold, preds, allow_partial=True)
    assert out["total"] == 2 and out["exact"] == 50.0 and out["HasAns_total"] == 2 and "NoAns_total" not in out
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "John lives in Paris.", "qas": [
        {"id": "q1", "question": "where?", "answers": [{"text": "Paris", "answer_start": 14}]},
        {"id": "q2", "question": "who?", "answers": [{"text": "John", "answer_start": 0}]}]}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(data))
    (tmp_path / "pred.json").write_text(json.dumps({"q1": "Paris"}))
    args = [str(tmp_path / "dev.json"), str(tmp_path / "pred.json")]
    assert squad_eval.main(args) == 2
    assert "pred.json: 1 of 2 questions have no prediction (e.g. q2)" in capsys.readouterr().err
    assert squad_eval.main(args + ["--allow_partial"]) == 0
    assert json.loads(capsys.readouterr().out) == {"exact_match": 50.0, "f1": 50.0}


def test_squad_v2_scores_and_best_threshold_hand_worked():
    gold = [("a", ["x y"]), ("b", []), ("c", ["z"]), ("d", [])]
    preds = {"a": "x y", "b": "", "c": "w", "d": "q"}
    na = {"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.3}
    out = squad_eval.evaluate_v2(gold, preds, na)
    # Raw: a 1, b 1 (empty = empty), c 0, d 0. na_prob_thresh 1.0 changes nothing.
    assert out["exact"] == 50.0 and out["total"] == 4
    assert out["HasAns_exact"] == 50.0 and out["HasAns_total"] == 2
    assert out["NoAns_exact"] == 50.0 and out["NoAns_total"] == 2
    # Thresholds, ascending na: start at 2 (all no-answer right); a (+1) = 3 at 0.1; d (-1) = 2;
    # c (+0) = 2; b (+0) = 2 -> best 3 of 4 at threshold 0.1.
    assert out["best_exact"] == 75.0 and out["best_exact_thresh"] == 0.1
    assert squad_eval.evaluate_v2(gold, preds)["exact"] == 50.0 and "best_f1" not in squad_eval.evaluate_v2(gold, preds)
    assert squad_eval.evaluate_v2(gold, preds, na, na_prob_thresh=0.2)["exact"] == 75.0  # c, d, b -> no answer


def test_squad_cli_prints_the_official_keys(tmp_path, capsys):
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "John lives in Paris.", "qas": [
        {"id": "q1", "question": "where?", "answers": [{"text": "Paris", "answer_start": 14}]},
        {"id": "q2", "question": "who?", "answers": [{"text": "John", "answer_start": 0}]}]}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(data))
    (tmp_path / "pred.json").write_text(json.dumps({"q1": "Paris", "q2": "lives"}))
    (tmp_path / "na.json").write_text(json.dumps({"q1": 0.0, "q2": 2.0}))
    assert squad_eval.main([str(tmp_path / "dev.json"), str(tmp_path / "pred.json")]) == 0
    assert json.loads(capsys.readouterr().out) == {"exact_match": 50.0, "f1": 50.0}
    squad_eval.main([str(tmp_path / "dev.json"), str(tmp_path / "pred.json"), "--version_2",
                "--na_prob_file", str(tmp_path / "na.json")])
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total",
                         "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"]
    assert out["exact"] == 50.0  # q2's na 2.0 > 1.0: predicted no-answer, wrong for an answerable

    # Bad input: one line on stderr naming the file (exit 2), never a traceback or a silent 0.
    bad = {"list.json": b'["Paris", "John"]', "dicts.json": b'{"q1": {"text": "Paris"}}',
           "cut.json": b'{"q1": "Par', "latin1.json": b'{"q1": "caf\xe9"}'}
    expected = {"list.json": "expected a JSON object {question id: answer text}, got a list",
                "dicts.json": "question 'q1': the answer text is a dict, not a string",
                "cut.json": "line 1, column 8: not valid JSON", "latin1.json": "line 1, column 12: byte 0xe9"}
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
        assert squad_eval.main([str(tmp_path / "dev.json"), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert name in err and expected[name] in err, err
    (tmp_path / "na_bad.json").write_text(json.dumps({"q1": "high"}))
    assert squad_eval.main([str(tmp_path / "dev.json"), str(tmp_path / "pred.json"), "--version_2",
                       "--na_prob_file", str(tmp_path / "na_bad.json")]) == 2
    assert "the no-answer score is a str, not a number" in capsys.readouterr().err


def test_doc_windows_and_max_context():
    assert squad.doc_windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert squad.doc_windows(3, 4, 3) == [(0, 3)]
    windows = squad.doc_windows(10, 4, 3)
    # Token 3 is in windows (0..3) and (3..6): min(3, 0) vs min(0, 3) tie -> 0.01*4 each -> first wins.
    assert squad.is_max_context(windows, 0, 3) and not squad.is_max_context(windows, 3, 3)
    # Token 4: (3..6) gives min(1, 2) = 1 > window 0's none: window 3.
    assert squad.is_max_context(windows, 3, 4)


def _squad_file(tmp_path, qas, context="John Smith lives in Paris, the cafe."):
    path = tmp_path / "train-v1.1.json"
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": context, "qas": qas}]}]}))
    return str(tmp_path)


def test_squad_featurize_maps_answers_through_offsets(tmp_path, vocab, capsys):
    context = "John Smith lives in Paris, the Unaffable cafe."
    qas = [{"id": "q1", "question": "Where does he live?", "answers": [{"text": "Paris", "answer_start": 20}]},
           {"id": "q2", "question": "Which cafe?", "answers": [{"text": "Unaffable", "answer_start": 31}]}]
    task = tasks.get_task("squad_v1", _squad_file(tmp_path, qas, context), max_query_length=3)
    tok = task.make_tokenizer(vocab, True)
    examples = task.read("train")
    f = task.featurize(examples, tok, 32, training=True)
    for row, answer in enumerate(["paris", "una"]):
        pieces = tok.convert_ids_to_tokens(f["input_ids"][row])
        assert pieces[f["start_positions"][row]] == answer
    assert tok.convert_ids_to_tokens([f["input_ids"][1][f["end_positions"][1]]]) == ["##ble"]
    # Post-processing returns the context's own characters (case and all).
    n, length = f["input_ids"].shape
    start = np.full((n, length), -9.0)
    end = np.full((n, length), -9.0)
    start[np.arange(n), f["start_positions"]] = 5
    end[np.arange(n), f["end_positions"]] = 5
    out = task.postprocess(examples, f, {"start_logits": start, "end_logits": end})
    assert out["predictions"] == {"q1": "Paris", "q2": "Unaffable"}
    assert len(out["nbest"]["q1"]) <= 20 and out["nbest"]["q1"][0]["probability"] > 0.5
    # With the progress bar on (as fine-tuning runs it) the features are the same; the bar
    # goes to stderr.
    task.show_progress = True
    shown = task.featurize(examples, tok, 32, training=True)
    assert shown.keys() == f.keys() and all(np.array_equal(shown[k], f[k]) for k in f)
    assert "squad_v1: featurize" in capsys.readouterr().err


def test_squad_windows_put_outside_answers_on_cls(tmp_path, vocab):
    qas = [{"id": "q", "question": "who", "answers": [{"text": "Paris", "answer_start": 20}]}]
    task = tasks.get_task("squad_v1", _squad_file(tmp_path, qas), doc_stride=2)
    f = task.featurize(task.read("train"), task.make_tokenizer(vocab, True), 8, training=True)
    # 9 context pieces in windows of 8 - 1 - 3 = 4: starts 0, 2, 4, 6; "paris" (piece 4) is in two.
    assert f["start_positions"].tolist() == [0, 3 + 2, 3 + 0, 0]  # [CLS] who [SEP] precede the window
    inside = f["start_positions"] > 0
    assert inside.any() and (~inside).any()
    assert (f["end_positions"][~inside] == 0).all()
    # Each doc piece is max-context in exactly one window.
    chars = f["token_start_char"][f["token_is_max_context"]]
    assert len(chars) == len(set(chars.tolist()))


def test_squad_bad_answers_raise_or_count(tmp_path, vocab):
    qas = [{"id": "good", "question": "who", "answers": [{"text": "Paris", "answer_start": 20}]},
           {"id": "off", "question": "who", "answers": [{"text": "Paris", "answer_start": 3}]}]
    task = tasks.get_task("squad_v1", _squad_file(tmp_path, qas))
    tok = task.make_tokenizer(vocab, True)
    with pytest.raises(tasks.DataError, match=r"train-v1.1.json: data\[0\].paragraphs\[0\].qas\[1\] \(id off\).*"
                                              r"not at answer_start=3"):
        task.featurize(task.read("train"), tok, 32, training=True)
    lenient = tasks.get_task("squad_v1", _squad_file(tmp_path, qas), skip_bad_rows=True)
    f = lenient.featurize(lenient.read("train"), tok, 32, training=True)
    assert len(f["input_ids"]) == 1 and sum(lenient.skipped.values()) == 1


def test_squad_v2_null_threshold(tmp_path, vocab):
    qas = [{"id": "q", "question": "who", "answers": [], "is_impossible": True}]
    task = tasks.get_task("squad_v2", _squad_file(tmp_path, qas).replace("", ""),
                          split_files={"train": str(tmp_path / "train-v1.1.json")})
    tok = task.make_tokenizer(vocab, True)
    examples = task.read("train")
    f = task.featurize(examples, tok, 32, training=True)
    assert f["start_positions"].tolist() == [0] and f["end_positions"].tolist() == [0]
    start = np.zeros(f["input_ids"].shape)
    end = np.zeros(f["input_ids"].shape)
    start[0, 0] = end[0, 0] = 2.0  # null score 4
    span = int(np.nonzero(f["token_start_char"][0] >= 0)[0][0])
    start[0, span] = end[0, span] = 1.5  # best span 3: null_odds = 4 - 3 = 1
    out = task.postprocess(examples, f, {"start_logits": start, "end_logits": end})
    assert out["null_odds"]["q"] == pytest.approx(1.0) and out["predictions"]["q"] == ""
    task.null_score_diff_threshold = 1.5
    assert task.postprocess(examples, f, {"start_logits": start, "end_logits": end})["predictions"]["q"] == "John"


def _window_labels(examples, f):
    """[question id, window of that question, start, end] per feature row."""
    seen = {}
    out = []
    for i, s, e in zip(f["example_index"], f["start_positions"], f["end_positions"]):
        qid = examples[i].qas_id
        out.append([qid, seen.get(qid, 0), int(s), int(e)])
        seen[qid] = seen.get(qid, 0) + 1
    return out


def _random_logits(f, seed, bump):
    """The reference runs' logits: RandomState(seed) normals, start then end, + `bump` on the context."""
    rng = np.random.RandomState(seed)
    start = rng.standard_normal(f["input_ids"].shape).astype(np.float32)
    end = rng.standard_normal(f["input_ids"].shape).astype(np.float32)
    context = f["token_word_index"] >= 0
    start[context] += np.float32(bump)
    end[context] += np.float32(bump)
    return {"start_logits": start, "end_logits": end}


def _sha256(value):
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def test_squad_labels_and_answer_texts_match_google_on_hard_cases(tmp_path):
    """Training labels and predicted answer texts equal google-research/bert run_squad.py's on
    answers inside words and word pieces, accents (composed and combining), [UNK] words, CJK,
    newlines/double spaces/U+00A0/U+202F/U+200B in the context, a leading-space answer, and
    windows (fixture written by run_squad.py itself; tests/fixtures/README.md). The answer
    "20\u00a0kg" is one run_squad.py drops from training; here it is a counted bad row."""
    with open(os.path.join(FIXTURES, "squad_google_hard_cases.json"), encoding="utf-8") as fh:
        fx = json.load(fh)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(fx["vocab"]) + "\n", encoding="utf-8")
    settings = fx["settings"]
    for case in fx["cases"]:
        name = "squad_v2" if case["version_2"] else "squad_v1"
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(fx[name]), encoding="utf-8")
        task = tasks.get_task(name, split_files={"train": str(path), "dev": str(path)},
                              doc_stride=settings["doc_stride"], max_query_length=settings["max_query_length"],
                              n_best_size=settings["n_best_size"], max_answer_length=settings["max_answer_length"],
                              skip_bad_rows=True)
        tok = task.make_tokenizer(str(vocab), case["do_lower_case"])
        examples = task.read("train")
        f = task.featurize(examples, tok, settings["max_seq_length"], training=True)
        assert _window_labels(examples, f) == case["labels"], (name, case["do_lower_case"])
        dropped = [e.qas_id for e in examples if e.answers and "\u00a0" in e.answers[0]["text"]]
        assert sum(task.skipped.values()) == len(dropped) == 1
        assert dropped[0] not in {q for q, *_ in case["labels"]}
        examples = task.read("dev")
        f = task.featurize(examples, tok, settings["max_seq_length"], training=False)
        assert len(f["input_ids"]) == case["n_eval_windows"]
        for run in case["runs"]:
            out = task.postprocess(examples, f, _random_logits(f, run["seed"], 1.5 if case["version_2"] else 0.0))
            assert out["predictions"] == run["predictions"], (name, case["do_lower_case"], run["seed"])
            if case["version_2"]:
                assert out["null_odds"] == pytest.approx(run["null_odds"], abs=1e-9)


def test_squad_answer_text_falls_back_to_the_whole_words_like_google():
    basic = tokenization.BasicTokenizer(do_lower_case=True)
    # Aligned: the span's own characters, case and accents kept; whitespace runs become one space
    # (Google joins the whitespace words with single spaces).
    assert squad.answer_text(["smith"], ["Smith's"], basic) == "Smith"
    assert squad.answer_text(["##ffa", "##ble"], ["unaffable"], basic) == "ffable"
    assert squad.answer_text(["sao", "paulo"], ["S\u00e3o", "Paulo,"], basic) == "S\u00e3o Paulo"
    # The first match in the words, not necessarily the predicted one.
    assert squad.answer_text(["1895"], ["1895-1895"], basic) == "1895"
    # No alignment: an [UNK] piece, a dropped zero-width space, a U+00A0 inside a word -> all words.
    assert squad.answer_text(["[UNK]"], ["qu\u00e6stor,"], basic) == "qu\u00e6stor,"
    assert squad.answer_text(["width"], ["zero\u200bwidth"], basic) == "zero\u200bwidth"
    assert squad.answer_text(["kg"], ["20\u00a0kg"], basic) == "20\u00a0kg"
    assert squad.whitespace_words("a  bc\nd\u202fe\u00a0f") == (["a", "bc", "d", "e\u00a0f"],
                                                                [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3])


SQUAD_DATA = os.path.join(os.environ.get("BERT_JAX_SHARED_DATA", os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "shared", "data")), "squad")


@pytest.mark.parametrize("config", ["v1_uncased", "v1_cased", "v2_uncased"])
def test_squad_dev_sets_label_and_answer_like_google(config):
    """Every window's training label and every prediction on the real dev sets equal run_squad.py's
    (hashes of its outputs; the windows and answers that a character-offset mapping got wrong are
    kept in full). Skips without the data (CI)."""
    with open(os.path.join(FIXTURES, "squad_google_dev.json"), encoding="utf-8") as fh:
        fx = json.load(fh)
    ref = next(c for c in fx["configs"] if c["name"] == config)
    path = os.path.join(SQUAD_DATA, ref["file"])
    vocab = os.path.join(os.path.dirname(SQUAD_DATA), "vocab", ref["vocab"], "vocab.txt")
    if not (os.path.exists(path) and os.path.exists(vocab)):
        pytest.skip(f"needs {path} and {vocab}")
    settings = fx["settings"]
    name = "squad_v2" if ref["version_2"] else "squad_v1"
    task = tasks.get_task(name, split_files={"train": path, "dev": path}, doc_stride=settings["doc_stride"],
                          max_query_length=settings["max_query_length"], n_best_size=settings["n_best_size"],
                          max_answer_length=settings["max_answer_length"])
    tok = task.make_tokenizer(vocab, ref["do_lower_case"])
    examples = task.read("train")
    labels = _window_labels(examples, task.featurize(examples, tok, settings["max_seq_length"], training=True))
    hard = {(q, w): [q, w, s, e] for q, w, s, e in ref["hard_labels"]}
    assert [l for l in labels if (l[0], l[1]) in hard] == ref["hard_labels"]
    assert len(labels) == ref["windows"] and _sha256(labels) == ref["labels_sha256"]
    f = task.featurize(examples, tok, settings["max_seq_length"], training=False)
    out = task.postprocess(examples, f, _random_logits(f, 0, 1.5 if ref["version_2"] else 0.0))
    preds = out["predictions"]
    assert {q: preds[q] for q in ref["hard_predictions"]} == ref["hard_predictions"]
    assert len(preds) == ref["predictions"] and _sha256(sorted(preds.items())) == ref["predictions_sha256"]
    if ref["version_2"]:
        assert _sha256(sorted((q, round(x, 6)) for q, x in out["null_odds"].items())) == ref["null_odds_sha256"]


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


def test_squad_scorers_match_the_official_scripts_on_perturbed_predictions():
    """evaluate_v1/evaluate_v2 against evaluate-v1.1.py / evaluate-v2.0.py's own output on 40 real
    dev questions with perturbed answers (case, articles, punctuation, cut, padded, wrong, empty)."""
    fx = _official()
    v1 = fx["squad_v1.1"]
    assert squad_eval.evaluate_v1(squad_eval.gold_from_json(v1["data"]["data"]), v1["predictions"]) == pytest.approx(
        v1["official"], abs=1e-9)
    v2 = fx["squad_v2.0"]
    gold = squad_eval.gold_from_json(v2["data"]["data"])
    assert squad_eval.evaluate_v2(gold, v2["predictions"]) == pytest.approx(v2["official"], abs=1e-9)
    assert squad_eval.evaluate_v2(gold, v2["predictions"], v2["na_probs"]) == pytest.approx(
        v2["official_with_na_probs"], abs=1e-9)
    assert squad_eval.evaluate_v2(gold, v2["predictions"], v2["na_probs"], 0.5) == pytest.approx(
        v2["official_with_na_probs_thresh_0.5"], abs=1e-9)


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
