"""experiments/pretraining_helps.py end to end with --quick, on a toy corpus and GLUE folder written here.

The study itself (BERT-Tiny on the shared corpora) is too slow for CI; this checks the pipeline:
every stage writes its outputs, the report has both arms for every task and seed, and a rerun
skips every finished stage.
"""

import json

import numpy as np
import pytest

from experiments import pretraining_corpus, pretraining_helps

WORDS = ("the a cat dog sat ran on under mat house good bad film story king queen said went "
         "to of and was is it he she they we red blue green old new").split()


def sentence(rng, n=6):
    words = list(rng.choice(WORDS, n))
    return " ".join(words).capitalize() + "."


def write_data(root, rng):
    """A toy corpus in the three raw formats, a vocab of its words, and SST-2/RTE folders."""
    corpus = root / "corpus"
    for d in ("wikitext-2-raw", "gutenberg", "tinyshakespeare"):
        (corpus / d).mkdir(parents=True)
    wiki = []
    for a in range(4):
        wiki.append(f" = Article {a} = ")
        for _ in range(3):
            wiki.append(" " + " ".join(sentence(rng) for _ in range(4)))
        wiki.append(" = = Section = = ")
        wiki.append(" " + " ".join(sentence(rng) for _ in range(4)))
    (corpus / "wikitext-2-raw" / "wiki.test.raw").write_text("\n".join(wiki) + "\n")
    book = ["Licence header.", "", "*** START OF THIS PROJECT GUTENBERG EBOOK TOY ***", ""]
    for c in range(2):
        book += [f"CHAPTER {c + 1}", ""]
        for _ in range(5):
            book += [sentence(rng), sentence(rng), ""]
    book += ["*** END OF THIS PROJECT GUTENBERG EBOOK TOY ***", "Licence footer."]
    (corpus / "gutenberg" / "toy.txt").write_text("\n".join(book) + "\n")
    plays = "".join(f"King:\n{sentence(rng)}\n{sentence(rng)}\n\n" for _ in range(50))
    (corpus / "tinyshakespeare" / "input.txt").write_text(plays)

    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list(".,=:")) + "\n")

    glue = root / "glue"
    (glue / "SST-2").mkdir(parents=True)
    for split, n in (("train", 48), ("dev", 16)):
        rows = [(sentence(rng, 5).replace(".", "") + (" good" if i % 2 else " bad"), i % 2) for i in range(n)]
        (glue / "SST-2" / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in rows))
    return corpus, vocab, glue


