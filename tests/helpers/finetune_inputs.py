"""What the fine-tuning tests feed the loop, and read back: the tiny vocabulary's words and entities,
task files (SST-2's, every GLUE task's in its distributed format), the tiny run's config and the
predict mode's, and readers of a run's JSON and TSV files."""

import csv
import json
import os

import numpy as np

from configs import glue as glue_config

WORDS = ("good bad movie film the a was is plot actor great awful very really man woman dog cat sat ran "
         "on mat park in paris john smith acme corp went to city he she it what where who did yes no "
         "then walks away sits down opens door eats food").split()
ENTITIES = {"paris": "LOC", "john": "PER", "smith": "PER", "acme": "ORG", "corp": "ORG"}


def tiny(config, task, data_dir, init, **overrides):
    config.task = task
    config.data_dir = str(data_dir)
    config.init_checkpoint = init
    config.max_seq_length = 16
    config.global_batch_size = 8
    config.num_train_epochs = 1
    config.learning_rate = 1e-3
    config.log_every_steps = 1
    config.async_checkpointing = False
    config.xla_backend_optimization_level = 0  # ~3x faster compiles; these models are tiny
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sentiment(rng, n):
    """'good' -> 1, 'bad' -> 0, among filler words: learnable from one token."""
    rows = []
    for i in range(n):
        words = list(rng.choice(WORDS[2:10], 5))
        words.insert(rng.randint(6), "good" if i % 2 else "bad")
        rows.append((" ".join(words), i % 2))
    return rows


