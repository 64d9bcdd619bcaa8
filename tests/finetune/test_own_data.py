"""Fine-tuning on your own files: classification, regression and tagging from CSV, TSV, JSON Lines
and CoNLL columns (data_pipeline/tasks/classification.py, tagging.py, files.py).

Reading and scoring are checked without a model (against scikit-learn and seqeval where they
compute the same thing); two tiny end-to-end runs (regression's head runs end to end in
tests/finetune/test_finetune.py's STS-B) go from files alone to scores, predictions
beside the inputs' ids, and `mode=predict` with the labels recorded at fine-tuning.
"""

import csv
import json
import os
import zipfile

import flax.linen as nn
import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.finetune import loop as finetune, predict
from bert_jax.model import model_config, modeling, pretraining_heads
from configs import own_data
from data_pipeline import tasks, tokenization
from data_pipeline.tasks import DataError, glue, ner

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..", "shared", "data")
ZH = os.path.join(SHARED, "zh")

# ---------------------------------------------------------------------------------------------
# Tables, splits, labels
# ---------------------------------------------------------------------------------------------

ROWS = [("a1", "good film, \"really\"", "pos"), ("a2", "bad\nplot", "neg"), ("a3", "fine", "pos"),
        ("a4", "awful", "neg"), ("a5", "great", "pos")]


