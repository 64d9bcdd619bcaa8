"""The fast mode's instances one by one, against the text they came from (issue 43, item 2).

`test_fast_mode.py` compares the fast (default) mode of `create_pretraining_data` with the
reference algorithm by averages. Here every record the fast mode writes for the embedded
offline corpus is parsed back with TensorFlow's `tf.train.Example` (not our reader), its masked
positions are restored from `masked_lm_ids`, and its two segments are looked up in the source
documents, read from the written text files here and tokenized by the Google-exact
`FullTokenizer` (the fast mode tokenizes with `FastTokenizer`). For every instance:

- A is a contiguous run of one document's tokens; so is B: "is next" (label 0) in the same
  document after A, random next (label 1) in another document of the same input file (the fast
  mode's shard);
- what lies between them, and sentence edges cut off, is what truncation can remove
  (`_truncation_allows`, `_check_next`, `_check_random`);
- masking: the input differs from the source only at the recorded positions, never [CLS]/[SEP];
  there it is [MASK], the token itself or another vocabulary id, the token recorded in
  masked_lm_ids; the count follows `max_predictions_per_seq` and `masked_lm_prob`; masked
  positions are whole words (whole-word masking) or single tokens;
- over all masked positions, the 80/10/10 shares within four binomial standard deviations.
"""

import math
import random
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from data_pipeline import create_pretraining_data as cpd, tokenization, train_vocab  # noqa: E402
from data_pipeline.pretraining_data import corpora, instances  # noqa: E402

SEQ, PREDS, PROB = 64, 10, 0.15
MAX_NUM_TOKENS = SEQ - 3  # the length budget of A + B


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The embedded corpus's pydoc topics (77 documents, ~2,000 sentences) in two input files
    (two shards), a 2,000-entry WordPiece vocabulary trained on them (many "##" pieces), and the
    documents as the reference reads and tokenizes them."""
    root = tmp_path_factory.mktemp("corpus")
    files = corpora.write_embedded_corpus(str(root / "text"), num_shards=2, include_stdlib=False)
    vocab_file = str(root / "vocab.txt")
    train_vocab.train_vocab(files, 2000, vocab_file)
    tok = tokenization.FullTokenizer(vocab_file, do_lower_case=True)
    docs = []  # (file index, token ids as a str of chr(id) for searching, sentence boundaries)
    for shard, path in enumerate(files):
        for sentences in _google_format_documents(Path(path).read_text(encoding="utf-8")):
            ids, bounds = [], [0]
            for s in sentences:
                pieces = tok.convert_tokens_to_ids(tok.tokenize(s))
                if pieces:  # the reference drops a sentence without tokens
                    ids += pieces
                    bounds.append(len(ids))
            if ids:  # ... and a document without sentences
                docs.append((shard, "".join(map(chr, ids)), np.array(bounds)))
    return files, vocab_file, tok, docs


def _google_format_documents(text):
    """google-research/bert's reading: stripped lines, a blank line ends a document."""
    doc = []
    for line in text.split("\n"):
        if line.strip():
            doc.append(line.strip())
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


def _truncation_allows(a_trimmed, b_trimmed, len_a, len_b, max_num_tokens=MAX_NUM_TOKENS):
    """Whether `truncate_seq_pair` can leave (len_a, len_b) having trimmed the sides flagged.

    The loop trims A while it is strictly longer, else B, until A + B fits the budget; so a pair
    it trimmed fills the budget exactly, and: only A trimmed -> A was longer at its last trim
    (len_a + 1 > len_b); only B -> B was at least as long at its last (len_b + 1 >= len_a); both
    -> they met and then alternated (len_a - len_b is 0 or 1). Checked against the loop in
    `test_truncation_rule_is_the_reference_loop`.
    """
    if not (a_trimmed or b_trimmed):
        return len_a + len_b <= max_num_tokens
    if len_a + len_b != max_num_tokens:
        return False
    if a_trimmed and b_trimmed:
        return len_a - len_b in (0, 1)
    return len_a >= len_b if a_trimmed else len_b >= len_a - 1


def test_truncation_rule_is_the_reference_loop():
    """`_truncation_allows` accepts exactly the outcomes of the reference's loop (lengths up to
    twice the budget reach every outcome: a side trimmed at all is trimmed to about half)."""
    for budget in range(2, 12):
        seen = set()
        for a in range(1, 2 * budget + 3):
            for b in range(1, 2 * budget + 3):
                x, y = list(range(a)), list(range(b))
                instances.truncate_seq_pair(x, y, budget, random.Random(0))
                seen.add((len(x) < a, len(y) < b, len(x), len(y)))
        allowed = {(ta, tb, a, b) for ta in (False, True) for tb in (False, True)
                   for a in range(1, budget) for b in range(1, budget) if _truncation_allows(ta, tb, a, b, budget)}
        assert seen == allowed, budget


# ---------------------------------------------------------------------------------------------
# Where a segment can have come from
# ---------------------------------------------------------------------------------------------


