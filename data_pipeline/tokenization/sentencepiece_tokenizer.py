"""A trained SentencePiece model behind the tokenizer API, and `create_tokenizer` choosing by file.

`SentencePieceTokenizer` serves users who want an ALBERT/multilingual style tokenizer instead of a
WordPiece `vocab.txt` (`train_vocab --spm_model_prefix` trains one); `create_tokenizer` returns it
for a `.model` file and `tokenization.FullTokenizer` for a vocab.txt. Nothing here imports jax or
bert_jax.
"""

from __future__ import annotations

import collections
import warnings
from typing import Iterable, List, Optional, Union

from data_pipeline import storage
from data_pipeline.tokenization import FullTokenizer, _split_special, convert_by_vocab, convert_to_unicode
from data_pipeline.tokenization.fast import FastBasicTokenizer


class SentencePieceTokenizer:
    """A trained SentencePiece `.model` behind the `FullTokenizer` API (ALBERT style).

    The model's own normalizer runs; `do_lower_case` lowercases first (as ALBERT's uncased
    models expect). For a model saved by `train_vocab --spm_model_prefix`, which was trained on
    `BasicTokenizer` output, pass `basic_tokenize=True` and the same `do_lower_case`.
    Special tokens the model defines as user symbols ("[CLS]", "[SEP]", "[MASK]") are kept
    whole wherever they appear in raw text; that is SentencePiece's own behaviour.

    Attributes:
      vocab: piece -> id, in id order.
      inv_vocab: id -> piece.
    """

    def __init__(self, model_file: str, do_lower_case: bool = False,
                 basic_tokenize: bool = False):
        import sentencepiece  # Optional dependency: only this class needs it.

        # The model's bytes are read through storage (local or gs://), not by the C library.
        self._model = sentencepiece.SentencePieceProcessor(  # storage: local (bytes from storage)
            model_proto=storage.read_bytes(model_file))
        self.do_lower_case = do_lower_case
        self._basic = FastBasicTokenizer(do_lower_case, True) if basic_tokenize else None
        self.vocab = collections.OrderedDict(
            (self._model.id_to_piece(i), i) for i in range(self._model.get_piece_size()))
        self.inv_vocab = {index: piece for piece, index in self.vocab.items()}

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Pieces of `text` ("\u2581" marks a word start); `[]` for empty text."""
        text = convert_to_unicode(text)
        if self._basic is not None:
            text = " ".join(self._basic.tokenize(text))
        elif self.do_lower_case:
            # Around the special tokens: "[MASK]".lower() is no user symbol and would be split.
            text = "".join(segment if special else segment.lower()
                           for segment, special in _split_special(text, True))
        return self._model.encode(text, out_type=str)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        """Ids of pieces; a piece the model lacks maps to its unknown id."""
        return [self._model.piece_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return convert_by_vocab(self.inv_vocab, ids)


SPM_SIDECAR_SUFFIX = ".tokenizer.json"  # train_vocab writes PREFIX.tokenizer.json beside PREFIX.model


def create_tokenizer(vocab_file: str, do_lower_case: bool = True,
                     keep_special_tokens: bool = False, basic_tokenize: Optional[bool] = None):
    """`SentencePieceTokenizer` for a `.model` file, `FullTokenizer` for a vocab.txt.

    For a `.model`, `basic_tokenize=None` reads `PREFIX.tokenizer.json` when it exists (written by
    `train_vocab --spm_model_prefix=PREFIX`, whose model learned from `BasicTokenizer` output):
    its `basic_tokenize` and `do_lower_case` are the ones the model was trained with, and win over
    `do_lower_case` here (with a warning when they differ). Without that file the model's own
    normalizer runs on the raw text (an ALBERT-style model).
    """
    if vocab_file.endswith(".model"):
        sidecar = vocab_file[: -len(".model")] + SPM_SIDECAR_SUFFIX
        if basic_tokenize is None and storage.exists(sidecar):
            import json
            trained = json.loads(storage.read_text(sidecar))
            basic_tokenize = bool(trained.get("basic_tokenize", False))
            if "do_lower_case" in trained and bool(trained["do_lower_case"]) != bool(do_lower_case):
                warnings.warn(f"{vocab_file} was trained with do_lower_case={trained['do_lower_case']} "
                              f"({sidecar}); using that, not do_lower_case={do_lower_case}")
                do_lower_case = bool(trained["do_lower_case"])
        return SentencePieceTokenizer(vocab_file, do_lower_case=do_lower_case,
                                      basic_tokenize=bool(basic_tokenize))
    return FullTokenizer(vocab_file, do_lower_case, keep_special_tokens)