def write_table(path, fmt, rows=ROWS, header=("id", "review", "label")):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(dict(zip(header, r)), ensure_ascii=False) + "\n" for r in rows))
    elif fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([header, *rows])
    else:  # tsv: no quoting, so no newline inside a field
        path.write_text("\t".join(header) + "\n" + "".join("\t".join(r).replace("\n", " ") + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_tables_read_by_column_name_in_each_format(tmp_path, fmt):
    path = write_table(tmp_path / f"train.{fmt}", fmt)
    task = tasks.get_task("classification", split_files={"train": path}, text_column="review", id_column="id")
    examples = task.read("train")
    texts = [t if fmt != "tsv" else t.replace("\n", " ") for _, t, _ in ROWS]
    assert [(e.guid, e.text_a, e.label) for e in examples] == [(i, t, l) for (i, _, l), t in zip(ROWS, texts)]
    assert task.labels == ("neg", "pos") and task.num_outputs == 2
    if fmt == "csv":  # a quoted field holding a newline: the next record starts two lines down
        assert [e.where.rsplit(":", 1)[1] for e in examples] == ["2", "3", "5", "6", "7"]
    # Found by name in data_dir, dev and test included; the test file has no labels.
    write_table(tmp_path / f"dev.{fmt}", fmt, ROWS[:2])
    write_table(tmp_path / f"test.{fmt}", fmt, [r[:2] for r in ROWS[2:]], header=("id", "review"))
    task = tasks.get_task("classification", str(tmp_path), text_column="review", id_column="id")
    assert task.test_splits == ("test",) and len(task.read("dev")) == 2
    assert [e.label for e in task.read("test")] == [None] * 3


def test_labels_are_discovered_in_a_stable_order_or_taken_as_given(tmp_path):
    rows = [(str(i), f"t{i}", str(label)) for i, label in enumerate([10, 2, 2, 1, 10])]
    path = write_table(tmp_path / "train.csv", "csv", rows)
    found = tasks.get_task("classification", split_files={"train": path}, text_column="review")
    assert found.labels == ("1", "2", "10")  # numerically, not "1" < "10" < "2"
    given = tasks.get_task("classification", split_files={"train": path}, text_column="review", labels="10,2,1")
    assert given.labels == ("10", "2", "1")
    features = given.featurize(given.read("train"), Vocab(tmp_path).tokenizer(), 8, training=True)
    assert features["label"].tolist() == [0, 1, 1, 2, 0]
    with pytest.raises(DataError, match=r"label '2' is not among config.task_options.labels"):
        tasks.get_task("classification", split_files={"train": path}, text_column="review", labels="10,1").read("train")
    one = write_table(tmp_path / "one.csv", "csv", rows[:1])
    with pytest.raises(DataError, match=r"one.csv: column 'label' has 1 distinct label"):
        tasks.get_task("classification", split_files={"train": one}, text_column="review").labels


def test_a_seeded_share_of_the_training_file_is_dev(tmp_path):
    rows = [(str(i), f"text {i}", "ab"[i % 2]) for i in range(40)]
    path = write_table(tmp_path / "all.csv", "csv", rows)

    def split(seed, fraction=0.25):
        task = tasks.get_task("classification", split_files={"train": path}, text_column="review",
                              id_column="id", dev_fraction=fraction, split_seed=seed)
        return [e.guid for e in task.read("train")], [e.guid for e in task.read("dev")]

    train, dev = split(0)
    assert len(dev) == 10 and len(train) == 30 and not set(train) & set(dev)
    assert sorted(train + dev, key=int) == [r[0] for r in rows]
    assert dev == sorted(dev, key=int)  # the file's order
    assert split(0) == (train, dev) and split(1)[1] != dev
    # An explicit dev file wins over the fraction.
    dev_file = write_table(tmp_path / "dev.csv", "csv", rows[:3])
    task = tasks.get_task("classification", split_files={"train": path, "dev": dev_file}, text_column="review",
                          dev_fraction=0.25)
    assert len(task.read("train")) == 40 and len(task.read("dev")) == 3
    with pytest.raises(FileNotFoundError, match=r"no dev file: set config.split_files.dev .*dev_fraction"):
        tasks.get_task("classification", split_files={"train": path}, text_column="review").read("dev")
    with pytest.raises(ValueError, match=r"dev_fraction=1.5"):
        tasks.get_task("classification", split_files={"train": path}, dev_fraction=1.5)


BAD = {  # file contents (train.csv), the error's location and problem
    "unseen dev label": (None, "dev.csv: row 3: column 'label': label 'meh' is not among the training file's"),
    "empty text": ("id,review,label\n1,good,pos\n2,,neg\n3,bad,neg\n", "train.csv: row 3: column 'review' is empty"),
    "empty label": ("id,review,label\n1,good,pos\n2,ok,\n3,bad,neg\n",
                    "train.csv: row 3: column 'label' \\(the label\\) is empty"),
    "ragged row": ("id,review,label\n1,good,pos\n2,bad,neg,extra\n3,bad,neg\n",
                   "train.csv: row 3: 4 fields, the header has 3"),
    "missing column": ("id,text,label\n1,good,pos\n", "train.csv: no column 'review' .*text_column"),
    "not utf-8": (b"id,review,label\n1,good,pos\n2,caf\xe9,neg\n3,bad,neg\n",
                  "train.csv: line 3, column 6: byte 0xe9 is not valid UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_file_row_and_column(tmp_path, case):
    content, message = BAD[case]
    train = tmp_path / "train.csv"
    if content is None:
        write_table(train, "csv", ROWS)
        write_table(tmp_path / "dev.csv", "csv", [ROWS[0], ("x", "meh film", "meh"), ROWS[1]])
    elif isinstance(content, bytes):
        train.write_bytes(content)
    else:
        train.write_text(content)
    split = "dev" if content is None else "train"

    def read(**kwargs):
        return tasks.get_task("classification", str(tmp_path), text_column="review", **kwargs).read(split)

    with pytest.raises(DataError, match=message):
        read()
    if case in ("missing column", "not utf-8"):
        return  # the file as a whole is unusable: no row to skip
    task = tasks.get_task("classification", str(tmp_path), text_column="review", skip_bad_rows=True)
    kept = task.read(split)
    assert len(kept) == 2 and task.skipped == {str(tmp_path / f"{split}.csv"): 1}  # counted, not dropped silently


def test_regression_reads_numbers_and_names_what_is_not_one(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"a": "x", "b": "y", "score": 1.5}\n{"a": "z", "b": "w", "score": "4"}\n')
    task = tasks.get_task("regression", split_files={"train": str(path)}, text_column="a", text_b_column="b",
                          label_column="score")
    assert [(e.text_a, e.text_b, e.label) for e in task.read("train")] == [("x", "y", 1.5), ("z", "w", 4.0)]
    assert task.head == "regression" and task.num_outputs == 1
    path.write_text('{"a": "x", "b": "y", "score": "high"}\n')
    with pytest.raises(DataError, match=r"train.jsonl: row 1: column 'score': 'high' is not a finite number"):
        tasks.get_task("regression", split_files={"train": str(path)}, text_column="a", text_b_column="b",
                       label_column="score").read("train")


@pytest.mark.parametrize("seed", [0, 1])
def test_macro_f1_matches_sklearn(seed):
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.RandomState(seed)
    gold = list(rng.choice(["a", "b", "c", "d"], 60))
    pred = list(rng.choice(["a", "b", "c"], 60))
    assert glue.macro_f1(gold, pred) == pytest.approx(metrics.f1_score(gold, pred, average="macro"))


# ---------------------------------------------------------------------------------------------
# Tagging
# ---------------------------------------------------------------------------------------------


def test_bioes_entity_scores_match_seqeval_on_well_and_ill_formed_tags():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = np.random.RandomState(0)
    tags = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"]
    for _ in range(100):
        gold = [list(rng.choice(tags, rng.randint(1, 9))) for _ in range(4)]
        pred = [list(rng.choice(tags, len(g))) for g in gold]
        ours = ner.conlleval(gold, pred, scheme="bioes")
        assert ours["precision"] == pytest.approx(seqeval.precision_score(gold, pred))
        assert ours["recall"] == pytest.approx(seqeval.recall_score(gold, pred))
        assert ours["f1"] == pytest.approx(seqeval.f1_score(gold, pred))
    # By hand: two adjacent single-token entities are two (IOB rules would merge S- S- into one),
    # and a two-token entity over them matches neither.
    out = ner.conlleval([["S-PER", "S-PER", "O", "B-LOC", "E-LOC"]], [["B-PER", "E-PER", "O", "B-LOC", "E-LOC"]],
                        "bioes")
    assert (out["entities_gold"], out["entities_predicted"], out["entities_correct"]) == (3, 2, 1)


CONLL = ("-DOCSTART- -X- O\n\nJohn\tNNP\tB-PER\nSmith\tNNP\tE-PER\nlives\tVBZ\tO\nin\tIN\tO\nParis\tNNP\tS-LOC\n\n"
         "中\tB-ORG\n国\tI-ORG\n银\tI-ORG\n行\tE-ORG\n\u3000\tO\n好\tO\n")


def test_tagging_reads_conll_columns_and_json_lines_alike(tmp_path):
    (tmp_path / "train.conll").write_text(CONLL)
    sentences = [(["John", "Smith", "lives", "in", "Paris"], ["B-PER", "E-PER", "O", "O", "S-LOC"]),
                 (["中", "国", "银", "行", "\u3000", "好"], ["B-ORG", "I-ORG", "I-ORG", "E-ORG", "O", "O"])]
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"id": f"s{i}", "words": w, "ner": t}, ensure_ascii=False) + "\n" for i, (w, t) in
        enumerate(sentences)))
    conll = tasks.get_task("tagging", split_files={"train": str(tmp_path / "train.conll")})
    jsonl = tasks.get_task("tagging", split_files={"train": str(tmp_path / "train.jsonl")}, tokens_key="words",
                           tags_key="ner", id_key="id")
    for task in (conll, jsonl):
        assert [(e.words, e.tags) for e in task.read("train")] == sentences
        assert task.labels == ("O", "S-LOC", "B-ORG", "I-ORG", "E-ORG", "B-PER", "E-PER")
        assert task.scheme == "bioes" and task.num_outputs == 7
    assert [e.guid for e in conll.read("train")] == ["3", "9"] and [e.guid for e in jsonl.read("train")] == ["s0", "s1"]
    # Featurized with Google's Chinese-style tokenization: each character a piece, a tag on each;
    # the ideographic space has no piece, so no label (and "O" when predicted).
    vocab = Vocab(tmp_path, ["john", "smith", "lives", "in", "paris", "中", "国", "银", "行", "好"])
    f = conll.featurize(conll.read("train"), vocab.tokenizer(), 12, training=True)
    second = f["label_ids"][1][f["label_weights"][1] > 0]
    assert [conll.labels[i] for i in second] == ["B-ORG", "I-ORG", "I-ORG", "E-ORG", "O"]


