"""The official SQuAD scorers: evaluate-v1.1.py and evaluate-v2.0.py, as functions and as their CLI.

Answer normalization (lower case, drop punctuation and the articles a/an/the, collapse whitespace),
exact match and token F1, max over the gold answers, in percentages; v2 adds HasAns/NoAns splits and,
given per-question no-answer scores (`null_odds` from `squad.SquadV1.postprocess`), the best
thresholds. A prediction file that misses questions is an error unless `allow_partial`
(`check_complete`).

    python -m data_pipeline.tasks.squad dev-v1.1.json predictions.json
    python -m data_pipeline.tasks.squad dev-v2.0.json predictions.json --version_2 [--na_prob_file null_odds.json]

(`data_pipeline.tasks.squad` re-exports everything here; `python -m data_pipeline.tasks.squad_eval`
is the same CLI.) Nothing here imports jax or bert_jax.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import string
import sys
from typing import Optional, Sequence

from data_pipeline.tasks import read_json

# ---------------------------------------------------------------------------------------------
# Official scoring (evaluate-v1.1.py and evaluate-v2.0.py semantics)
# ---------------------------------------------------------------------------------------------


_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, remove punctuation, remove articles, collapse whitespace (in the official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score_v1(prediction: str, ground_truth: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    num_same = sum((collections.Counter(pred_tokens) & collections.Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_tokens), num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score_v2(gold: str, prediction: str) -> float:
    """v2's token F1: two empty answers agree (1), one empty answer scores 0."""
    gold_tokens = normalize_answer(gold).split() if gold else []
    pred_tokens = normalize_answer(prediction).split() if prediction else []
    if not gold_tokens or not pred_tokens:
        return float(gold_tokens == pred_tokens)
    num_same = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_tokens), num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def check_complete(gold: Sequence[tuple[str, list]], predictions: dict, allow_partial: bool,
                   version: str) -> list[str]:
    """The question ids without a prediction; an error naming them unless `allow_partial`.

    The official scripts differ on a partial file: evaluate-v1.1.py prints "Unanswered question
    <id> will receive score 0." and keeps the question in the total (each one scores 0);
    evaluate-v2.0.py prints "Missing prediction for <id>", leaves it out of exact/f1/total, then
    fails (KeyError) building HasAns/NoAns, whose question lists still hold it. A partial file is
    more often a mistake (a truncated run, the wrong split) than a choice, so it is an error here;
    `allow_partial=True` (CLI `--allow_partial`) scores it as described at `evaluate_v1` /
    `evaluate_v2` and says so on stderr.
    """
    missing = [qid for qid, _ in gold if qid not in predictions]
    if missing and not allow_partial:
        raise ValueError(f"{len(missing)} of {len(gold)} questions have no prediction (e.g. "
                         f"{', '.join(missing[:5])}); pass allow_partial=True (CLI --allow_partial) to score "
                         f"the file anyway, as the official evaluate-{version}.py would")
    if missing:
        print(f"scoring a partial prediction file: {len(missing)} of {len(gold)} questions have no "
              f"prediction (e.g. {', '.join(missing[:5])})", file=sys.stderr)
    return missing


def evaluate_v1(gold: Sequence[tuple[str, list]], predictions: dict, allow_partial: bool = False) -> dict:
    """evaluate-v1.1.py: `gold` (question id, gold answer texts) in file order.

    A question without a prediction is an error (`check_complete`); with `allow_partial=True` it
    scores 0 and stays in the total, as in the official script.
    """
    check_complete(gold, predictions, allow_partial, "v1.1")
    em = f1 = 0.0
    for qid, answers in gold:
        if qid not in predictions:
            print(f"Unanswered question {qid} will receive score 0.", file=sys.stderr)
            continue
        pred = predictions[qid]
        em += max(exact_match_score(pred, a) for a in answers)
        f1 += max(f1_score_v1(pred, a) for a in answers)
    total = max(len(gold), 1)
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1 / total}


def _best_threshold(predictions, scores, na_probs, has_answer) -> tuple[float, float]:
    num_no_answer = sum(1 for q in has_answer if not has_answer[q])
    current = best = num_no_answer
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            diff = scores[qid]
        else:
            diff = -1 if predictions[qid] else 0
        current += diff
        if current > best:
            best, best_thresh = current, na_probs[qid]
    return 100.0 * best / len(scores), float(best_thresh)


