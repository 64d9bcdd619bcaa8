r"""Trains a WordPiece vocab.txt from raw text, with SentencePiece underneath.

This module owns vocabulary training. Google never released its WordPiece trainer; this one
gets an equivalent file in four steps:

1. Read the corpus and split it exactly as `FullTokenizer` will: `FastBasicTokenizer`
   (cleaning, CJK spacing, optional lower casing + accent stripping, punctuation split).
   Invalid UTF-8 is decoded with replacement and counted.
2. Count words and characters. Every character seen at least `min_char_count` times gets two
   entries, "c" and "##c", so any word made of such characters has a WordPiece split and
   `[UNK]` stays rare. Words with rarer characters, or longer than the tokenizer's 200
   characters, are left out of training (the tokenizer maps them to `[UNK]` anyway).
3. Train SentencePiece (BPE by default) on the word counts, with identity normalization so
   its pieces live in the same normalized space. SentencePiece marks a word start with "▁":
   "▁play" becomes the word-initial piece "play", and "ing" the continuation piece "##ing".
4. Write vocab.txt: reserved tokens, characters, then pieces in SentencePiece's order until
   `vocab_size` lines. At Google's size (30522) the reserved block copies Google's layout:
   `[PAD]` 0, `[unused0]`-`[unused98]`, `[UNK]` 100, `[CLS]` 101, `[SEP]` 102, `[MASK]` 103,
   `[unused99]`-`[unused993]`. Otherwise it is `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`.
   A corpus too small to fill the vocabulary is padded with `[unusedN]` so the size (which
   the model's embedding table is built from) is exactly what was asked.

Usage:
  python -m data_pipeline.train_vocab --input_file='corpus/*.txt,more/*.txt' \
      --vocab_size=30522 --output_file=vocab.txt --do_lower_case

Pass `--heldout_every=N` to hold out every N-th line and report the `[UNK]` rate on it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import tempfile
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from absl import app, flags, logging

from data_pipeline import storage, tokenization
from data_pipeline.storage import paths as storage_paths, staging as storage_staging
from data_pipeline.tokenization.fast import FastBasicTokenizer, FastTokenizer
from data_pipeline.tokenization.sentencepiece_tokenizer import SPM_SIDECAR_SUFFIX

GOOGLE_VOCAB_SIZE = 30522
BERT_SPECIAL_TOKENS = (tokenization.PAD_TOKEN, tokenization.UNK_TOKEN, tokenization.CLS_TOKEN, tokenization.SEP_TOKEN,
                       tokenization.MASK_TOKEN)
_SPM_WORD_START = "\u2581"  # SentencePiece's word-boundary marker "▁".
_READ_BATCH_LINES = 10_000


@dataclasses.dataclass
class VocabStats:
    """What `train_vocab` read and wrote (logged by the CLI)."""

    files: int = 0
    lines: int = 0
    bad_utf8_lines: int = 0  # lines with invalid UTF-8, decoded with U+FFFD (then dropped)
    heldout_lines: int = 0
    words: int = 0  # basic tokens in the training text
    distinct_words: int = 0
    chars_covered: int = 0  # distinct characters given "c" and "##c" entries
    chars_dropped: int = 0  # distinct characters below min_char_count
    pieces: int = 0  # vocabulary lines that came from SentencePiece
    padding: int = 0  # [unusedN] lines added because the corpus ran out of pieces


# --- reading ---------------------------------------------------------------------------


def read_lines(paths: Sequence[str], stats: Optional[VocabStats] = None) -> Iterator[str]:
    """Yields the lines of `paths` (`storage.utf8_lines`: bad UTF-8 replaced); counts bad lines."""
    for path in paths:
        lines = storage.utf8_lines(path)
        if stats is not None:
            stats.files += 1
        for line, bad in lines:
            if stats is not None:
                stats.lines += 1
                stats.bad_utf8_lines += bad
            yield line


def _batched(items: Iterable[str], size: int) -> Iterator[List[str]]:
    batch: List[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def count_words(texts: Iterable[str], do_lower_case: bool) -> "collections.Counter[str]":
    """Counts the basic tokens (`BasicTokenizer` output) of `texts`."""
    basic = FastBasicTokenizer(do_lower_case)
    counts: "collections.Counter[str]" = collections.Counter()
    for batch in _batched(texts, _READ_BATCH_LINES):
        for words in basic.tokenize_batch(batch):
            counts.update(words)
    return counts


# --- building the vocabulary -------------------------------------------------------------


def reserved_tokens(vocab_size: int) -> List[str]:
    """The tokens at the start of the vocabulary (Google's layout at 30522)."""
    if vocab_size == GOOGLE_VOCAB_SIZE:
        pad, *others = BERT_SPECIAL_TOKENS  # Google's ids: [PAD] 0, [UNK] [CLS] [SEP] [MASK] 100-103
        return [pad] + [f"[unused{i}]" for i in range(99)] + others + [f"[unused{i}]" for i in range(99, 994)]
    return list(BERT_SPECIAL_TOKENS)


def _char_counts(word_counts: "collections.Counter[str]") -> "collections.Counter[str]":
    chars: "collections.Counter[str]" = collections.Counter()
    for word, count in word_counts.items():
        for char in word:
            chars[char] += count
    return chars


def _train_sentencepiece(word_counts: Sequence[Tuple[str, int]], model_prefix: str,
                         vocab_size: int, model_type: str, num_threads: int) -> List[str]:
    """Trains SentencePiece on (word, count) pairs; returns its pieces in id order.

    `model_prefix` is local (a folder from `storage_staging.writing_dir` or a `tempfile` one): the C
    library writes PREFIX.model and PREFIX.vocab there itself.
    """
    import sentencepiece

    tsv = model_prefix + ".words.tsv"
    with storage.open(tsv, "w", encoding="utf-8") as writer:
        for word, count in word_counts:
            writer.write(f"{word}\t{count}\n")
    try:
        sentencepiece.SentencePieceTrainer.train(  # storage: local (a staging or tempfile folder)
            input=tsv, input_format="tsv", model_prefix=model_prefix, model_type=model_type,
            vocab_size=vocab_size,
            # The corpus may not support vocab_size pieces; take what it has and pad later.
            hard_vocab_limit=False,
            # Text is already normalized and split by the BERT rules; keep it as it is.
            normalization_rule_name="identity", character_coverage=1.0, byte_fallback=False,
            # BERT-style specials, so the saved .model can serve as a tokenizer on its own.
            pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
            pad_piece=tokenization.PAD_TOKEN, unk_piece=tokenization.UNK_TOKEN,
            user_defined_symbols=[tokenization.CLS_TOKEN, tokenization.SEP_TOKEN, tokenization.MASK_TOKEN],
            max_sentence_length=1 << 16, num_threads=num_threads, minloglevel=1)
    finally:
        storage.remove(tsv)
    model_proto = storage.read_bytes(model_prefix + ".model")
    model = sentencepiece.SentencePieceProcessor(model_proto=model_proto)  # storage: local (bytes read by storage)
    return [model.id_to_piece(i) for i in range(model.get_piece_size())]


def _to_wordpiece(piece: str) -> Optional[str]:
    """SentencePiece piece -> WordPiece entry ("▁ab" -> "ab", "ab" -> "##ab"), or None."""
    if piece in BERT_SPECIAL_TOKENS:
        return None
    if piece.startswith(_SPM_WORD_START):
        piece = piece[1:]
        return piece if piece and _SPM_WORD_START not in piece else None
    return "##" + piece if piece and _SPM_WORD_START not in piece else None


def build_vocab(word_counts: "collections.Counter[str]", vocab_size: int, *,
                model_type: str = "bpe", min_char_count: int = 2,
                spm_model_prefix: Optional[str] = None, num_threads: int = 2,
                stats: Optional[VocabStats] = None) -> List[str]:
    """WordPiece vocabulary (a list of exactly `vocab_size` tokens) from basic-token counts.

    Args:
      word_counts: basic token -> count, e.g. from `count_words`.
      vocab_size: number of tokens returned.
      model_type: SentencePiece model, "bpe" or "unigram".
      min_char_count: characters seen fewer times get no entry (they become `[UNK]`).
      spm_model_prefix: if set, the SentencePiece model is kept as PREFIX.model/.vocab.
      num_threads: SentencePiece trainer threads.
      stats: filled in if given.

    Raises:
      ValueError: if `vocab_size` cannot hold the reserved tokens and two entries per character.
    """
    stats = stats if stats is not None else VocabStats()
    reserved = reserved_tokens(vocab_size)
    char_counts = _char_counts(word_counts)
    covered = sorted((c for c, n in char_counts.items() if n >= min_char_count),
                     key=lambda c: (-char_counts[c], c))
    stats.chars_covered = len(covered)
    stats.chars_dropped = len(char_counts) - len(covered)
    stats.words = sum(word_counts.values())
    stats.distinct_words = len(word_counts)

    vocab = list(reserved)
    seen = set(vocab)
    for token in covered + ["##" + c for c in covered]:
        if token not in seen:
            vocab.append(token)
            seen.add(token)
    budget = vocab_size - len(vocab)
    if budget < 0:
        raise ValueError(
            f"vocab_size={vocab_size} cannot hold {len(reserved)} reserved tokens and "
            f"{len(covered)} characters twice; raise vocab_size or min_char_count.")

    covered_set = set(covered)
    trainable = sorted(((w, n) for w, n in word_counts.items()
                        if len(w) <= tokenization.MAX_INPUT_CHARS_PER_WORD
                        and covered_set.issuperset(w)),
                       key=lambda item: (-item[1], item[0]))
    pieces: List[str] = []
    if budget and trainable:
        with contextlib.ExitStack() as stack:
            if spm_model_prefix:
                # Trained in the prefix's folder when local (as before: the model records its
                # prefix), else in a staging folder uploaded when training is done.
                folder = storage_paths.dirname(spm_model_prefix)
                local = stack.enter_context(storage_staging.writing_dir(folder or os.curdir))
                prefix = os.path.join(local, storage_paths.basename(spm_model_prefix)) if folder else spm_model_prefix
            else:
                prefix = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "spm")
            # SentencePiece counts single characters and "▁c" forms that duplicate the entries
            # above, so ask for enough extra pieces to still fill the budget.
            spm_size = budget + 2 * len(covered) + 8
            pieces = _train_sentencepiece(trainable, prefix, spm_size, model_type, num_threads)
    for piece in pieces:
        if budget == 0:
            break
        token = _to_wordpiece(piece)
        if token is not None and token not in seen:
            vocab.append(token)
            seen.add(token)
            stats.pieces += 1
            budget -= 1
    unused = sum(t.startswith("[unused") for t in vocab)
    while budget:
        token = f"[unused{unused}]"
        unused += 1
        if token not in seen:
            vocab.append(token)
            seen.add(token)
            stats.padding += 1
            budget -= 1
    return vocab