@pytest.mark.parametrize("text,scheme,message", [
    ("a\tB-PER\nb\tX-PER\n", "auto", r"train.conll: row 2: tag 'X-PER' is neither O nor B/I/E/S-TYPE"),
    ("a\tB-PER\nb\tS-PER\n", "bio", r"train.conll: row 2: tag 'S-PER' is neither O nor B/I-TYPE \(bio\)"),
    ("a\tB-PER\nb\n", "auto", r"train.conll: row 2: 'b' has no tag column"),
])
def test_tagging_bad_tags_name_the_line(tmp_path, text, scheme, message):
    (tmp_path / "train.conll").write_text(text + "\nc\tO\n")
    with pytest.raises(DataError, match=message):
        tasks.get_task("tagging", str(tmp_path), tag_scheme=scheme).read("train")
    task = tasks.get_task("tagging", str(tmp_path), tag_scheme=scheme, skip_bad_rows=True)
    assert [e.words for e in task.read("train")] == [["c"]] and sum(task.skipped.values()) == 1


def test_tagging_dev_tag_unseen_in_training(tmp_path):
    (tmp_path / "train.conll").write_text("a B-PER\nb O\n")
    (tmp_path / "dev.conll").write_text("a B-PER\n\nb B-LOC\n")
    with pytest.raises(DataError, match=r"dev.conll: row 3: tag 'B-LOC' is not among the training file's tags"):
        tasks.get_task("tagging", str(tmp_path)).read("dev")


