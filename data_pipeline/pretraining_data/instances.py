"""Pretraining instances: documents -> segment pairs (NSP), truncation, masking (incl. whole word).

The algorithm is google-research/bert's `create_pretraining_data.py`, step for step and random call
for random call, so that with the same `random.Random(seed)` and inputs the same instances come out:

- per document: the target length is `max_seq_length - 3`, or with probability
  `short_seq_prob` a `randint(2, max_num_tokens)`; sentences accumulate into a chunk until the
  target length or the document's end; segment A takes the first `randint(1, len(chunk) - 1)`
  sentences of the chunk (all of a one-sentence chunk);
- next-sentence prediction: B is random (label 1) when the chunk has one sentence or with
  probability 0.5: B is read from a random *other* document (up to 10 draws to avoid the current
  one) from a random sentence on, and the chunk's unused sentences are put back; otherwise B is
  the rest of the chunk (label 0);
- `truncate_seq_pair` trims the longer segment, from the front or the back at random, until
  A + B fits `max_seq_length - 3`;
- `[CLS] A [SEP] B [SEP]`, segment ids 0 then 1;
- masking: candidate positions are every token but [CLS]/[SEP] (with whole-word masking, a
  `##` piece joins the previous candidate, and so does a `WordContinuation`: Chinese whole-word
  masking's 2nd, 3rd, ... character of a segmenter word), shuffled; `num_to_predict = min(max_predictions_per_seq,
  max(1, round(len(tokens) * masked_lm_prob)))`; candidates are taken in order while they fit;
  each masked position becomes [MASK] (`random() < 0.8`), else keeps its token (`random() < 0.5`),
  else a word drawn uniformly from the whole vocabulary list (`data_pipeline/masking_rule.py`);
  positions sorted.

This module holds no I/O; `create_pretraining_data` feeds it documents and writes what it returns.
It never imports jax.
"""

from __future__ import annotations

import dataclasses
import random
from typing import List, Sequence, Tuple

from data_pipeline import masking_rule
from data_pipeline.tokenization import CLS_TOKEN, MASK_TOKEN, SEP_TOKEN

Tokens = List[str]


class WordContinuation(str):
    """A token that continues the word before it without being a `##` piece: a character of a
    Chinese word after its first (`chinese_words.py`, `--chinese_whole_word_mask`).

    It is the plain token string for every other use (equality, hashing, vocabulary lookup, the
    records' ids); only whole-word masking's grouping tells it apart, as it tells `##` apart.
    """

    __slots__ = ()


@dataclasses.dataclass
class TrainingInstance:
    tokens: List[str]
    segment_ids: List[int]
    is_random_next: bool
    masked_lm_positions: List[int]
    masked_lm_labels: List[str]


