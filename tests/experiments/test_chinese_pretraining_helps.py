"""experiments/chinese_pretraining_helps.py's data stages on the shared Chinese data (skipped without it).

The study (two pretrainings and 18 fine-tunings) is too slow for CI, and its pretraining and
fine-tuning stages are the English benchmark's (tests/experiments/test_pretraining_helps.py runs them end to end
with --quick) around `configs/own_data.py` (tests/finetune/test_own_data.py). What is new here is checked:
the deterministic splits, the corpus that never holds a ChnSentiCorp dev or test review, the two
masking arms' records, and the report's arithmetic.
"""

import csv
import io
import json
import os
import re
import zipfile

import pytest

from experiments import chinese_pretraining_helps as cph

pytestmark = pytest.mark.skipif(not os.path.isdir(cph.ZH), reason="../shared/data/zh is absent")


def read_csv(path):
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def test_splits_are_seeded_disjoint_and_the_corpus_leaves_out_every_dev_and_test_review(tmp_path):
    info = cph.stage_splits(str(tmp_path / "a"), 200, 50)
    again = cph.stage_splits(str(tmp_path / "b"), 200, 50)
    assert info == again
    for name in ("chnsenticorp_train.csv", "chnsenticorp_dev.csv", "chnsenticorp_test.csv", "msra_train.conll"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    splits = {s: read_csv(tmp_path / "a" / f"chnsenticorp_{s}.csv") for s in ("train", "dev", "test")}
    assert {s: len(r) for s, r in splits.items()} == {"train": 6213, "dev": 776, "test": 776}  # 7,765 usable
    with open(os.path.join(cph.ZH, "ChnSentiCorp_htl_all.csv"), encoding="utf-8-sig", newline="") as f:
        source = [(r["label"], r["review"]) for r in csv.DictReader(f) if r["review"].strip()]
    together = sorted((r["label"], r["review"]) for rows in splits.values() for r in rows)
    assert together == sorted(source)  # a partition of the usable rows
    msra = (tmp_path / "a" / "msra_dev.conll").read_text(encoding="utf-8").split("\n\n")
    assert len(msra) == 50 and all("\t" in line for s in msra for line in s.strip().splitlines())

    corpus = cph.stage_corpus(str(tmp_path / "corpus"), str(tmp_path / "a"), 0)
    held = [r["review"] for s in ("dev", "test") for r in splits[s]]
    whole = {"".join(r.split()) for r in held}
    with zipfile.ZipFile(os.path.join(cph.ZH, "online_shopping_10_cats.zip")) as z:
        text = z.read("online_shopping_10_cats.csv").decode("utf-8-sig")
    reviews = [r["review"] for r in csv.DictReader(io.StringIO(text, newline=""))]
    with open(os.path.join(cph.ZH, "waimai_10k.csv"), encoding="utf-8-sig", newline="") as f:
        reviews += [r["review"] for r in csv.DictReader(f)]
    normalized = ["".join(r.lstrip("\ufeff").split()) for r in reviews]
    identical = sum(1 for r in normalized if r and r in whole)
    assert corpus["removed_as_chnsenticorp_dev_or_test"] == identical > 0  # the hotel reviews overlap
    assert corpus["removed_sharing_a_sentence"] > 0  # and hold near copies
    assert corpus["reviews_used"] == (len(reviews) - identical - corpus["removed_sharing_a_sentence"]
                                      - sum(1 for r in normalized if not r))
    # No held-out sentence of 8+ characters is a line of the written text (Google's format: a
    # sentence a line), whole reviews included.
    written = "".join((tmp_path / "corpus" / name).read_text(encoding="utf-8")
                      for name in os.listdir(tmp_path / "corpus") if name.endswith(".txt"))
    lines = {"".join(line.split()) for line in written.split("\n")}
    held_sentences = {"".join(s.split()) for r in held for s in re.split(r"(?<=[。！？!?；;])", r)}
    held_sentences = {s for s in held_sentences if len(s) >= 8}
    assert len(held_sentences) > 1000 and not held_sentences & lines


def test_the_two_masking_arms_differ_only_in_the_chinese_flag(tmp_path):
    pytest.importorskip("jieba")
    args = cph.parse_args(["--workdir", str(tmp_path), "--quick"])
    cph.stage_splits(str(tmp_path / "tasks"), 8, 8)
    cph.stage_corpus(str(tmp_path / "corpus"), str(tmp_path / "tasks"), 120)
    infos = {arm: cph.stage_records(args, str(tmp_path / "corpus"), str(tmp_path / arm), arm) for arm in cph.PRETRAINED}
    assert infos["wwm"]["flags"] == ["--do_whole_word_mask=true", "--chinese_whole_word_mask=true"]
    assert infos["char"]["flags"] == ["--do_whole_word_mask=true"]
    flags = {arm: json.load(open(tmp_path / arm / "train" / "train.dataset_info.json"))["flags"]
             for arm in cph.PRETRAINED}
    assert flags["wwm"]["chinese_whole_word_mask"] is True and not flags["char"].get("chinese_whole_word_mask")
    assert {k: v for k, v in flags["wwm"].items() if "chinese" not in k and "file" not in k} == \
        {k: v for k, v in flags["char"].items() if "chinese" not in k and "file" not in k}
    records = {arm: sorted((tmp_path / arm / "train").glob("*.tfrecord*")) for arm in cph.PRETRAINED}
    assert records["wwm"] and [p.name for p in records["wwm"]] == [p.name for p in records["char"]]
    assert b"".join(p.read_bytes() for p in records["wwm"]) != b"".join(p.read_bytes() for p in records["char"])


def test_the_report_takes_test_scores_at_the_best_dev_epoch(tmp_path):
    history = [{"epoch": 1, "accuracy": 0.8, "test_accuracy": 0.7}, {"epoch": 2, "accuracy": 0.9, "test_accuracy": 0.6},
               {"epoch": 3, "accuracy": 0.9, "test_accuracy": 0.95}]
    (tmp_path / "eval_history.json").write_text(json.dumps(history))
    assert cph.test_at_best_dev(str(tmp_path), "accuracy") == {"epoch": 2, "dev": 0.9, "test": 0.6}
    runs = {task: {arm: {str(s): {"at_best_dev": {"test": base + 0.01 * s, "dev": 0.0}}
                         for s in range(3)} for arm, base in (("wwm", 0.9), ("char", 0.88), ("random", 0.8))}
            for task in cph.TASKS}
    summary = cph.summarize(runs)
    row = summary["chnsenticorp"]
    assert row["wwm"]["mean"] == pytest.approx(0.91) and row["wwm"]["std"] == pytest.approx(0.01)
    assert row["wwm_minus_random_points"] == pytest.approx(10.0)
    assert row["wwm_minus_char_points"] == pytest.approx(2.0)
    assert "| chnsenticorp (accuracy) | 91.0 ± 1.0 | 89.0 ± 1.0 | 81.0 ± 1.0 | +10.0 | +8.0 | +2.0 |" in \
        cph.markdown(summary)
