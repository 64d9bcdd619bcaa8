"""A HuggingFace `tokenizer.json` (BPE, WordPiece, Unigram: ModernBERT's, RoBERTa's, ...) behind the tokenizer API.

`HFTokenizer` wraps `tokenizers.Tokenizer` (the Rust library transformers' fast tokenizers run on)
with the interface the instance builders use for `FastTokenizer`: `tokenize`, `encode`,
`encode_batch`, `convert_tokens_to_ids`, `convert_ids_to_tokens`, `vocab`, `inv_vocab`. Text is
encoded without special tokens (the instance builders add `[CLS]`/`[SEP]`), so the ids are those of
transformers' `PreTrainedTokenizerFast(tokenizer_file=...)` with `add_special_tokens=False`; the
file's own normalizer and pre-tokenizer decide casing and word splits (there is no `do_lower_case`).

The special tokens are read from the file, not assumed: the classification and separator tokens
from its post-processor (`TemplateProcessing`'s single-sequence template, `BertProcessing`,
`RobertaProcessing`), else from its special added tokens by name (`[CLS]`/`<s>`, `[SEP]`/`</s>`);
the mask, padding and unknown tokens from its special added tokens by name (`[MASK]`/`<mask>`,
`[PAD]`/`<pad>`, `[UNK]`/`<unk>`; the padding and unknown ones also from the file's `padding` and
its model's `unk_token`). A file without a mask, classification or separator token is refused,
naming the file and the missing token: masked-LM data cannot be made without them.

Whole words (for `--do_whole_word_mask`): BPE has no `##` continuation marks, so a word is what the
file's pre-tokenizer makes one (`Encoding.word_ids`): ByteLevel's words (" the", ",", "'s") for
ModernBERT and GPT-2 style files, BertPreTokenizer's for WordPiece files (Google's words exactly).
`word_continuations` marks each token that continues the word before it.

`tokenizers` is an optional dependency (`pip install -e '.[hf]'`), imported when a tokenizer is
built. Nothing here imports jax or bert_jax.
"""

from __future__ import annotations

import collections
import json
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from data_pipeline import storage
from data_pipeline.tokenization import convert_by_vocab, convert_to_unicode

# The names a special token goes by in the files of the common model families, BERT's first.
ROLE_NAMES: Dict[str, Tuple[str, ...]] = {
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>"),
}
REQUIRED_ROLES = ("cls", "sep", "mask")  # what pretraining instances are made of


def _import_tokenizers(path: str):
    try:
        import tokenizers  # Optional dependency: only a tokenizer.json needs it.
    except ImportError as e:
        raise ImportError(f"--tokenizer_json={path} needs the HuggingFace tokenizers library: "
                          "pip install -e '.[hf]' (or pip install 'tokenizers>=0.20')") from e
    return tokenizers


def _post_processor_cls_sep(processor: Optional[dict]) -> Tuple[Optional[str], Optional[str]]:
    """(cls, sep) token of a tokenizer.json's post-processor, where it names them."""
    if not isinstance(processor, dict):
        return None, None
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return processor["cls"][0], processor["sep"][0]
    if kind == "TemplateProcessing":
        # single: [{"SpecialToken": {"id": "[CLS]"}}, {"Sequence": {"id": "A"}}, {"SpecialToken": ...}]
        pieces = processor.get("single") or []
        seq = [i for i, p in enumerate(pieces) if "Sequence" in p]
        if not seq:
            return None, None
        before = [p["SpecialToken"]["id"] for p in pieces[:seq[0]] if "SpecialToken" in p]
        after = [p["SpecialToken"]["id"] for p in pieces[seq[0] + 1:] if "SpecialToken" in p]
        return (before[0] if before else None), (after[-1] if after else None)
    if kind == "Sequence":
        found = [_post_processor_cls_sep(p) for p in processor.get("processors") or []]
        cls = next((c for c, _ in found if c), None)
        sep = next((s for _, s in found if s), None)
        return cls, sep
    return None, None