@dataclasses.dataclass
class MaskStats:
    """How masking went (for dataset_info.json): the reference's 15% and 80/10/10."""

    candidates: int = 0  # non-special tokens
    masked: int = 0
    replaced_by_mask: int = 0
    kept: int = 0
    replaced_by_random: int = 0
    instances: int = 0
    random_next: int = 0

    def add(self, other: "MaskStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d["masked_fraction_of_candidates"] = self.masked / max(self.candidates, 1)
        d["mask_fraction"] = self.replaced_by_mask / max(self.masked, 1)
        d["keep_fraction"] = self.kept / max(self.masked, 1)
        d["random_fraction"] = self.replaced_by_random / max(self.masked, 1)
        d["random_next_fraction"] = self.random_next / max(self.instances, 1)
        return d


def truncate_seq_pair(tokens_a: Tokens, tokens_b: Tokens, max_num_tokens: int, rng: random.Random) -> None:
    """Trims the longer of the two, one token at a time from a random end, until they fit."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def create_masked_lm_predictions(tokens: Sequence[str], masked_lm_prob: float, max_predictions_per_seq: int,
                                 vocab_words: Sequence[str], rng: random.Random, do_whole_word_mask: bool,
                                 stats: MaskStats) -> Tuple[List[str], List[int], List[str]]:
    """Returns (masked tokens, sorted positions, original labels)."""
    cand_indexes: List[List[int]] = []
    for i, token in enumerate(tokens):
        if token in (CLS_TOKEN, SEP_TOKEN):
            continue
        if do_whole_word_mask and cand_indexes and (token.startswith("##") or token.__class__ is WordContinuation):
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
    stats.candidates += sum(len(c) for c in cand_indexes)
    rng.shuffle(cand_indexes)
    output = list(tokens)
    # Python 3's round() (half to even) as the reference runs it.
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    masked: List[Tuple[int, str]] = []
    covered = set()
    for index_set in cand_indexes:
        if len(masked) >= num_to_predict:
            break
        # A whole word that would overflow the budget is skipped, not split.
        if len(masked) + len(index_set) > num_to_predict:
            continue
        if any(i in covered for i in index_set):
            continue
        for index in index_set:
            covered.add(index)
            outcome = masking_rule.choose(rng.random)
            if outcome == "mask":
                replacement = MASK_TOKEN
                stats.replaced_by_mask += 1
            elif outcome == "keep":
                replacement = tokens[index]
                stats.kept += 1
            else:
                replacement = vocab_words[rng.randint(0, len(vocab_words) - 1)]
                stats.replaced_by_random += 1
            output[index] = replacement
            masked.append((index, tokens[index]))
    masked.sort(key=lambda x: x[0])
    stats.masked += len(masked)
    return output, [p for p, _ in masked], [label for _, label in masked]


def create_instances_from_document(all_documents: Sequence[Sequence[Tokens]], document_index: int,
                                   max_seq_length: int, short_seq_prob: float, masked_lm_prob: float,
                                   max_predictions_per_seq: int, vocab_words: Sequence[str],
                                   rng: random.Random, do_whole_word_mask: bool,
                                   stats: MaskStats) -> List[TrainingInstance]:
    """The instances of one document (one pass of one dupe)."""
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    instances: List[TrainingInstance] = []
    chunk: List[Tokens] = []
    chunk_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        chunk.append(segment)
        chunk_length += len(segment)
        if i == len(document) - 1 or chunk_length >= target_seq_length:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                tokens_a: Tokens = [t for s in chunk[:a_end] for t in s]
                tokens_b: Tokens = []
                if len(chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # Put the chunk's unused sentences back for the next instance.
                    i -= len(chunk) - a_end
                else:
                    is_random_next = False
                    tokens_b = [t for s in chunk[a_end:] for t in s]
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if tokens_a and tokens_b:
                    tokens = [CLS_TOKEN] + tokens_a + [SEP_TOKEN] + tokens_b + [SEP_TOKEN]
                    segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                    tokens, positions, labels = create_masked_lm_predictions(
                        tokens, masked_lm_prob, max_predictions_per_seq, vocab_words, rng,
                        do_whole_word_mask, stats)
                    instances.append(TrainingInstance(tokens, segment_ids, is_random_next, positions, labels))
                    stats.instances += 1
                    stats.random_next += int(is_random_next)
            chunk = []
            chunk_length = 0
        i += 1
    return instances


def create_training_instances(all_documents: List[List[Tokens]], vocab_words: Sequence[str], *,
                              max_seq_length: int, dupe_factor: int, short_seq_prob: float,
                              masked_lm_prob: float, max_predictions_per_seq: int, rng: random.Random,
                              do_whole_word_mask: bool, stats: MaskStats) -> List[TrainingInstance]:
    """All instances of a corpus, as the reference makes them: shuffle the documents, `dupe_factor`
    passes over them, shuffle the instances. `all_documents` must hold no empty document."""
    rng.shuffle(all_documents)
    instances: List[TrainingInstance] = []
    for _ in range(dupe_factor):
        for document_index in range(len(all_documents)):
            instances.extend(create_instances_from_document(
                all_documents, document_index, max_seq_length, short_seq_prob, masked_lm_prob,
                max_predictions_per_seq, vocab_words, rng, do_whole_word_mask, stats))
    rng.shuffle(instances)
    return instances