def test_bio_tagging_scores_as_conlleval():
    """A BIO task's score is conlleval's (tests/data_pipeline/tasks/test_tasks.py checks that against the Perl script)."""
    task = tasks.get_task("tagging", labels="O,B-PER,I-PER,B-LOC,I-LOC", split_files={"train": "unused"})
    assert task.scheme == "bio"
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["I-LOC", "B-LOC"]]
    pred = [["B-PER", "I-PER", "O", "I-LOC"], ["B-PER", "B-LOC"]]
    examples = [ner.Example([str(i) for i in range(len(g))], g) for g in gold]
    assert task.score(examples, pred) == ner.conlleval(gold, pred)
    assert task.score(examples, pred)["entities_correct"] == 3


def test_your_own_squad_json_chinese_answers_and_a_seeded_share_of_paragraphs(tmp_path):
    """Google's SQuAD featurization on Chinese (no spaces: a context is one whitespace word, the span
    is narrowed to the tokenized answer) labels the answer's characters and gives its text back."""
    contexts = ["北京是中国的首都，位于华北平原。2008年夏季奥运会在北京举行。", "上海位于长江入海口。"]
    qas = [[("北京位于哪里？", "华北平原"), ("哪年奥运会？", "2008年")], [("上海在哪？", "长江入海口")]]
    data = {"data": [{"title": f"t{i}", "paragraphs": [{"context": c, "qas": [
        {"id": f"q{i}{j}", "question": q, "answers": [{"text": a, "answer_start": c.index(a)}]}
        for j, (q, a) in enumerate(qs)]}]} for i, (c, qs) in enumerate(zip(contexts, qas))]}
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    chars = sorted(set("".join(contexts + [q for qs in qas for q, _ in qs])) - set("2008"))
    tokenizer = Vocab(tmp_path, chars + ["2008"]).tokenizer()
    task = tasks.get_task("squad_v1", split_files={"train": str(path), "dev": str(path)})
    examples = task.read("train")
    f = task.featurize(examples, tokenizer, 64, training=True)
    inverse = {i: t for t, i in tokenizer.vocab.items()}
    spans = [[inverse[int(i)] for i in row[s:e + 1]] for row, s, e in
             zip(f["input_ids"], f["start_positions"], f["end_positions"])]
    assert spans == [list("华北平原"), ["2008", "年"], list("长江入海口")]
    logits = {k: np.where(np.arange(64)[None] == f[p][:, None], 10.0, -10.0)
              for k, p in (("start_logits", "start_positions"), ("end_logits", "end_positions"))}
    predictions = task.postprocess(examples, task.featurize(examples, tokenizer, 64, training=False), logits)
    assert predictions["predictions"] == {"q00": "华北平原", "q01": "2008年", "q10": "长江入海口"}
    # One file, a seeded half of its paragraphs as dev: questions stay with their paragraph.
    halves = tasks.get_task("squad_v1", split_files={"train": str(path)}, dev_fraction=0.5, split_seed=3)
    train, dev = ({e.context for e in halves.read(s)} for s in ("train", "dev"))
    assert len(train) == len(dev) == 1 and train | dev == set(contexts)
    assert len(halves.read("train")) + len(halves.read("dev")) == 3