def write_vocab(vocab: Sequence[str], output_file: str) -> None:
    """Writes one token per line (UTF-8), the format `tokenization.load_vocab` reads.

    Written whole or not at all (`storage.open`, local or gs://): a stopped run must not leave a
    short vocab.txt that a later stage (records, a resumed pipeline) would take for a finished one.
    """
    directory = storage_paths.dirname(output_file)
    if directory:
        storage.makedirs(directory)
    with storage.open(output_file, "w", encoding="utf-8", newline="\n") as writer:
        writer.writelines(t + "\n" for t in vocab)


# --- entry points ------------------------------------------------------------------------


def train_vocab_from_texts(texts: Iterable[str], vocab_size: int, output_file: str,
                           do_lower_case: bool = True, **kwargs) -> VocabStats:
    """Trains and writes a vocabulary from in-memory texts (e.g. an embedded demo corpus).

    Args:
      texts: lines or documents of raw text.
      vocab_size: lines in the written vocab.txt.
      output_file: vocab.txt path.
      do_lower_case: must match the `FullTokenizer` that will load the file.
      **kwargs: passed to `build_vocab` (model_type, min_char_count, spm_model_prefix, ...).
    """
    stats = kwargs.pop("stats", None) or VocabStats()
    source = kwargs.pop("source", "the texts")
    word_counts = count_words(texts, do_lower_case)
    if not word_counts:  # a vocab of reserved tokens and [unused] filler would be useless
        raise ValueError(f"{source}: no word to train on ({stats.lines} lines read; empty or blank input?)")
    vocab = build_vocab(word_counts, vocab_size, stats=stats, **kwargs)
    write_vocab(vocab, output_file)
    if kwargs.get("spm_model_prefix"):
        # The model learned from BasicTokenizer output: sentencepiece_tokenizer.create_tokenizer reads this
        # to run the same basic tokenization (and casing) before the model.
        storage.write_text(kwargs["spm_model_prefix"] + SPM_SIDECAR_SUFFIX,
                           json.dumps({"basic_tokenize": True, "do_lower_case": bool(do_lower_case)}))
    return stats