def _occurrences(doc_text, segment):
    """Start offsets of `segment` (a str of chr(id)) in a document's tokens."""
    out, at = [], doc_text.find(segment)
    while at >= 0:
        out.append(at)
        at = doc_text.find(segment, at + 1)
    return out


def _starts(bounds, x0):
    """Where a segment now starting at token x0 may have started before truncation (sentence
    starts at or before x0): the nearest, and the one before it if the nearest is x0 itself (so
    that a segment starting on a sentence may still have been front-trimmed). Farther ones need
    not be tried: they only make the untrimmed segment longer, which no check below prefers."""
    k = np.searchsorted(bounds, x0, side="right") - 1
    return [int(bounds[k])] + ([int(bounds[k - 1])] if bounds[k] == x0 and k > 0 else [])


def _ends(bounds, x1):
    """Where a segment now ending at token x1 may have ended before truncation (as `_starts`)."""
    k = np.searchsorted(bounds, x1, side="left")
    return [int(bounds[k])] + ([int(bounds[k + 1])] if bounds[k] == x1 and k + 1 < len(bounds) else [])


def _last_sentence_start(bounds, end):
    return int(bounds[np.searchsorted(bounds, end, side="left") - 1])


def _check_next(doc, a0, a1, b0, b1):
    """An "is next" pair: before truncation A was sentences [p, q) and B [q, r) of one chunk,
    p <= a0 < a1 <= q <= b0 < b1 <= r; truncation cut q - a1 tokens off A's back and b0 - q off
    B's front (the only tokens between them), a0 - p off A's front, r - b1 off B's back. The
    chunk stopped at its first sentence reaching the target length (<= max_seq_length - 3), so
    the sentences before its last are shorter than the budget: start(last) - p < budget."""
    bounds = doc[2]
    qs = bounds[(bounds >= a1) & (bounds <= b0)]
    for q in map(int, qs):
        for p in _starts(bounds, a0):
            for r in _ends(bounds, b1):
                if (_last_sentence_start(bounds, r) - p < MAX_NUM_TOKENS
                        and _truncation_allows((p, q) != (a0, a1), (q, r) != (b0, b1), a1 - a0, b1 - b0)):
                    return True
    return False


def _check_random(doc_a, a0, a1, doc_b, b0, b1):
    """A random-next pair: A was sentences [p, q) of its chunk, all of a one-sentence chunk or
    else fewer than the chunk's, so under the budget; B was sentences [p2, r) of another
    document, read until A + B reached the target, so B before its last sentence is under
    `budget - len(A)`."""
    for p in _starts(doc_a[2], a0):
        for q in _ends(doc_a[2], a1):
            one_a = _last_sentence_start(doc_a[2], q) == p
            if not (one_a or q - p < MAX_NUM_TOKENS):
                continue
            for p2 in _starts(doc_b[2], b0):
                for r in _ends(doc_b[2], b1):
                    last = _last_sentence_start(doc_b[2], r)
                    if ((last == p2 or (q - p) + (last - p2) < MAX_NUM_TOKENS)
                            and _truncation_allows((p, q) != (a0, a1), (p2, r) != (b0, b1), a1 - a0, b1 - b0)):
                        return True
    return False


def _find_source(docs, seg_a, seg_b, is_random):
    """Whether some placement of A and B in the documents is one the fast mode can make."""
    la, lb = len(seg_a), len(seg_b)
    b_at = [_occurrences(doc[1], seg_b) for doc in docs]
    for i, doc_a in enumerate(docs):
        for a0 in _occurrences(doc_a[1], seg_a):
            if not is_random:
                if any(_check_next(doc_a, a0, a0 + la, b0, b0 + lb) for b0 in b_at[i] if b0 >= a0 + la):
                    return True
                continue
            for j, doc_b in enumerate(docs):
                if j != i and doc_b[0] == doc_a[0] and any(
                        _check_random(doc_a, a0, a0 + la, doc_b, b0, b0 + lb) for b0 in b_at[j]):
                    return True
    return False


# ---------------------------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------------------------


def _parse(path):
    """The records as dicts of numpy arrays, parsed by TensorFlow's own protobuf."""
    out = []
    for raw in tf.data.TFRecordDataset(str(path)):
        feature = tf.train.Example.FromString(raw.numpy()).features.feature
        out.append({k: np.array(f.float_list.value if k == "masked_lm_weights" else f.int64_list.value)
                    for k, f in feature.items()})
    return out