# ---------------------------------------------------------------------------------------------
# The shared Chinese data (skipped without it)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir(ZH), reason="../shared/data/zh is absent")
def test_chnsenticorp_and_msra_read_as_distributed(tmp_path):
    path = os.path.join(ZH, "ChnSentiCorp_htl_all.csv")
    with pytest.raises(DataError, match=r"ChnSentiCorp_htl_all.csv: row \d+: column 'review' is empty"):
        tasks.get_task("classification", split_files={"train": path}, text_column="review").read("train")
    task = tasks.get_task("classification", split_files={"train": path}, text_column="review", dev_fraction=0.1,
                          skip_bad_rows=True)
    train, dev = task.read("train"), task.read("dev")
    assert len(train) + len(dev) == 7765 and len(dev) == round(7765 * 0.1)  # 7,766 rows, 1 empty review
    assert task.labels == ("0", "1")
    assert sum(e.label == "1" for e in train + dev) == 5322 and sum(task.skipped.values()) == 1
    with zipfile.ZipFile(os.path.join(ZH, "dh_msra.zip")) as z:
        text = z.read("dh_msra.txt").decode("utf-8")
    head = text[:text.index("\n\n", 200_000) + 2]  # the first sentences
    (tmp_path / "msra.txt").write_text(head, encoding="utf-8")
    msra = tasks.get_task("tagging", split_files={"train": str(tmp_path / "msra.txt")}, dev_fraction=0.1)
    sentences = msra.read("train") + msra.read("dev")
    assert len(sentences) == head.count("\n\n")
    assert msra.labels == ("O", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-PER", "I-PER") and msra.scheme == "bio"
    vocab = os.path.join(SHARED, "vocab", "bert-base-chinese", "vocab.txt")
    f = msra.featurize(sentences[:50], tokenization.FullTokenizer(vocab, True), 128, training=True)
    labelled = int(f["label_weights"].sum())
    characters = sum(len(e.words) for e in sentences[:50])
    assert characters - labelled <= 2  # each character its own piece (a rare one may be dropped whitespace)


# ---------------------------------------------------------------------------------------------
# End to end: files alone -> fine-tuned -> scores, predictions, mode=predict
# ---------------------------------------------------------------------------------------------

FILLER = list("的房间很服务早餐位置价格干净")
LATIN = "the a was is plot very".split()


class Vocab:
    def __init__(self, root, words=()):
        self.path = root / "vocab.txt"
        self.path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n",
                             encoding="utf-8")

    def tokenizer(self):
        return tokenization.FullTokenizer(str(self.path), True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random encoder (L=1, H=32) in bert_jax's export format, with a Chinese + Latin vocab."""
    root = tmp_path_factory.mktemp("pretrained")
    vocab = Vocab(root, FILLER + list("好差北京上海张王") + LATIN + list(".,"))
    cfg = model_config.BertConfig(vocab_size=48, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32)
    params = nn.meta.unbox(pretraining_heads.BertForPreTraining(cfg).init(
        jax.random.key(0), **modeling.dummy_inputs(cfg))["params"])
    pretrained = convert.Pretrained(cfg, jax.tree_util.tree_map(np.asarray, params), str(vocab.path), True)
    return convert.save_pretrained(pretrained, str(root / "bert_jax"), "bert_jax")


def run_config(kind, checkpoint, **options):
    config = own_data.get_config(kind)
    config.init_checkpoint = checkpoint
    config.max_seq_length = 16
    config.global_batch_size = 16
    config.num_train_epochs = 4
    config.learning_rate = 1e-2
    config.async_checkpointing = False
    config.xla_backend_optimization_level = 0
    for key, value in options.items():
        if key.startswith("split_"):
            config.split_files[key[len("split_"):]] = value
        else:
            config.task_options[key] = value
    return config


def review(rng, good):
    chars = list(rng.choice(FILLER, 6))
    chars.insert(rng.randint(7), "好" if good else "差")
    return "".join(chars)


def test_classification_from_a_chinese_csv_end_to_end(tmp_path, checkpoint, capsys):
    rng = np.random.RandomState(0)
    rows = [(f"r{i:03d}", review(rng, i % 2), "正面" if i % 2 else "负面") for i in range(240)]
    train = write_table(tmp_path / "reviews.csv", "csv", rows)
    test_ids = ["t9", "t1", "t5"]
    test = write_table(tmp_path / "new.csv", "csv", [(i, review(rng, g)) for i, g in zip(test_ids, (1, 0, 1))],
                       header=("id", "review"))
    config = run_config("classification", checkpoint, split_train=train, split_test=test, text_column="review",
                        id_column="id", dev_fraction=0.25)
    work = tmp_path / "work"
    results = finetune.run(config, str(work))
    assert results["accuracy"] >= 0.9 and {"macro_f1", "mcc"} <= results.keys()
    description = json.loads((work / "task.json").read_text())
    assert description["labels"] == ["正面", "负面"] and description["task"] == "classification"
    # Dev predictions carry the rows' own ids, in the file's order, with the gold labels; the
    # accuracy they give (scikit-learn) is the loop's.
    from sklearn import metrics as skm
    dev = list(csv.DictReader(open(work / "classification_dev_predictions.csv", encoding="utf-8")))
    by_id = {i: label for i, _, label in rows}
    assert len(dev) == 60 and [r["label"] for r in dev] == [by_id[r["id"]] for r in dev]
    assert results["accuracy"] == pytest.approx(skm.accuracy_score([r["label"] for r in dev],
                                                                  [r["prediction"] for r in dev]))
    out = list(csv.DictReader(open(work / "classification_test_predictions.csv", encoding="utf-8")))
    assert [r["id"] for r in out] == test_ids and [r["prediction"] for r in out] == ["正面", "负面", "正面"]
    # mode=predict on plain text: the labels recorded at fine-tuning, without the training file.
    os.remove(train)
    text = tmp_path / "lines.txt"
    text.write_text("房间好干净\n价格差\n", encoding="utf-8")
    pconfig = own_data.get_config("classification")
    pconfig.mode, pconfig.predict_input, pconfig.predict_output_dir = "predict", str(text), str(tmp_path / "p")
    summary = predict.run(pconfig, str(work))
    assert summary["examples"] == 2
    rows = list(csv.DictReader(open(tmp_path / "p" / "classification_lines_predictions.csv", encoding="utf-8")))
    assert [(r["id"], r["prediction"]) for r in rows] == [("1", "正面"), ("2", "负面")]
    # Exported for transformers with the discovered label names.
    capsys.readouterr()
    assert convert.main(["--input", str(work), "--output", str(tmp_path / "hf"), "--output_format", "hf"]) == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    assert hf_config["id2label"] == {"0": "正面", "1": "负面"}
    assert hf_config["architectures"] == ["BertForSequenceClassification"]


def test_bioes_tagging_from_json_lines_end_to_end(tmp_path, checkpoint):
    rng = np.random.RandomState(2)
    names = {"北京": "LOC", "上海": "LOC", "张": "PER", "王": "PER"}

    def sentence(i):
        tokens, tags = [], []
        for _ in range(rng.randint(3, 7)):
            if rng.rand() < 0.4:
                name = list(names)[rng.randint(4)]
                chars = list(name)
                tokens += chars
                tags += ([f"S-{names[name]}"] if len(chars) == 1 else
                         [f"B-{names[name]}"] + [f"I-{names[name]}"] * (len(chars) - 2) + [f"E-{names[name]}"])
            else:
                tokens.append(str(rng.choice(FILLER)))
                tags.append("O")
        return {"id": f"s{i}", "tokens": tokens, "tags": tags}

    for split, n in (("train", 240), ("dev", 16)):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps(sentence(i), ensure_ascii=False) + "\n" for i in range(n)), encoding="utf-8")
    config = run_config("tagging", checkpoint, id_key="id", text_tokens="characters")
    config.data_dir = str(tmp_path)
    results = finetune.run(config, str(tmp_path / "work"))
    assert results["f1"] >= 0.8
    lines = (tmp_path / "work" / "tagging_dev_predictions.jsonl").read_text(encoding="utf-8").splitlines()
    written = [json.loads(line) for line in lines]
    gold = [json.loads(line) for line in (tmp_path / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [w["id"] for w in written] == [g["id"] for g in gold]
    seqeval = pytest.importorskip("seqeval.metrics")
    assert results["f1"] == pytest.approx(seqeval.f1_score([g["tags"] for g in gold], [w["tags"] for w in written]))
    # mode=predict, one sentence a line, each character a token (config.task_options.text_tokens).
    text = tmp_path / "new.txt"
    text.write_text("张在北京\n", encoding="utf-8")
    pconfig = own_data.get_config("tagging")
    pconfig.mode, pconfig.predict_input, pconfig.predict_output_dir = "predict", str(text), str(tmp_path / "p")
    predict.run(pconfig, str(tmp_path / "work"))
    out = json.loads((tmp_path / "p" / "tagging_new_predictions.jsonl").read_text(encoding="utf-8"))
    assert out["tokens"] == ["张", "在", "北", "京"] and out["tags"][2:] == ["B-LOC", "E-LOC"]
