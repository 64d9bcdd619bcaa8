"""Document readers: Google's text format, TFDS text datasets, and the embedded offline corpus.

A *document* is a list of sentences (strings). Google's format, which `create_pretraining_data`
reads: one sentence per line, a blank line between documents.

- `read_google_text(path, stats)`: documents of one file, streamed. Bytes that are not UTF-8 are
  replaced (U+FFFD, which the tokenizer drops) and counted; a missing file is an error naming it.
- `read_tfds_documents(name, split, text_key)`: streams a TFDS text dataset (e.g.
  `wikipedia/20230601.en`); each example's text is split into sentences by `split_sentences`.
- `embedded_documents()` / `write_embedded_corpus(out_dir, num_shards)`: an offline corpus built
  at run time from text that ships with Python itself (the `pydoc_data` reference topics and the
  docstrings of the standard library's source files, read with `ast`, nothing imported). No text
  is copied into this repository; the same Python version gives the same corpus.

`split_sentences` is rule-based (no model download): it splits after `.`, `!`, `?` (and closing
quotes/brackets) followed by whitespace and an upper-case letter, digit or opening quote, except
after common abbreviations and single-letter initials.

This module never imports jax.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import re
import sysconfig
from typing import Iterable, Iterator, List, Optional

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

Document = List[str]


@dataclasses.dataclass
class ReadStats:
    """Counters of what reading saw (reported in dataset_info.json).

    `documents` are the documents read; of them, `documents_without_tokens` had no line with a
    token left after tokenization and were dropped (as the reference drops them), and
    `one_sentence_documents` kept a single sentence, so every next-sentence pair made from
    one has a random B segment (from another document). `empty_documents` counts the extra
    blank lines of the text format (or the TFDS rows with no text).
    """

    files: int = 0
    lines: int = 0
    documents: int = 0
    empty_documents: int = 0
    lines_with_bad_utf8: int = 0
    documents_without_tokens: int = 0
    one_sentence_documents: int = 0

    def add(self, other: "ReadStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# ---------------------------------------------------------------------------------------------
# Google's text format
# ---------------------------------------------------------------------------------------------


def iter_lines(path: str, stats: Optional[ReadStats] = None) -> Iterator[str]:
    """The stripped lines of a text file; invalid UTF-8 replaced (U+FFFD) and counted.

    Raises:
      FileNotFoundError: naming `path` when it does not exist.
    """
    stats = stats if stats is not None else ReadStats()
    lines = storage.utf8_lines(path)  # local or gs:// (storage imports no TensorFlow)
    stats.files += 1
    for line, bad in lines:
        stats.lines += 1
        stats.lines_with_bad_utf8 += bad
        yield line.strip()


def documents_from_lines(lines: Iterable[str], stats: Optional[ReadStats] = None) -> Iterator[Document]:
    """Google's format: a blank line ends a document; other lines are its sentences."""
    stats = stats if stats is not None else ReadStats()
    doc: Document = []
    for line in lines:
        if not line:
            if doc:
                stats.documents += 1
                yield doc
                doc = []
            else:
                stats.empty_documents += 1
            continue
        doc.append(line)
    if doc:
        stats.documents += 1
        yield doc


def read_google_text(path: str, stats: Optional[ReadStats] = None) -> Iterator[Document]:
    """Documents of one Google-format file (the file's end also ends a document)."""
    stats = stats if stats is not None else ReadStats()
    yield from documents_from_lines(iter_lines(path, stats), stats)


def write_google_text(path: str, documents: Iterable[Document]) -> int:
    """Writes documents in Google's format; returns the number written."""
    n = 0
    with storage.open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            if n:
                f.write("\n")
            f.write("\n".join(doc) + "\n")
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Sentence splitting
# ---------------------------------------------------------------------------------------------

_ABBREVIATIONS = {
    "e.g", "i.e", "etc", "vs", "cf", "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "no", "fig",
    "eq", "al", "approx", "inc", "ltd", "co", "corp", "dept", "univ", "jan", "feb", "mar", "apr",
    "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "u.s", "u.k", "p", "pp", "vol", "ed",
}
_BOUNDARY = re.compile(r"""([.!?]+["')\]]*)\s+(?=["'(\[]?[A-Z0-9])""")


def split_sentences(text: str) -> List[str]:
    """Rule-based sentence split of a paragraph (whitespace-normalized first).

    Example:
      >>> split_sentences("Dr. Smith arrived. It was 5 p.m. He left!  Then?")
      ['Dr. Smith arrived.', 'It was 5 p.m. He left!', 'Then?']
    """
    text = " ".join(text.split())
    if not text:
        return []
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(text):
        end = m.end(1)
        word = text[start:m.start(1) + 1].split(" ")[-1].rstrip(".!?").lower()
        if m.group(1).startswith(".") and (word in _ABBREVIATIONS or len(word) == 1 or
                                           word.replace(".", "") in ("am", "pm")):
            continue
        sentences.append(text[start:end].strip())
        start = m.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def text_to_document(text: str) -> Document:
    """Paragraphs (blank-line separated) -> sentences, in order."""
    doc: Document = []
    for para in re.split(r"\n\s*\n", text):
        doc.extend(split_sentences(para))
    return doc