def train_vocab(input_files: Union[str, Sequence[str]], vocab_size: int, output_file: str,
                do_lower_case: bool = True, *, heldout_every: int = 0,
                max_heldout_lines: int = 100_000, **kwargs) -> Tuple[VocabStats, List[str]]:
    """Trains a WordPiece vocab.txt from text files.

    Args:
      input_files: comma-separated globs, or a list of globs/paths.
      vocab_size: lines in the written vocab.txt (30522 gives Google's reserved layout).
      output_file: vocab.txt path.
      do_lower_case: must match the `FullTokenizer` that will load the file.
      heldout_every: if > 0, every N-th line is held out of training and returned.
      max_heldout_lines: at most this many held-out lines are kept (memory bound); the rest
        of every N-th line is still left out of training.
      **kwargs: passed to `build_vocab` (model_type, min_char_count, spm_model_prefix, ...).

    Returns:
      (stats, held-out lines).
    """
    stats = VocabStats()
    heldout: List[str] = []

    def training_lines() -> Iterator[str]:
        for index, line in enumerate(read_lines(storage.expand_patterns(input_files, "--input_file"), stats)):
            if heldout_every > 0 and index % heldout_every == heldout_every - 1:
                stats.heldout_lines += 1
                if len(heldout) < max_heldout_lines:
                    heldout.append(line)
                continue
            yield line

    source = f"--input_file={input_files if isinstance(input_files, str) else ','.join(input_files)}"
    train_vocab_from_texts(training_lines(), vocab_size, output_file, do_lower_case,
                           stats=stats, source=source, **kwargs)
    return stats, heldout


