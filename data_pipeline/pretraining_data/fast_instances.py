"""The fast mode's instances: the reference's algorithm on token-id arrays, vectorized in numpy.

`instances.py` runs google-research/bert's algorithm token by token in Python, random call for
random call, to reproduce its records exactly. This module draws instances from the same
*distribution* with its own random stream (`numpy.random.Generator`), working on spans of one
int32 array of token ids instead of lists of strings:

- `tokenize_shard`: every sentence of a shard tokenized once (`FastTokenizer.encode_batch`) into
  one id array, sentence offsets and document ranges; sentences without tokens and documents
  without sentences are dropped, as the reference drops them. With Chinese whole-word masking
  a bool array beside the ids marks the tokens that continue a segmenter word
  (`chinese_words.py`).
- `make_pairs`: all (dupe, document) walks at once, one step per chunk. As in the reference,
  per walk: the target length is `max_seq_length - 3`, or with probability `short_seq_prob`
  uniform in [2, max_seq_length - 3]; a chunk is the sentences from the current one until the
  target length or the document's end (a `searchsorted` on the sentence offsets); A is its
  first `uniform[1, n - 1]` sentences (all of a one-sentence chunk); B is random with
  probability 0.5 and always for a one-sentence chunk: a uniformly chosen *other* document of
  the shard (the reference's ten draws avoid the current document unless the corpus has one
  document), from a uniformly chosen sentence until `target - len(A)` tokens or its end, and the
  chunk's unused sentences are walked again; otherwise B is the rest of the chunk. Every
  instance is a pair of spans `[a_start, a_end)`, `[b_start, b_end)` into the id array.
- `truncate_pairs`: the reference trims the longer segment one token at a time, front or back
  by a fair coin, until A + B fits. Which side loses how many tokens is a function of the two
  lengths (closed form below); the number taken from the front of a side is then
  Binomial(trims, 1/2): the same distribution, with two draws per instance.
- `masked_features`: a batch of instances as the schema's padded arrays: `[CLS] A [SEP] B [SEP]`,
  segment ids, masking. The reference shuffles the candidate positions (every token but
  [CLS]/[SEP]; with whole-word masking a `##` piece, or a token marked as continuing a
  word (a Chinese word; a tokenizer.json's pre-tokenizer word), joins the candidate before it) and takes
  them in order while they fit `num_to_predict = min(max_predictions_per_seq, max(1,
  round(len * masked_lm_prob)))`, skipping a whole word that would overflow. Without whole-word
  masking that is a uniform random subset of `min(num_to_predict, candidates)` positions
  (Floyd's sampling, one numpy step per draw for the whole batch); with it, the same greedy
  walk over a random order of the words, one numpy step per rank for the whole batch. Each masked position then becomes
  [MASK] with probability 0.8, keeps its token with 0.1, or becomes an id drawn uniformly from
  the vocabulary list with 0.1 (the reference draws from `list(vocab.keys())`): the rule of
  `data_pipeline/masking_rule.py`, both of its uniforms drawn for every slot in advance.

Nothing here does I/O or imports jax or tensorflow.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from data_pipeline import masking_rule, tokenization
from data_pipeline.pretraining_data.instances import MaskStats


@dataclasses.dataclass
class ShardTokens:
    """A shard's token ids: sentence s is `ids[sentence_starts[s]:sentence_starts[s + 1]]`,
    document d its sentences `doc_first[d] .. doc_end[d] - 1`."""

    ids: np.ndarray  # int32 [tokens]
    sentence_starts: np.ndarray  # int64 [sentences + 1]
    doc_first: np.ndarray  # int64 [documents]
    doc_end: np.ndarray  # int64 [documents]
    num_input_documents: int = 0  # documents given, with those that had no tokens
    continues: Optional[np.ndarray] = None  # bool [tokens]: continues a word (Chinese; a tokenizer.json's), or None

    @property
    def num_documents(self) -> int:
        return len(self.doc_first)


def tokenize_shard(documents: Iterable[Sequence[str]], encode_batch: Callable[[List[str]], List[List[int]]],
                   batch_sentences: int = 50_000,
                   word_continuations: Optional[Callable[[List[str], List[List[int]]], List[List[bool]]]] = None
                   ) -> ShardTokens:
    """Tokenizes documents (lists of sentences) into a `ShardTokens`.

    Sentences go through `encode_batch` (e.g. `FastTokenizer.encode_batch`) about
    `batch_sentences` at a time. `word_continuations(sentences, their ids)`, given, returns per
    sentence one bool per token (Chinese whole-word masking's "continues the word before"),
    kept in `ShardTokens.continues`.
    """
    id_parts: List[np.ndarray] = []
    len_parts: List[np.ndarray] = []
    cont_parts: List[np.ndarray] = []
    doc_sizes: List[int] = []
    pending: List[str] = []

    def flush():
        encoded = encode_batch(pending)
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        total = int(lengths.sum())
        id_parts.append(np.fromiter(itertools.chain.from_iterable(encoded), np.int32, total))
        len_parts.append(lengths)
        if word_continuations is not None:
            cont_parts.append(np.fromiter(itertools.chain.from_iterable(word_continuations(pending, encoded)),
                                          bool, total))
        pending.clear()

    for doc in documents:
        pending.extend(doc)
        doc_sizes.append(len(doc))
        if len(pending) >= batch_sentences:
            flush()
    if pending:
        flush()
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.int32)
    continues = None
    if word_continuations is not None:
        continues = np.concatenate(cont_parts) if cont_parts else np.zeros(0, bool)
    lengths = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
    sent_doc = np.repeat(np.arange(len(doc_sizes), dtype=np.int64), doc_sizes)
    keep = lengths > 0  # the reference drops a sentence with no tokens ...
    lengths, sent_doc = lengths[keep], sent_doc[keep]
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    # ... and then a document with no sentences.
    new_doc = np.ones(len(sent_doc), bool)
    new_doc[1:] = sent_doc[1:] != sent_doc[:-1]
    doc_first = np.flatnonzero(new_doc).astype(np.int64)
    doc_end = np.append(doc_first[1:], len(sent_doc)).astype(np.int64)
    return ShardTokens(ids, starts, doc_first, doc_end, len(doc_sizes), continues)


@dataclasses.dataclass
class Pairs:
    """Instances as spans into `ShardTokens.ids`: A = [a_start, a_end), B = [b_start, b_end)."""

    a_start: np.ndarray
    a_end: np.ndarray
    b_start: np.ndarray
    b_end: np.ndarray
    is_random_next: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.a_start)

    def take(self, index) -> "Pairs":
        return Pairs(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def make_pairs(shard: ShardTokens, *, max_seq_length: int, short_seq_prob: float, dupe_factor: int,
               rng: np.random.Generator) -> Pairs:
    """All segment pairs of `dupe_factor` passes over the shard's documents (see the module doc)."""
    num_docs = shard.num_documents
    empty = np.zeros(0, np.int64)
    if num_docs == 0:
        return Pairs(empty, empty, empty, empty, np.zeros(0, bool))
    off = shard.sentence_starts
    doc_first, doc_end = shard.doc_first, shard.doc_end
    max_num_tokens = max_seq_length - 3
    lane_doc = np.tile(np.arange(num_docs, dtype=np.int64), dupe_factor)
    lanes = len(lane_doc)
    target = np.full(lanes, max_num_tokens, np.int64)
    short = rng.random(lanes) < short_seq_prob
    target[short] = rng.integers(2, max_num_tokens + 1, int(short.sum()))
    cur = doc_first[lane_doc].copy()
    last = doc_end[lane_doc] - 1
    active = np.arange(lanes)
    out = []
    while active.size:
        i, t, d = cur[active], target[active], lane_doc[active]
        size = len(i)
        # The chunk: sentences i..j, until the target length or the document's last sentence.
        j = np.minimum(np.searchsorted(off, off[i] + t, side="left") - 1, last[active])
        n = j - i + 1
        a_sents = rng.integers(1, np.maximum(n, 2))
        is_random = (n == 1) | (rng.random(size) < 0.5)
        a0, a1 = off[i], off[i + a_sents]
        # A random B: another document, from a random sentence, until target - len(A) tokens.
        if num_docs > 1:
            other = rng.integers(0, num_docs - 1, size)
            other += other >= d
        else:
            other = d
        first, end = doc_first[other], doc_end[other]
        rs = first + rng.integers(0, end - first)
        e = np.clip(np.searchsorted(off, off[rs] + (t - (a1 - a0)), side="left") - 1, rs, end - 1)
        b0 = np.where(is_random, off[rs], a1)
        b1 = np.where(is_random, off[e + 1], off[j + 1])
        out.append((a0, a1, b0, b1, is_random))
        nxt = np.where(is_random, i + a_sents, j + 1)  # a random B puts the unused sentences back
        cur[active] = nxt
        active = active[nxt <= last[active]]
    return Pairs(*(np.concatenate(x) for x in zip(*out)))


def truncation(len_a: np.ndarray, len_b: np.ndarray, max_num_tokens: int):
    """(tokens trimmed from A, from B) by the reference's `truncate_seq_pair` loop, which trims A
    while it is strictly longer, else B.

    Example: A=6, B=3, max 6: A, A, A -> 3 = 3 -> (3, 0); A=3, B=3, max 4: B, A -> (1, 1).
    """
    excess = np.maximum(len_a + len_b - max_num_tokens, 0)
    a_longer = len_a > len_b
    # A longer by d: A loses min(excess, d); the rest alternates starting with B (a tie trims B).
    d = len_a - len_b
    r1 = np.maximum(excess - d, 0)
    trim_a1 = np.minimum(excess, d) + r1 // 2
    # B at least as long, by d' = -d: B loses up to d' + 1 (to one below A); then A, B, A, ...
    d2 = len_b - len_a + 1
    r2 = np.maximum(excess - d2, 0)
    trim_b2 = np.minimum(excess, d2) + r2 // 2
    trim_a = np.where(a_longer, trim_a1, excess - trim_b2)
    return trim_a, excess - trim_a


def truncate_pairs(pairs: Pairs, max_num_tokens: int, rng: np.random.Generator) -> Pairs:
    """Trims each pair to `max_num_tokens`; each trimmed token is from the front or the back of
    its side by a fair coin, so the front count is Binomial(trimmed, 1/2)."""
    len_a = pairs.a_end - pairs.a_start
    len_b = pairs.b_end - pairs.b_start
    trim_a, trim_b = truncation(len_a, len_b, max_num_tokens)
    front_a = rng.binomial(trim_a, 0.5)
    front_b = rng.binomial(trim_b, 0.5)
    return Pairs(pairs.a_start + front_a, pairs.a_end - (trim_a - front_a),
                 pairs.b_start + front_b, pairs.b_end - (trim_b - front_b), pairs.is_random_next)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """What masking needs of the vocabulary."""

    cls_id: int
    sep_id: int
    mask_id: int
    word_ids: np.ndarray  # int32: the id of each entry of `list(vocab.keys())` (random words)
    is_subword: np.ndarray  # bool [max id + 1]: the token starts with "##"

    @classmethod
    def from_dict(cls, vocab: dict, special_tokens: Sequence[str] = (tokenization.CLS_TOKEN, tokenization.SEP_TOKEN,
                                                                      tokenization.MASK_TOKEN),
                  subword_prefix: Optional[str] = "##") -> "Vocab":
        """From a token -> id dict. `special_tokens`: the (cls, sep, mask) tokens (a tokenizer.json names
        its own); `subword_prefix` None: no token is a continuation piece by its spelling (BPE, whose
        words come from the tokenizer instead: `ShardTokens.continues`)."""
        tokenization.require_tokens(vocab, "the vocabulary", special_tokens)
        ids = np.fromiter(vocab.values(), np.int32, len(vocab))
        is_subword = np.zeros(int(ids.max()) + 1, bool)
        if subword_prefix:
            for token, index in vocab.items():
                if token.startswith(subword_prefix):
                    is_subword[index] = True
        cls_token, sep_token, mask_token = special_tokens
        return cls(vocab[cls_token], vocab[sep_token], vocab[mask_token], ids, is_subword)


def masked_features(ids: np.ndarray, pairs: Pairs, vocab: Vocab, *, max_seq_length: int,
                    max_predictions_per_seq: int, masked_lm_prob: float, do_whole_word_mask: bool,
                    rng: np.random.Generator, stats: MaskStats, continues: Optional[np.ndarray] = None) -> dict:
    """The schema's features ([batch, length] arrays, zero padded) of a batch of pairs.

    `continues` (bool, aligned with `ids`; `ShardTokens.continues`): with whole-word masking, the
    tokens that join the candidate before them besides `##` pieces (Chinese words). Without it,
    or when it is all False, the features and the random draws are those of Google's grouping.
    """
    batch, seq, preds = len(pairs), max_seq_length, max_predictions_per_seq
    itype = np.int32 if len(ids) < 2**31 - seq else np.int64
    len_a = (pairs.a_end - pairs.a_start).astype(itype)
    len_b = (pairs.b_end - pairs.b_start).astype(itype)
    length = len_a + len_b + 3
    p = np.arange(seq, dtype=itype)[None, :]
    # [CLS] A [SEP] B [SEP]: position p reads ids[a_start + p - 1] in A, ids[b_start + p - len_a - 2] in B.
    in_a = p <= len_a[:, None]
    src = np.where(in_a, (pairs.a_start - 1).astype(itype)[:, None], (pairs.b_start - len_a - 2).astype(itype)[:, None])
    src += p
    np.clip(src, 0, max(len(ids) - 1, 0), out=src)
    tokens = ids[src]
    joins = continues[src] if do_whole_word_mask and continues is not None and len(continues) else None
    rows = np.arange(batch)
    tokens[:, 0] = vocab.cls_id
    tokens[rows, len_a + 1] = vocab.sep_id
    tokens[rows, length - 1] = vocab.sep_id
    tokens[p >= length[:, None]] = 0

    num_to_predict = np.minimum(preds, np.maximum(1, np.rint(length * masked_lm_prob).astype(np.int64)))
    if do_whole_word_mask:
        candidate = (p >= 1) & (p < length[:, None] - 1)
        candidate[rows, len_a + 1] = False
        masked = _whole_word_selection(tokens, candidate, num_to_predict, vocab, rng, joins)
        count = masked.sum(axis=1)
        mrow, mcol = np.nonzero(masked)
        slot = np.arange(len(mrow)) - np.repeat(np.cumsum(count) - count, count)
        chosen = np.full((batch, preds), seq, itype)
        chosen[mrow, slot] = mcol
    else:
        count = np.minimum(num_to_predict, length - 3)
        chosen = _uniform_subsets(len_a, length - 3, count, preds, seq, rng)
    # `chosen`: each row's masked positions in increasing order, then `seq` (unused slots).
    used = np.arange(preds)[None, :] < count[:, None]
    safe = np.where(used, chosen, 0)
    labels = np.take_along_axis(tokens, safe, axis=1)
    u_mask = rng.random((batch, preds), dtype=np.float32)
    u_keep = rng.random((batch, preds), dtype=np.float32)
    random_word = vocab.word_ids[rng.integers(0, len(vocab.word_ids), (batch, preds))]
    is_mask, is_keep = masking_rule.outcomes(u_mask, u_keep)
    to_mask, to_keep, to_random = used & is_mask, used & is_keep, used & ~is_mask & ~is_keep
    replaced = np.where(to_mask, vocab.mask_id, np.where(to_random, random_word, labels))
    mrow, mslot = np.nonzero(used)
    tokens[mrow, safe[mrow, mslot]] = replaced[mrow, mslot]

    stats.candidates += int((length - 3).sum())
    stats.masked += int(count.sum())
    stats.replaced_by_mask += int(to_mask.sum())
    stats.kept += int(to_keep.sum())
    stats.replaced_by_random += int(to_random.sum())
    stats.instances += batch
    stats.random_next += int(pairs.is_random_next.sum())
    return {
        "input_ids": tokens,
        "input_mask": p < length[:, None],
        "segment_ids": (p >= len_a[:, None] + 2) & (p < length[:, None]),
        "masked_lm_positions": safe,
        "masked_lm_ids": np.where(used, labels, 0),
        "masked_lm_weights": used.astype(np.float32),
        "next_sentence_labels": pairs.is_random_next[:, None],
    }


def _uniform_subsets(len_a: np.ndarray, num_candidates: np.ndarray, count: np.ndarray, width: int,
                     seq: int, rng: np.random.Generator) -> np.ndarray:
    """Per row, `count` distinct candidate positions drawn uniformly (every k-subset equally
    likely, as the reference's shuffle-then-take), sorted, padded with `seq` to `width`.

    Candidates are numbered 0..n-1 over A then B; number c is position c + 1 in A, c + 2 in B
    (past A's [SEP]). Floyd's algorithm, one numpy step per draw for the whole batch: for j from
    n - k to n - 1, draw t uniform in [0, j]; take t unless already taken, else take j.
    """
    batch = len(count)
    steps = int(count.max()) if batch else 0
    taken = np.zeros((batch, seq + 1), bool)
    chosen = np.full((batch, max(width, 1)), seq, len_a.dtype)
    rows = np.arange(batch)
    for s in range(steps):
        live = rows[count > s]
        j = (num_candidates[live] - count[live] + s).astype(np.int64)
        t = rng.integers(0, j + 1)
        t = np.where(taken[live, t], j, t)
        taken[live, t] = True
        chosen[live, s] = t
    pos = chosen + 1 + (chosen >= len_a[:, None])  # candidate number -> position
    pos[chosen == seq] = seq
    pos.sort(axis=1)
    return pos[:, :width]


def _whole_word_selection(tokens: np.ndarray, candidate: np.ndarray, num_to_predict: np.ndarray,
                          vocab: Vocab, rng: np.random.Generator, joins: Optional[np.ndarray] = None) -> np.ndarray:
    """Masked positions [batch, length] of whole-word masking: words in a random order, each
    taken whole if it fits the budget (the reference's greedy walk). `joins` [batch, length]:
    tokens that continue the word before them besides `##` pieces (Chinese words)."""
    batch, seq = tokens.shape
    is_sub = vocab.is_subword[np.minimum(tokens, len(vocab.is_subword) - 1)]
    if joins is not None:
        is_sub |= joins
    # A "##" piece joins the candidate before it; the first candidate (position 1) has none.
    starts_word = candidate & ~is_sub
    starts_word[:, 1] = candidate[:, 1]
    word = np.cumsum(starts_word, axis=1) - 1  # word index of each candidate position
    num_words = starts_word.sum(axis=1)
    width = max(int(num_words.max()), 1)
    rows = np.arange(batch)
    flat = (rows[:, None] * width + word)[candidate]
    word_len = np.bincount(flat, minlength=batch * width).reshape(batch, width)
    keys = rng.random((batch, width), dtype=np.float32)
    keys[np.arange(width)[None, :] >= num_words[:, None]] = 2.0
    order = np.argsort(keys, axis=1)
    taken = np.zeros(batch, np.int64)
    chosen = np.zeros((batch, width), bool)
    live = rows[num_words > 0]
    for rank in range(width):
        w = order[live, rank]
        size = word_len[live, w]
        fits = (rank < num_words[live]) & (taken[live] + size <= num_to_predict[live])
        taken[live] += np.where(fits, size, 0)
        chosen[live, w] = fits
        live = live[(taken[live] < num_to_predict[live]) & (rank + 1 < num_words[live])]
        if not live.size:
            break
    word_chosen = np.take_along_axis(chosen, np.clip(word, 0, width - 1), axis=1)
    return candidate & word_chosen