def special_tokens_of(spec: dict, path: str) -> Dict[str, Optional[str]]:
    """The role -> token map (cls, sep, mask, pad, unk) of a parsed tokenizer.json `spec`.

    Raises:
      ValueError: naming `path` and the role, when the file has no cls, sep or mask token.
    """
    specials = [t["content"] for t in spec.get("added_tokens") or [] if t.get("special")]
    roles: Dict[str, Optional[str]] = {}
    for role, names in ROLE_NAMES.items():
        roles[role] = next((n for n in names if n in specials), None)
    cls, sep = _post_processor_cls_sep(spec.get("post_processor"))
    roles["cls"] = cls or roles["cls"]
    roles["sep"] = sep or roles["sep"]
    padding = spec.get("padding")
    if isinstance(padding, dict) and padding.get("pad_token"):
        roles["pad"] = padding["pad_token"]
    model = spec.get("model") or {}
    if not roles["unk"] and model.get("unk_token"):
        roles["unk"] = model["unk_token"]
    missing = [r for r in REQUIRED_ROLES if not roles[r]]
    if missing:
        wanted = "; ".join(f"{r}: one of {', '.join(ROLE_NAMES[r])}" for r in missing)
        raise ValueError(f"{path}: no {', '.join(missing)} token (looked for special added tokens named {wanted}"
                         f"{' and the post-processor' if 'cls' in missing or 'sep' in missing else ''}; "
                         f"special tokens it has: {specials or 'none'}). Pretraining records need a "
                         "classification, a separator and a mask token: add them to the file "
                         "(tokenizer.add_special_tokens([...]) then save)")
    return roles


class HFTokenizer:
    """A `tokenizer.json` behind the `FastTokenizer` API (see the module docstring).

    Attributes:
      path: the file.
      vocab: token -> id in id order, added tokens included.
      inv_vocab: id -> token.
      cls_token, sep_token, mask_token, pad_token, unk_token: the file's special tokens (pad and unk
        None where it has none).
      vocab_size: the largest id + 1 (what the model's embedding table must hold).
    """

    def __init__(self, path: str):
        tokenizers = _import_tokenizers(path)
        text = storage.read_text(path)  # local or gs://, through storage
        try:
            spec = json.loads(text)
            self._tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # json.JSONDecodeError, or the library's own parse error
            raise ValueError(f"{path}: not a HuggingFace tokenizer.json ({type(e).__name__}: {e})") from e
        self.path = path
        roles = special_tokens_of(spec, path)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab = collections.OrderedDict(sorted(vocab.items(), key=lambda kv: kv[1]))
        self.inv_vocab = {index: token for token, index in self.vocab.items()}
        for role, token in roles.items():
            if token is not None and token not in self.vocab:
                raise ValueError(f"{path}: its {role} token {token!r} has no id in the vocabulary")
            setattr(self, f"{role}_token", token)
        self.vocab_size = max(self.vocab.values()) + 1 if self.vocab else 0

    def special_ids(self) -> dict:
        """The ids dynamic masking and the trainer's checks take (`input.masking.SpecialIds`'s fields)."""
        ids = {f"{role}_id": self.vocab[getattr(self, f"{role}_token")] for role in REQUIRED_ROLES}
        ids["pad_id"] = self.vocab[self.pad_token] if self.pad_token else None
        ids["vocab_size"] = self.vocab_size
        return ids

    def _encode(self, texts: Sequence[str]):
        return self._tokenizer.encode_batch([convert_to_unicode(t) for t in texts], add_special_tokens=False)

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """The tokens of `text` (no special tokens added); `[]` for empty text."""
        return self._tokenizer.encode(convert_to_unicode(text), add_special_tokens=False).tokens

    def encode(self, text: Union[str, bytes]) -> List[int]:
        return self._tokenizer.encode(convert_to_unicode(text), add_special_tokens=False).ids

    def tokenize_batch(self, texts: Iterable[Union[str, bytes]]) -> List[List[str]]:
        return [e.tokens for e in self._encode(list(texts))]

    def encode_batch(self, texts: Iterable[Union[str, bytes]]) -> List[List[int]]:
        return [e.ids for e in self._encode(list(texts))]

    def word_continuations(self, texts: Sequence[str], encoded: Optional[Sequence[Sequence[int]]] = None
                           ) -> List[List[bool]]:
        """Per text, one bool per token: True where the token continues the pre-tokenizer word of the
        token before it (BPE's equivalent of a `##` piece). A token of no word (an added token found
        in the text) starts its own.

        Example (ByteLevel BPE): "unaffable cats" -> ["un", "aff", "able", "Ġcats"] ->
        [False, True, True, False].

        `encoded` (the ids `encode_batch` gave for `texts`), given, is checked against the tokens
        these bits are for (`fast_instances.tokenize_shard`'s `word_continuations` callback).
        """
        out = []
        for index, e in enumerate(self._encode(texts)):
            words = e.word_ids
            if encoded is not None and list(encoded[index]) != e.ids:
                raise ValueError(f"{self.path}: text {index} encodes differently on a second pass")
            out.append([w is not None and i > 0 and words[i - 1] == w for i, w in enumerate(words)])
        return out

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        return convert_by_vocab(self.vocab, tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return convert_by_vocab(self.inv_vocab, ids)
