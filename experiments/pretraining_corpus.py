"""Stage 1 of experiments/pretraining_helps.py: the corpora (WikiText-2 raw, Gutenberg,
tiny-shakespeare, optionally the GLUE tasks' training text) -> Google's text format -> a trained
vocabulary (optional) -> records by `python -m data_pipeline.create_pretraining_data`.

experiments/chinese_pretraining_helps.py writes its own corpus and reuses `create_records` and
`records_info`. Each stage is skipped when its outputs exist (a rerun resumes).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
CORPUS_DIR = os.path.join(DATA, "corpus")  # the real text the studies pretrain on (`stage_corpus`)
UNCASED_VOCAB = os.path.join(DATA, "vocab", "bert-base-uncased", "vocab.txt")  # the released vocabulary

TRAIN_SHARDS = 16  # training text files, each a mix of every source (stage_corpus says why)

def log(msg: str) -> None:
    print(f"[pretraining_helps {time.strftime('%H:%M:%S')}] {msg}", flush=True)



# ---------------------------------------------------------------------------------------------
# Stage 1: corpus -> Google's text format -> records
# ---------------------------------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def wikitext_documents(path: str) -> list[list[str]]:
    """WikiText-2 raw: an article starts at a ` = Title = ` line; its paragraphs are split into
    sentences; ` @-@ `, ` @,@ `, ` @.@ ` (WikiText's escapes) become `-`, `,`, `.`."""
    from data_pipeline.pretraining_data import corpora

    docs: list[list[str]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if re.fullmatch(r"= [^=].* =", line):  # a top-level title: a new article
                docs.append([])
                continue
            if line.startswith("= ="):  # a section heading: not a sentence
                continue
            line = line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
            if not docs:
                docs.append([])
            docs[-1].extend(corpora.split_sentences(line))
    return [d for d in docs if d]


def gutenberg_documents(path: str) -> list[list[str]]:
    """A Project Gutenberg book without its licence header/footer; a chapter is a document
    (or 40 paragraphs where a book has no CHAPTER headings)."""
    from data_pipeline.pretraining_data import corpora

    with open(path, encoding="utf-8-sig", errors="replace") as f:
        text = f.read()
    start = re.search(r"\*\*\* ?START OF.*?\*\*\*", text)
    end = re.search(r"\*\*\* ?END OF.*?\*\*\*", text)
    text = text[start.end() if start else 0:end.start() if end else len(text)]
    docs: list[list[str]] = [[]]
    for para in _paragraphs(text):
        if re.match(r"(CHAPTER|Chapter) [0-9IVXLC]+", para) or len(docs[-1]) > 400:
            docs.append([])
            continue
        docs[-1].extend(corpora.split_sentences(para))
    return [d for d in docs if len(d) > 1]


def shakespeare_documents(path: str, speeches_per_doc: int = 40) -> list[list[str]]:
    """tiny-shakespeare: speeches (`Name:` then its lines) without the name, 40 to a document."""
    from data_pipeline.pretraining_data import corpora

    with open(path, encoding="utf-8", errors="replace") as f:
        speeches = _paragraphs(f.read())
    docs = []
    for i in range(0, len(speeches), speeches_per_doc):
        doc = []
        for speech in speeches[i:i + speeches_per_doc]:
            speech = re.sub(r"^[A-Za-z' ]+:\s*", "", speech)
            doc.extend(corpora.split_sentences(speech))
        if len(doc) > 1:
            docs.append(doc)
    return docs


def task_text_documents(glue_dir: str, tasks: list[str], rows_per_doc: int = 20) -> dict:
    """The GLUE tasks' *training* text, unlabelled, as documents (task-adaptive pretraining,
    Gururangan et al. 2020, "Don't Stop Pretraining"): a sentence-pair row (STS-B, MRPC, RTE) is
    one document, its first text then its second (so next-sentence prediction sees the pair as a
    real continuation, whatever its label); single-sentence rows (SST-2, CoLA), which come
    shuffled and unrelated, go `rows_per_doc` to a document. Never a dev or test file, never a
    label."""
    from data_pipeline.pretraining_data import corpora
    from data_pipeline.tasks import glue

    parts = {}
    for task in tasks:
        examples = glue.GlueTask(task, glue_dir).read("train")
        if glue.SPECS[task].text_b is not None:
            docs = [corpora.split_sentences(e.text_a) + corpora.split_sentences(e.text_b) for e in examples]
        else:
            docs = [[e.text_a for e in examples[i:i + rows_per_doc]]
                    for i in range(0, len(examples), rows_per_doc)]
        docs = [[s.strip() for s in d if s.strip()] for d in docs]
        parts[f"task_{task}"] = [d for d in docs if len(d) > 1]
    return parts


def stage_corpus(corpus_dir: str, out: str, task_text: dict | None = None) -> dict:
    """Writes out/train-*.txt (training, every source mixed) and out/heldout.txt; `task_text`
    (from `task_text_documents`) adds its documents to the training sources."""
    from data_pipeline.pretraining_data import corpora

    done = os.path.join(out, "corpus_info.json")
    if os.path.exists(done):
        log(f"corpus: {out} exists, skipped")
        return json.load(open(done, encoding="utf-8"))
    os.makedirs(out, exist_ok=True)
    wiki = []
    for path in sorted(glob.glob(os.path.join(corpus_dir, "wikitext-2-raw", "*.raw"))):
        wiki.extend(wikitext_documents(path))
    held = max(1, len(wiki) // 10)
    parts = {
        "wikitext": wiki[:-held],
        "heldout": wiki[-held:],
        "gutenberg": [d for p in sorted(glob.glob(os.path.join(corpus_dir, "gutenberg", "*.txt")))
                      for d in gutenberg_documents(p)],
        "shakespeare": [d for p in sorted(glob.glob(os.path.join(corpus_dir, "tinyshakespeare", "*.txt")))
                        for d in shakespeare_documents(p)],
        **(task_text or {}),
    }
    info = {name: {"documents": len(docs), "sentences": sum(map(len, docs))} for name, docs in parts.items()}
    corpora.write_google_text(os.path.join(out, "heldout.txt"), parts.pop("heldout"))
    # The training documents of every source, shuffled (seeded) and dealt round-robin into
    # TRAIN_SHARDS files: `create_pretraining_data` writes a shard's instances (shuffled within
    # it) one shard after another, so one file per source would give a stream in source order
    # (WikiText, then Gutenberg, then Shakespeare) that a 10k-record shuffle buffer cannot mix.
    import random
    train_docs = [d for docs in parts.values() for d in docs]
    random.Random(0).shuffle(train_docs)
    for k in range(TRAIN_SHARDS):
        corpora.write_google_text(os.path.join(out, f"train-{k:02d}.txt"), train_docs[k::TRAIN_SHARDS])
    info["train_shards"] = TRAIN_SHARDS
    with open(done, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    log(f"corpus: {info}")
    return info


def stage_vocab(corpus: str, out: str, vocab_size: int) -> str:
    """out/vocab.txt: `vocab_size` WordPiece lines trained on corpus/train-*.txt (lower-cased, as
    the uncased fine-tuning tasks), never on the held-out shard."""
    from data_pipeline import train_vocab

    path = os.path.join(out, "vocab.txt")
    if os.path.exists(path):
        log(f"vocab: {path} exists, skipped")
        return path
    os.makedirs(out, exist_ok=True)
    stats, _ = train_vocab.train_vocab(sorted(glob.glob(os.path.join(corpus, "train-*.txt"))), vocab_size,
                                    path, do_lower_case=True)  # written whole: a stopped stage reruns
    log(f"vocab: {vocab_size} lines from {stats.lines} lines, {stats.distinct_words} distinct words -> {path}")
    return path


def create_records(inputs: list[str], output: str, vocab: str, *, dupe_factor: int, seq_len: int,
                   predictions: int, shards: int, workers: int, flags: tuple = ()) -> None:
    cmd = [sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={','.join(inputs)}",
           f"--output_file={output}", f"--vocab_file={vocab}", "--do_lower_case=true",
           f"--max_seq_length={seq_len}", f"--max_predictions_per_seq={predictions}",
           f"--dupe_factor={dupe_factor}", f"--num_workers={workers}", f"--num_output_shards={shards}", *flags]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)


def records_info(out: str, **extra) -> dict:
    """`extra` plus the instance counts of out/train and out/heldout (their runs' manifests)."""
    info = dict(extra)
    for split in ("train", "heldout"):
        with open(os.path.join(out, split, f"{split}.dataset_info.json"), encoding="utf-8") as f:
            di = json.load(f)
        info[split] = {k: di[k] for k in ("instances", "num_instances", "records") if k in di}
    return info


def stage_records(corpus: str, out: str, vocab: str, *, dupe_factor: int, seq_len: int, predictions: int,
                  workers: int) -> dict:
    """W/records/train/train-*.tfrecord and W/records/heldout/heldout.tfrecord (+ each run's manifest,
    train.dataset_info.json and heldout.dataset_info.json)."""
    done = os.path.join(out, "records_done.json")
    if os.path.exists(done):
        log(f"records: {out} exists, skipped")
        return json.load(open(done, encoding="utf-8"))
    os.makedirs(out, exist_ok=True)
    started = time.time()
    train = sorted(glob.glob(os.path.join(corpus, "train-*.txt")))
    # Two subfolders (two datasets: the trainer reads each through its own glob), a manifest in each.
    create_records(train, os.path.join(out, "train", "train.tfrecord"), vocab, dupe_factor=dupe_factor,
                   seq_len=seq_len, predictions=predictions, shards=len(train), workers=workers)
    create_records([os.path.join(corpus, "heldout.txt")], os.path.join(out, "heldout", "heldout.tfrecord"),
                   vocab, dupe_factor=1, seq_len=seq_len, predictions=predictions, shards=1, workers=1)
    info = records_info(out, wall_s=round(time.time() - started, 1))
    with open(done, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    log(f"records: {info}")
    return info
