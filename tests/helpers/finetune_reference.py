"""A fine-tuned model's predictions checked outside the loop: its saved parameters applied to texts
featurized here (`Reference`), and predicted labels against the argmax of those logits."""

import jax
import numpy as np

from bert_jax import convert
from bert_jax.finetune import heads


class Reference:
    """A run's saved parameters (`which`: "best" or "last", through `convert.load_finetuned`)
    applied to texts featurized here, not by the task: Google's FullTokenizer (the loop uses
    FastTokenizer), `[CLS] a [SEP] b [SEP]` truncated as run_classifier.py's _truncate_seq_pair,
    a word's tag read at its first piece (data_pipeline/tasks/ner.py's documented convention),
    one unsharded `BertForTask.apply` (the loop's is jitted over the 8-device mesh)."""

    ROWS = 16  # inputs are padded to a multiple of this: one compile per head kind and width

    def __init__(self, work, which, vocab, max_seq_length=16):
        from data_pipeline import tokenization
        p = convert.load_finetuned(str(work), which)
        assert p.task["max_seq_length"] == max_seq_length
        self.task, self.max_len = p.task, max_seq_length
        self.model = heads.BertForTask(p.config, p.task["head"], p.task["num_outputs"])
        self.params = convert.model_params(p)
        self.tokenizer = tokenization.FullTokenizer(vocab, do_lower_case=True)

    def _logits(self, tokens):
        """Logits of each token list `[CLS] ... [SEP] (... [SEP])` (segment 1 after the first [SEP])."""
        n = len(tokens)
        ids, mask, segments = (np.zeros((-(-n // self.ROWS) * self.ROWS, self.max_len), np.int32) for _ in range(3))
        for i, row in enumerate(tokens):
            assert len(row) <= self.max_len, row
            ids[i, :len(row)] = [self.tokenizer.vocab[t] for t in row]
            mask[i, :len(row)] = 1
            first_sep = row.index("[SEP]")
            segments[i, first_sep + 1:len(row)] = 1
        out = jax.jit(self.model.apply)({"params": self.params}, ids, mask, segments)
        return np.asarray(out["logits"])[:n]

    def sentence_logits(self, pairs):
        """[examples(, classes)] for (text_a, text_b or None) pairs."""
        rows = []
        for a, b in pairs:
            a = self.tokenizer.tokenize(a)
            b = self.tokenizer.tokenize(b) if b is not None else None
            if b is None:
                a = a[:self.max_len - 2]
            else:
                while len(a) + len(b) > self.max_len - 3:  # _truncate_seq_pair: the longer one loses its last
                    (a if len(a) > len(b) else b).pop()
            rows.append(["[CLS]"] + a + ["[SEP]"] + (b + ["[SEP]"] if b is not None else []))
        return self._logits(rows)

    def word_logits(self, sentences):
        """[words, tags] per sentence (a list of words): the logits at each word's first piece."""
        rows, firsts = [], []
        for words in sentences:
            pieces = [self.tokenizer.tokenize(w) for w in words]
            assert all(pieces) and sum(map(len, pieces)) <= self.max_len - 2, words  # one row each
            firsts.append(1 + np.cumsum([0] + [len(p) for p in pieces[:-1]]))
            rows.append(["[CLS]"] + [t for p in pieces for t in p] + ["[SEP]"])
        logits = self._logits(rows)
        return [logits[i, first] for i, first in enumerate(firsts)]


def assert_argmax(predicted, logits, labels, what, tie=1e-4):
    """Each predicted label is `labels[argmax]` of its row of logits; where the top two are within
    `tie` (two compilations may round them apart) either of those two is accepted."""
    logits = np.asarray(logits).reshape(-1, len(labels))
    predicted = np.asarray(predicted).reshape(-1)
    assert len(predicted) == len(logits), (what, len(predicted), len(logits))
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    for i, (p, row, (first, second)) in enumerate(zip(predicted, logits, top2)):
        allowed = {labels[first]} | ({labels[second]} if row[first] - row[second] < tie else set())
        assert p in allowed, (what, i, p, labels[first], row.tolist())