def sst2_files(root):
    rng = np.random.RandomState(0)
    folder = root / "glue" / "SST-2"
    folder.mkdir(parents=True)
    for split, n in (("train", 64), ("dev", 16)):
        (folder / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{s} \t{l}\n" for s, l in sentiment(rng, n)))
    # Test ids out of row order: a submission numbered by row, or off by one, maps rows to other examples.
    (folder / "test.tsv").write_text("index\tsentence\n" + "".join(
        f"{i}\t{s}\n" for i, (s, _) in zip(SST2_TEST_IDS, sentiment(rng, 5))))
    return root / "glue"


SST2_TEST_IDS = ("3", "0", "4", "1", "2")


def predict_config(work, path, **overrides):
    config = glue_config.get_config()
    config.mode = "predict"
    config.predict_input = str(path)
    config.predict_output_dir = str(work / "predict_out")
    config.global_batch_size = 8
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def tsv_rows(path):
    return list(csv.DictReader(open(path, encoding="utf-8"), delimiter="\t"))


TEST_IDS = ("2", "0", "1")  # GLUE test rows' ids, out of row order: a submission numbered by row shows


def glue_files(folder, task, rng, n_train=8, n_dev=8):
    """Tiny GLUE folders in the distributed formats (random words; labels valid).

    Returns what it wrote, the tests' gold: split -> [(id, text_a, text_b, label)], the id being
    the row's index/id column or else its row number, the label None in test splits. STS-B's
    first sentence ends in "good" (score 4-5) or "bad" (0-1): learnable, so that a few epochs
    spread its predictions far beyond float32 rounding.
    """

    def text():
        return " ".join(rng.choice(WORDS, rng.randint(2, 7)))

    os.makedirs(folder, exist_ok=True)
    written = {}

    def w(name, header, split, records, line):
        written[split] = records
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(header + "".join(line(*r) for r in records))

    labelled = (("train", n_train), ("dev", n_dev))
    if task == "cola":  # no header in train/dev
        for split, n in labelled:
            w(f"{split}.tsv", "", split, [(str(i), text(), None, str(i % 2)) for i in range(n)],
              lambda i, a, b, l: f"gj04\t{l}\t{'' if l == '1' else '*'}\t{a}\n")
        w("test.tsv", "index\tsentence\n", "test", [(i, text(), None, None) for i in TEST_IDS],
          lambda i, a, b, l: f"{i}\t{a}\n")
    elif task == "mrpc":
        for split, n in labelled:
            w(f"{split}.tsv", "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n", split,
              [(str(i), text(), text(), str(i % 2)) for i in range(n)],
              lambda i, a, b, l: f"{l}\t{i}\t{int(i) + 100}\t{a}\t{b}\n")
        w("test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n", "test",
          [(i, text(), text(), None) for i in TEST_IDS], lambda i, a, b, l: f"{i}\t1\t2\t{a}\t{b}\n")
    elif task == "stsb":
        head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
        row = lambda i, a, b: f"{i}\tg\tf\t2012\t{i}\tnone\tnone\t{a}\t{b}"
        for split, n in labelled:
            w(f"{split}.tsv", head + "\tscore\n", split,
              [(str(i), f"{text()} {'good' if i % 2 else 'bad'}", text(), float(f"{4 * (i % 2) + rng.rand():.3f}"))
               for i in range(n)], lambda i, a, b, l: f"{row(i, a, b)}\t{l:.3f}\n")
        w("test.tsv", head + "\n", "test",
          [(i, f"{text()} {'good' if int(i) % 2 else 'bad'}", text(), None) for i in TEST_IDS],
          lambda i, a, b, l: row(i, a, b) + "\n")
    elif task == "qqp":
        for split, n in labelled:
            w(f"{split}.tsv", "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n", split,
              [(str(i), f"{text()}?", f"{text()}?", str(i % 2)) for i in range(n)],
              lambda i, a, b, l: f"{i}\t1\t2\t{a}\t{b}\t{l}\n")
        w("test.tsv", "id\tquestion1\tquestion2\n", "test", [(i, text(), text(), None) for i in TEST_IDS],
          lambda i, a, b, l: f"{i}\t{a}\t{b}\n")
    elif task == "mnli":
        labels = ("contradiction", "entailment", "neutral")
        head = "index\tpromptID\tpairID\tgenre\ts1bp\ts2bp\ts1p\ts2p\tsentence1\tsentence2"
        line = lambda i, a, b, extra: f"{i}\t1\t1a\tfiction\t()\t()\t()\t()\t{a}\t{b}{extra}\n"
        w("train.tsv", head + "\tlabel1\tgold_label\n", "train",
          [(str(i), text(), text(), labels[i % 3]) for i in range(n_train)],
          lambda i, a, b, l: line(i, a, b, f"\t{l}\t{l}"))
        for split in ("dev_matched", "dev_mismatched"):
            w(f"{split}.tsv", head + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n", split,
              [(str(i), text(), text(), labels[i % 3]) for i in range(n_dev)],
              lambda i, a, b, l: line(i, a, b, "\tneutral" * 5 + f"\t{l}"))
        for split in ("test_matched", "test_mismatched"):
            w(f"{split}.tsv", head + "\n", split, [(i, text(), text(), None) for i in TEST_IDS],
              lambda i, a, b, l: line(i, a, b, ""))
        os.makedirs(os.path.join(folder, "..", "diagnostic"), exist_ok=True)
        w(os.path.join("..", "diagnostic", "diagnostic.tsv"), "index\tsentence1\tsentence2\n", "test_ax",
          [(i, text(), text(), None) for i in TEST_IDS], lambda i, a, b, l: f"{i}\t{a}\t{b}\n")
    else:  # qnli, rte, wnli
        cols = {"qnli": ("question", "sentence"), "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2")}[task]
        labels = {"qnli": ("entailment", "not_entailment"), "rte": ("entailment", "not_entailment"), "wnli": ("0", "1")}[task]
        for split, n in labelled:
            w(f"{split}.tsv", f"index\t{cols[0]}\t{cols[1]}\tlabel\n", split,
              [(str(i), text(), text(), labels[i % 2]) for i in range(n)], lambda i, a, b, l: f"{i}\t{a}\t{b}\t{l}\n")
        w("test.tsv", f"index\t{cols[0]}\t{cols[1]}\n", "test", [(i, text(), text(), None) for i in TEST_IDS],
          lambda i, a, b, l: f"{i}\t{a}\t{b}\n")
    return written