# ---------------------------------------------------------------------------------------------
# TFDS
# ---------------------------------------------------------------------------------------------


def prepare_tfds(name: str, data_dir: Optional[str] = None) -> None:
    """Downloads and prepares a TFDS dataset unless `data_dir` already holds it (then a no-op).

    Called once by the parent process: N workers each running `tfds.load`'s default download
    would build the same dataset N times into the same folder.
    """
    from data_pipeline import tf_import

    with tf_import.keras_deferred():  # tfds imports TensorFlow: without Keras
        import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        logging.info("TFDS dataset %s is not in %s: downloading and preparing it once, before the workers",
                     name, builder.data_dir)
    builder.download_and_prepare()


def read_tfds_documents(name: str, split: str = "train", text_key: str = "text",
                        data_dir: Optional[str] = None, shard_index: int = 0,
                        num_shards: int = 1, stats: Optional[ReadStats] = None,
                        download: bool = True) -> Iterator[Document]:
    """Streams documents of a TFDS text dataset (e.g. `wikipedia/20230601.en`, key "text").

    Part `shard_index` of `num_shards` even, contiguous parts of the split is read
    (`tfds.even_splits`), so workers split one dataset and each reads only its own part of the
    files, not the whole split. With `download=False` the dataset must already be prepared
    (`prepare_tfds`, run once before the local workers start, so they do not each build it).
    """
    from data_pipeline import tf_import

    with tf_import.keras_deferred():  # tfds imports TensorFlow: without Keras
        import tensorflow_datasets as tfds

    stats = stats if stats is not None else ReadStats()
    if num_shards > 1:
        split = tfds.even_splits(split, n=num_shards)[shard_index]
    ds = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False, download=download)
    for ex in tfds.as_numpy(ds):
        if text_key not in ex:
            raise KeyError(f"--tfds_text_key={text_key!r} is not a feature of {name}; it has {sorted(ex)}")
        value = ex[text_key]
        if isinstance(value, bytes):
            text = value.decode("utf-8", errors="replace")
            if "\ufffd" in text and b"\xef\xbf\xbd" not in value:
                stats.lines_with_bad_utf8 += 1  # per example: the bad bytes' line is not known
        else:
            text = str(value)
        doc = text_to_document(text)
        if doc:
            stats.documents += 1
            yield doc
        else:
            stats.empty_documents += 1


# ---------------------------------------------------------------------------------------------
# The embedded offline corpus
# ---------------------------------------------------------------------------------------------

_UNDERLINE = re.compile(r"^\s*[*=\-~^]{3,}\s*$")


def _prose_paragraphs(text: str) -> List[str]:
    """Prose paragraphs of reStructuredText-like help text: code, grammar and headings dropped."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = [l for l in para.splitlines() if l.strip()]
        if not lines or any(_UNDERLINE.match(l) for l in lines):
            continue
        if any(l.startswith(("   ", "\t", ">>>")) or "::=" in l for l in lines):
            continue  # indented code / grammar productions
        joined = " ".join(l.strip() for l in lines)
        if len(joined.split()) >= 4:
            out.append(joined)
    return out


def _stdlib_docstrings(limit_files: Optional[int] = None) -> Iterator[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = []
    for root, dirs, files in storage.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages",
                                                     "lib2to3", "__pycache__"))
        paths.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))
    for path in paths[:limit_files]:
        try:
            tree = ast.parse(storage.read_bytes(path))
        except (SyntaxError, ValueError, OSError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
        if parts:
            yield "\n\n".join(parts)


def embedded_documents(include_stdlib: bool = True) -> Iterator[Document]:
    """Documents from Python's own documentation text: one per pydoc topic, one per stdlib file."""
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    for text in texts:
        doc = [s for p in _prose_paragraphs(text) for s in split_sentences(p)]
        if len(doc) >= 2:
            yield doc
    if include_stdlib:
        for text in _stdlib_docstrings():
            doc = [s for p in _prose_paragraphs(text) for s in split_sentences(p)]
            if len(doc) >= 2:
                yield doc


def write_embedded_corpus(out_dir: str, num_shards: int = 4, include_stdlib: bool = True) -> List[str]:
    """Writes the embedded corpus as `num_shards` Google-format files (round-robin by document)."""
    storage.makedirs(out_dir)
    shards: List[List[Document]] = [[] for _ in range(num_shards)]
    for i, doc in enumerate(embedded_documents(include_stdlib)):
        shards[i % num_shards].append(doc)
    paths = []
    for i, docs in enumerate(shards):
        path = storage_paths.join(out_dir, f"embedded-{i:05d}-of-{num_shards:05d}.txt")
        write_google_text(path, docs)
        paths.append(path)
    return paths