@pytest.fixture
def compile_cache(tmp_path):
    """The two fine-tuning runs share shapes: compile once (as tests/finetune/test_finetune.py does)."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for n, v in before.items():
        jax.config.update(n, v)


def test_quick_pipeline_and_resume(tmp_path, capsys, compile_cache):
    corpus, vocab, glue = write_data(tmp_path, np.random.RandomState(0))
    work = tmp_path / "work"
    out = tmp_path / "out"
    argv = [f"--workdir={work}", f"--corpus_dir={corpus}", f"--glue_dir={glue}", f"--vocab_file={vocab}",
            "--tasks=sst2", "--seeds=0",  # one seed: the test stays under a minute on one core
            "--task_text=sst2",  # task-adaptive pretraining: SST-2's training sentences join the corpus
            "--max_train_examples=32", "--finetune_lrs=1e-3,3e-3", "--quick", f"--output_dir={out}"]
    report = pretraining_helps.main(argv)

    # stage 1: corpus in Google's format (held-out shard apart), records with their dataset_info
    info = json.loads((work / "corpus" / "corpus_info.json").read_text())
    assert info["heldout"]["documents"] >= 1 and info["wikitext"]["documents"] >= 1
    assert info["gutenberg"]["documents"] == 2  # one per chapter, licence text dropped
    # the training text: 16 files, each a mix of the sources (documents dealt round-robin after a
    # seeded shuffle), together every training document once and no held-out one
    shards = sorted((work / "corpus").glob("train-*.txt"))
    assert len(shards) == pretraining_corpus.TRAIN_SHARDS
    docs = [d for p in shards for d in p.read_text().split("\n\n") if d.strip()]
    assert len(docs) == sum(info[s]["documents"] for s in ("wikitext", "gutenberg", "shakespeare", "task_sst2"))
    # --task_text: every SST-2 training sentence, 20 to a document; no dev sentence, no label
    train_rows = [r.split("\t") for r in (glue / "SST-2" / "train.tsv").read_text().splitlines()[1:]]
    dev_rows = [r.split("\t") for r in (glue / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
    assert info["task_sst2"] == {"documents": 48 // 20 + 1, "sentences": 48}
    lines = {line for d in docs for line in d.splitlines()}
    assert {s for s, _ in train_rows} <= lines and not {s for s, _ in dev_rows} & lines
    assert not any("\t" in line for line in lines)
    heldout = [d for d in (work / "corpus" / "heldout.txt").read_text().split("\n\n") if d.strip()]
    assert len(heldout) == info["heldout"]["documents"] and not set(heldout) & set(docs)
    text = "".join(p.read_text() for p in shards)
    assert "Licence" not in text and "King:" not in text
    assert len({p.read_text() for p in shards}) > 1
    records = json.loads((work / "records" / "train" / "train.dataset_info.json").read_text())
    assert len(records["files"]) == pretraining_corpus.TRAIN_SHARDS
    for split in ("train", "heldout"):
        assert json.loads((work / "records" / split / f"{split}.dataset_info.json").read_text())["num_instances"] > 0
    # stage 2: the pretraining reached its last step and logged MLM curves
    assert (work / "pretrain" / "checkpoints" / "4" / "commit_success.txt").exists()
    assert len(report["pretraining_curves"]["train/mlm_loss"]) == 4
    assert "eval/masked_lm_accuracy" in report["pretraining_curves"]
    # stage 3: a random-init export of the same shape, and both arms for every seed
    assert (work / "random_init" / "bert_config.json").exists()
    sst2 = report["tasks"]["sst2"]
    for arm in ("pretrained", "random"):
        assert sorted(sst2[arm]["per_seed"]) == ["0"]
        # The reported score is the dev accuracy of the predictions that run wrote.
        rows = [line.split("\t") for line in (work / "finetune" / arm / "sst2" / "seed0" / "sst2_dev_predictions.tsv")
                .read_text().splitlines()[1:]]
        assert rows and sst2[arm]["per_seed"]["0"] == pytest.approx(sum(p == g for _, p, g in rows) / len(rows))
    assert len((work / "glue_train" / "sst2_train_32.tsv").read_text().splitlines()) == 33  # header + 32
    # the learning rate: each arm's best on a held-back fifth of the 32 training rows, never on dev
    full = (work / "glue_train" / "sst2_train_32.tsv").read_text().splitlines()
    fit = (work / "glue_train" / "sst2_train_32_fit.tsv").read_text().splitlines()
    select = (work / "glue_train" / "sst2_train_32_select.tsv").read_text().splitlines()
    assert len(select) == 1 + 6 and sorted(fit[1:] + select[1:]) == sorted(full[1:])
    for arm in ("pretrained", "random"):
        chosen = report["learning_rates"]["sst2"][arm]
        scores = chosen["selection_scores"]
        assert set(scores) == {"0.001", "0.003"}
        assert scores[f"{chosen['lr']:g}"] == max(scores.values())
        for lr in (1e-3, 3e-3):
            run = json.loads((work / "select" / arm / "sst2" / f"lr{lr:g}" / "result.json").read_text())
            assert run["dev_file"].endswith("_select.tsv") and run["learning_rate"] == lr
        final = json.loads((work / "finetune" / arm / "sst2" / "seed0" / "result.json").read_text())
        assert final["learning_rate"] == chosen["lr"] and final["dev_file"] == ""
    # stage 4: JSON + PNG, copied to --output_dir
    saved = json.loads((out / "pretraining_helps.json").read_text())
    assert set(saved["tasks"]["sst2"]) >= {"pretrained", "random", "delta_points"}
    assert (out / "pretraining_helps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A rerun skips every stage and gives the same scores.
    capsys.readouterr()
    again = pretraining_helps.main(argv)
    printed = capsys.readouterr().out
    for stage in ("corpus:", "records:", "pretrain:", "random init:"):
        assert f"{stage} " in printed and "skipped" in printed.split(stage, 1)[1].split("\n", 1)[0]
    assert printed.count("done, skipped") == 2 + 4  # the two final runs and the four selection runs
    assert again["tasks"] == report["tasks"]


def test_trained_vocab_reads_only_the_training_shards(tmp_path, capsys):
    """--train_vocab_size: a WordPiece vocab trained on W/corpus/train-*.txt; a word that only the
    held-out shard has gets no entry of its own, and a rerun keeps the file."""
    corpus, _, _ = write_data(tmp_path, np.random.RandomState(0))
    raw = corpus / "wikitext-2-raw" / "wiki.test.raw"
    # the last article is the held-out shard (a tenth of 4 articles, at least 1): give it a word
    raw.write_text(raw.read_text().rstrip("\n") + " Zyzzyva zyzzyva zyzzyva.\n")
    work = tmp_path / "work"
    pretraining_corpus.stage_corpus(str(corpus), str(work / "corpus"))
    assert "zyzzyva" in (work / "corpus" / "heldout.txt").read_text().lower()
    path = pretraining_corpus.stage_vocab(str(work / "corpus"), str(work / "vocab"), 200)
    vocab = open(path, encoding="utf-8").read().splitlines()
    assert len(vocab) == 200 and vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert {"queen", "house", "green"} <= set(vocab)  # training words, whole
    assert "zyzzyva" not in vocab and "##zyzzyva" not in vocab
    # a rerun skips it (the stage is resumable)
    capsys.readouterr()
    assert pretraining_corpus.stage_vocab(str(work / "corpus"), str(work / "vocab"), 200) == path
    assert "skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's error, naming the flag
        pretraining_helps.parse_args([f"--workdir={work}", "--train_vocab_size=-1"])
    assert "--train_vocab_size=-1" in capsys.readouterr().err
