"""data_pipeline.tasks' SQuAD without a model: the official scorer's normalization, F1 and CLI by hand and
against evaluate-v1.1.py / evaluate-v2.0.py's own output, document windows, featurization through the
offsets, and the labels and answers of Google's run_squad.py (hand-made hard cases, and the real dev
sets where ../shared/data has them). Split from test_tasks.py."""

import hashlib
import json
import os

import numpy as np
import pytest

from data_pipeline import tasks, tokenization
from data_pipeline.tasks import squad, squad_eval, squad_windows

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")


def _official():
    with open(os.path.join(FIXTURES, "official_scorers.json"), encoding="utf-8") as fh:
        return json.load(fh)


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
    assert squad_windows.doc_windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert squad_windows.doc_windows(3, 4, 3) == [(0, 3)]
    windows = squad_windows.doc_windows(10, 4, 3)
    # Token 3 is in windows (0..3) and (3..6): min(3, 0) vs min(0, 3) tie -> 0.01*4 each -> first wins.
    assert squad_windows.is_max_context(windows, 0, 3) and not squad_windows.is_max_context(windows, 3, 3)
    # Token 4: (3..6) gives min(1, 2) = 1 > window 0's none: window 3.
    assert squad_windows.is_max_context(windows, 3, 4)


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


# FIXTURES is <repo>/tests/fixtures; the shared data sit beside the repository.
SQUAD_DATA = os.path.join(os.environ.get("BERT_JAX_SHARED_DATA", os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(FIXTURES))), "shared", "data")), "squad")


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