def unk_rate(vocab_file: str, texts: Iterable[str], do_lower_case: bool = True) -> Tuple[int, int]:
    """(number of `[UNK]` tokens, number of tokens) of `texts` under `FastTokenizer`."""
    tokenizer = FastTokenizer(vocab_file, do_lower_case)
    unk_id = tokenizer.vocab[tokenization.UNK_TOKEN]
    unknown = total = 0
    for batch in _batched(texts, _READ_BATCH_LINES):
        for ids in tokenizer.encode_batch(batch):
            unknown += ids.count(unk_id)
            total += len(ids)
    return unknown, total


FLAGS = flags.FLAGS
flags.DEFINE_string("input_file", None, "Comma-separated globs of UTF-8 text files.")
flags.DEFINE_integer("vocab_size", 30522, "Lines in vocab.txt (30522: Google's layout).")
flags.DEFINE_string("output_file", None, "Where to write vocab.txt.")
flags.DEFINE_bool("do_lower_case", True, "Lowercase and strip accents (uncased model).")
flags.DEFINE_enum("model_type", "bpe", ["bpe", "unigram"], "SentencePiece model type.")
flags.DEFINE_integer("min_char_count", 2, "Characters seen fewer times become [UNK].")
flags.DEFINE_string("spm_model_prefix", None,
                    "If set, also keep the SentencePiece model as PREFIX.model/.vocab "
                    "(load with sentencepiece_tokenizer.create_tokenizer(PREFIX.model), which reads "
                    "PREFIX.tokenizer.json for the basic tokenization and casing it was trained with).")
flags.DEFINE_integer("heldout_every", 0, "Hold out every N-th line; report its [UNK] rate.")
flags.DEFINE_integer("num_threads", 2, "SentencePiece trainer threads.")


def main(argv: Sequence[str]) -> None:
    del argv
    stats, heldout = train_vocab(
        FLAGS.input_file, FLAGS.vocab_size, FLAGS.output_file, FLAGS.do_lower_case,
        heldout_every=FLAGS.heldout_every, model_type=FLAGS.model_type,
        min_char_count=FLAGS.min_char_count, spm_model_prefix=FLAGS.spm_model_prefix,
        num_threads=FLAGS.num_threads)
    logging.info("Wrote %s: %s", FLAGS.output_file, stats)
    if stats.bad_utf8_lines:
        logging.warning("%d lines had invalid UTF-8 (replaced).", stats.bad_utf8_lines)
    if heldout:
        unknown, total = unk_rate(FLAGS.output_file, heldout, FLAGS.do_lower_case)
        logging.info("Held-out [UNK] rate: %d / %d tokens = %.4f%%", unknown, total,
                     100.0 * unknown / max(total, 1))


if __name__ == "__main__":
    flags.mark_flags_as_required(["input_file", "output_file"])
    app.run(main)