def evaluate_v2(gold: Sequence[tuple[str, list]], predictions: dict, na_probs: Optional[dict] = None,
                na_prob_thresh: float = 1.0, allow_partial: bool = False) -> dict:
    """evaluate-v2.0.py: `gold` (question id, gold texts, [] = unanswerable); `na_probs` per question.

    Returns exact, f1, total, HasAns_*/NoAns_* (when such questions exist) and, when `na_probs` is
    given, best_exact(_thresh) and best_f1(_thresh).

    A question without a prediction is an error (`check_complete`); with `allow_partial=True` only
    the predicted questions are scored: they alone make exact/f1/total, as in the official script,
    and HasAns/NoAns (where the official script fails) and the best thresholds.
    """
    check_complete(gold, predictions, allow_partial, "v2.0")
    # The official has-answer test is `bool(qa["answers"])`; gold texts that normalize to nothing
    # are dropped from the comparison (then [""] stands in).
    has_answer = {qid: bool(answers) for qid, answers in gold}
    exact_raw, f1_raw = {}, {}
    for qid, answers in gold:
        texts = [a for a in answers if normalize_answer(a)] or [""]
        if qid not in predictions:
            print(f"Missing prediction for {qid}", file=sys.stderr)
            continue
        pred = predictions[qid]
        exact_raw[qid] = max(float(normalize_answer(a) == normalize_answer(pred)) for a in texts)
        f1_raw[qid] = max(f1_score_v2(a, pred) for a in texts)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in predictions}

    def thresholded(scores):
        return {q: (float(not has_answer[q]) if probs[q] > na_prob_thresh else s) for q, s in scores.items()}

    exact, f1 = thresholded(exact_raw), thresholded(f1_raw)

    def block(qids):
        qids = [q for q in qids if q in exact]
        n = len(qids)
        return {"exact": 100.0 * sum(exact[q] for q in qids) / max(n, 1),
                "f1": 100.0 * sum(f1[q] for q in qids) / max(n, 1), "total": n}

    out = block(list(exact))
    has = [q for q, h in has_answer.items() if h and q in exact]
    no = [q for q, h in has_answer.items() if not h and q in exact]
    if has:
        out.update({f"HasAns_{k}": v for k, v in block(has).items()})
    if no:
        out.update({f"NoAns_{k}": v for k, v in block(no).items()})
    if na_probs is not None and exact_raw:
        out["best_exact"], out["best_exact_thresh"] = _best_threshold(predictions, exact_raw, probs, has_answer)
        out["best_f1"], out["best_f1_thresh"] = _best_threshold(predictions, f1_raw, probs, has_answer)
    return out


def gold_from_json(dataset: list) -> list[tuple[str, list]]:
    """(question id, gold answer texts) of SQuAD JSON's `data` list, in file order."""
    return [(qa["id"], [a["text"] for a in qa.get("answers", [])])
            for article in dataset for paragraph in article["paragraphs"] for qa in paragraph["qas"]]
# ---------------------------------------------------------------------------------------------
# CLI: the official scripts' interface
# ---------------------------------------------------------------------------------------------


def _check_mapping(value, path: str, kind, what: str) -> None:
    """`value` must be {question id: kind}, as the official scripts expect."""
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object {{question id: {what}}}, got a {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ValueError(f"{path}: question {key!r}: the {what} is a {type(item).__name__}, not a "
                             f"{'string' if kind is str else 'number'}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Official SQuAD v1.1 / v2.0 evaluation.")
    parser.add_argument("data_file", help="dev-v1.1.json / dev-v2.0.json")
    parser.add_argument("pred_file", help="predictions.json: question id -> answer text")
    parser.add_argument("--version_2", action="store_true", help="score as evaluate-v2.0.py")
    parser.add_argument("--na_prob_file", "--na-prob-file", default=None,
                        help="v2: null_odds.json (question id -> no-answer score)")
    parser.add_argument("--na_prob_thresh", "--na-prob-thresh", type=float, default=1.0,
                        help="v2: predict no-answer when the na score exceeds this")
    parser.add_argument("--allow_partial", "--allow-partial", action="store_true",
                        help="score a prediction file that misses some questions (v1.1: they score 0; "
                             "v2.0: only the predicted ones are scored); an error otherwise")
    args = parser.parse_args(argv)
    try:
        dataset = read_json(args.data_file)
        if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
            raise ValueError(f"{args.data_file}: not a SQuAD dataset (no top-level \"data\" list)")
        predictions = read_json(args.pred_file)
        _check_mapping(predictions, args.pred_file, str, "answer text")
        gold = gold_from_json(dataset["data"])
        na_probs = None
        if args.version_2 and args.na_prob_file:
            na_probs = read_json(args.na_prob_file)
            _check_mapping(na_probs, args.na_prob_file, (int, float), "no-answer score")
    except (OSError, ValueError) as e:  # bad input: one line naming the file, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.version_2:
            result = json.dumps(evaluate_v2(gold, predictions, na_probs, args.na_prob_thresh, args.allow_partial),
                                indent=2)
        else:
            if dataset.get("version") != "1.1":
                print(f"Evaluation expects v-1.1, but got dataset with v-{dataset.get('version')}", file=sys.stderr)
            result = json.dumps(evaluate_v1(gold, predictions, args.allow_partial))
    except ValueError as e:  # a partial prediction file without --allow_partial
        print(f"error: {args.pred_file}: {e}", file=sys.stderr)
        return 2
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