@pytest.mark.parametrize("wwm", [False, True])
def test_every_fast_instance_is_its_source_text_paired_truncated_and_masked_by_the_rules(tmp_path, corpus, wwm):
    files, vocab_file, tok, docs = corpus
    cpd.create_pretraining_data(files, str(tmp_path / "out"), vocab_file, do_whole_word_mask=wwm,
                                max_seq_length=SEQ, max_predictions_per_seq=PREDS, masked_lm_prob=PROB,
                                dupe_factor=1, random_seed=43, short_seq_prob=0.1)
    records = _parse(tmp_path / "out" / "part-00000-of-00001.tfrecord")
    cls, sep, mask = (tok.vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]"))
    vocab_size = len(tok.vocab)
    is_sub = np.zeros(vocab_size, bool)  # by id
    is_sub[[i for t, i in tok.vocab.items() if t.startswith("##")]] = True
    shares = np.zeros(3, np.int64)  # masked positions: [MASK], the token itself, another token
    kinds = np.zeros(5, np.int64)  # is next, random next, filling the budget, not, masked words of >1 piece
    for n_rec, r in enumerate(records):
        where = f"record {n_rec}"
        ids, seg, positions, labels = r["input_ids"], r["segment_ids"], r["masked_lm_positions"], r["masked_lm_ids"]
        assert ids.shape == (SEQ,) and positions.shape == (PREDS,), where
        n = int(r["input_mask"].sum())
        np.testing.assert_array_equal(r["input_mask"], np.arange(SEQ) < n, err_msg=where)
        assert (ids[n:] == 0).all(), where
        # [CLS] A [SEP] B [SEP]: segment ids mark B (a random word may be [SEP]: no search for it).
        la = int(np.argmax(seg)) - 2
        lb = n - la - 3
        assert la >= 1 and lb >= 1, where
        np.testing.assert_array_equal(seg, (np.arange(SEQ) >= la + 2) & (np.arange(SEQ) < n), err_msg=where)
        assert (ids[0], ids[la + 1], ids[n - 1]) == (cls, sep, sep), where

        # Masked positions: increasing, inside the sequence, never [CLS]/[SEP]; padding zero.
        k = int(r["masked_lm_weights"].sum())
        np.testing.assert_array_equal(r["masked_lm_weights"], np.arange(PREDS) < k, err_msg=where)
        pos = positions[:k]
        assert (positions[k:] == 0).all() and (labels[k:] == 0).all(), where
        assert (np.diff(pos) > 0).all() and pos.min() >= 1 and pos.max() <= n - 2 and la + 1 not in pos, where
        source = ids.copy()
        source[pos] = labels[:k]  # the text before masking; elsewhere the input is the text
        got = ids[pos]
        assert ((got >= 0) & (got < vocab_size)).all(), where  # [MASK], the token or a vocabulary word
        shares += [np.sum(got == mask), np.sum(got == labels[:k]), np.sum((got != mask) & (got != labels[:k]))]

        # How many: min(max_predictions_per_seq, max(1, round(length * masked_lm_prob))) (round half
        # to even, as Python 3 runs the reference), of whole words (single tokens without wwm) in a
        # random order, a word taken if it fits: so every word left unmasked is longer than the
        # budget left. Words as the reference forms them: every token but [CLS]/[SEP], a "##" piece
        # joined to the candidate before it (B's first to A's last; A's first starts a word).
        budget = min(PREDS, max(1, round(n * PROB)))
        words = []
        for i in range(1, n - 1):
            if i == la + 1:
                continue
            if wwm and words and is_sub[source[i]]:
                words[-1].append(i)
            else:
                words.append([i])
        masked = set(pos.tolist())
        assert k <= budget, where
        for w in words:
            hit = [i in masked for i in w]
            assert all(hit) or not any(hit), (where, "a word masked in part", w, sorted(masked))
            assert any(hit) or len(w) > budget - k, (where, "a word that fits left unmasked", w, budget, k)
            kinds[4] += all(hit) and len(w) > 1
        if not wwm:
            assert k == min(budget, n - 3), where

        # Where the text came from (labels restored), and how A and B were paired and truncated.
        random_next = bool(r["next_sentence_labels"][0])
        seg_a = "".join(map(chr, source[1:la + 1]))
        seg_b = "".join(map(chr, source[la + 2:n - 1]))
        found = _find_source(docs, seg_a, seg_b, random_next)
        assert found, (where, f"no source for this {'random-next' if random_next else 'is-next'} pair",
                       " ".join(tok.convert_ids_to_tokens(source[:n].tolist())))
        kinds[int(random_next)] += 1
        kinds[2 if la + lb == MAX_NUM_TOKENS else 3] += 1

    # Every case met (Python 3.11's topics: 1,045 instances, 424 is next, 621 random, 892 filling the budget, 424 masked
    # words of several pieces with wwm): both labels, pairs truncation may have cut and pairs
    # it cannot have (shorter than the budget), whole words of several pieces.
    assert len(records) > 600 and min(kinds[:4]) > 100, kinds
    assert (kinds[4] > 200) == wwm, kinds
    # 80/10/10. A random word is drawn from the whole vocabulary list (V = 2,000 ids), so it is
    # [MASK] or the token itself with 1/V each. ~10,000 masked positions per run: binomial sds
    # 0.004 (0.8) and 0.003 (0.1); we allow 4 of them (a chance of ~6e-5 per share to fail).
    total = int(shares.sum())
    assert total > 5000, total
    for got, p in zip(shares, (0.8 + 0.1 / vocab_size, 0.1 + 0.1 / vocab_size, 0.1 * (1 - 2 / vocab_size))):
        assert abs(got / total - p) < 4 * math.sqrt(p * (1 - p) / total), (shares, total)
