"""CLI: contextual token features as JSON lines, as google-research/bert's `extract_features.py`.

    python -m bert_jax.extract_features --input_file=input.txt --output_file=features.jsonl \\
        --init_checkpoint=uncased_L-12_H-768_A-12 --layers=-1,-2,-3,-4 --max_seq_length=128 \\
        --batch_size=32 [--vocab_file=... --do_lower_case=true] [--combine=concat_last_four]
        [--sentence_pooling=mean]

Input: one example per line; `text_a ||| text_b` makes a pair. Every line is an example, a blank
one included, so `linex_index` is the 0-based line number. Bytes that are not UTF-8 are replaced
(U+FFFD) and counted.

Output: one JSON object per line, Google's layout and rounding (6 decimals)::

    {"linex_index": 0, "features": [{"token": "[CLS]", "layers": [{"index": -1, "values": [...]},
                                                                  ...]}, ...]}

`--layers` counts like Google's `get_all_encoder_layers()`: 0 is the first Transformer layer, -1
the last (the embedding output is not a layer; `--combine=embeddings` gives it).

Ours, beyond Google's flags:

* `--init_checkpoint` in any format `bert_jax.convert` reads (Google TF1, HuggingFace, bert_jax);
  `--vocab_file`, `--do_lower_case` and `--bert_config_file` default to the checkpoint's.
* `--combine`: the feature-based combinations of the paper's Table 7 (CoNLL-2003 NER without
  fine-tuning), added to each token as `"combined"`: `embeddings`, `second_to_last`, `last`,
  `sum_last_four`, `concat_last_four` (last layer first) and `sum_all` (every Transformer layer);
  the "four" are Transformer layers only (fewer in a model with fewer layers).
  The paper's "weighted" sums learn their weights in the downstream model; these are plain sums.
* `--sentence_pooling=mean|cls`: a per-line `"sentence_embedding"` from the combined features (or
  the last layer): the mean over the line's tokens, [CLS] and [SEP] included, or [CLS]'s vector.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Iterator, List, Optional, Sequence

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

COMBINATIONS = ("none", "embeddings", "second_to_last", "last", "sum_last_four", "concat_last_four", "sum_all")


@dataclasses.dataclass
class Example:
    index: int
    text_a: str
    text_b: Optional[str] = None


@dataclasses.dataclass
class Features:
    index: int
    tokens: List[str]
    input_ids: np.ndarray  # [max_seq_length] int32, zero padded
    input_mask: np.ndarray
    segment_ids: np.ndarray


def read_examples(path: str, stats: Optional[dict] = None) -> Iterator[Example]:
    """One example per line (Google's `read_examples`); `a ||| b` is a pair. `path`: local or gs://."""
    if not storage.isfile(path):
        raise FileNotFoundError(f"--input_file={path}: no such file")
    stats = stats if stats is not None else {}
    stats.setdefault("lines_with_bad_utf8", 0)
    with storage.open(path, "rb") as f:
        for i, raw in enumerate(f):
            line = raw.decode("utf-8", errors="replace")
            if "\ufffd" in line and b"\xef\xbf\xbd" not in raw:
                stats["lines_with_bad_utf8"] += 1
            line = line.strip()
            m = re.match(r"^(.*) \|\|\| (.*)$", line)
            yield Example(i, m.group(1), m.group(2)) if m else Example(i, line)


def count_lines(path: str) -> int:
    """Lines of `path` as `read_examples` sees them (a final line without a newline counts)."""
    count, last = 0, b"\n"
    with storage.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_length: int) -> None:
    """Pops from the longer list (ties: the second) until the pair fits."""
    while len(tokens_a) + len(tokens_b) > max_length:
        (tokens_a if len(tokens_a) > len(tokens_b) else tokens_b).pop()


def featurize(example: Example, tokenizer, max_seq_length: int) -> Features:
    """[CLS] a [SEP] (b [SEP]) with segment 0 then 1, truncated and zero padded (Google's rules)."""
    tokens_a = tokenizer.tokenize(example.text_a)
    tokens_b = tokenizer.tokenize(example.text_b) if example.text_b is not None else None
    if tokens_b is not None:
        truncate_seq_pair(tokens_a, tokens_b, max_seq_length - 3)
    else:
        tokens_a = tokens_a[: max_seq_length - 2]
    tokens = ["[CLS]"] + tokens_a + ["[SEP]"]
    segments = [0] * len(tokens)
    if tokens_b is not None:
        tokens += tokens_b + ["[SEP]"]
        segments += [1] * (len(tokens_b) + 1)
    ids = np.zeros(max_seq_length, np.int32)
    ids[: len(tokens)] = tokenizer.convert_tokens_to_ids(tokens)
    mask = np.zeros(max_seq_length, np.int32)
    mask[: len(tokens)] = 1
    seg = np.zeros(max_seq_length, np.int32)
    seg[: len(tokens)] = segments
    return Features(example.index, tokens, ids, mask, seg)


def hidden_state_index(layer: int, num_layers: int) -> int:
    """Google's layer index (0 = first Transformer layer, -1 = last) -> index into
    `BertOutput.hidden_states` (0 = embeddings)."""
    if not -num_layers <= layer < num_layers:
        raise ValueError(f"--layers: {layer} is out of range for a model with {num_layers} layers "
                         f"(use {-num_layers}..{num_layers - 1})")
    return layer + 1 if layer >= 0 else num_layers + 1 + layer


def combine(hidden, how: str):
    """`[layers + 1, ..., hidden]` states -> the paper's feature-based combination."""
    import jax.numpy as jnp

    n = hidden.shape[0] - 1
    if how == "embeddings":
        return hidden[0]
    if how == "last":
        return hidden[n]
    if how == "second_to_last":
        return hidden[n - 1]
    if how == "sum_last_four":
        return jnp.sum(hidden[max(1, n - 3):], axis=0)
    if how == "concat_last_four":
        return jnp.concatenate([hidden[i] for i in range(n, max(0, n - 4), -1)], axis=-1)
    if how == "sum_all":
        return jnp.sum(hidden[1:], axis=0)
    raise ValueError(f"--combine must be one of {COMBINATIONS}, got {how!r}")


class FeatureExtractor:
    """Runs a `BertModel` on fixed-shape batches (one compilation) and returns chosen layers."""

    def __init__(self, config, params: dict, layers: Sequence[int], combine_how: str = "none",
                 sentence_pooling: str = "none"):
        import jax
        from bert_jax.model.modeling import BertModel

        self.config = config
        self.layers = list(layers)
        self.combine_how = combine_how
        self.sentence_pooling = sentence_pooling
        indexes = [hidden_state_index(layer, config.num_hidden_layers) for layer in self.layers]
        if combine_how not in COMBINATIONS:
            raise ValueError(f"--combine must be one of {COMBINATIONS}, got {combine_how!r}")
        if sentence_pooling not in ("none", "mean", "cls"):
            raise ValueError(f"--sentence_pooling must be none, mean or cls, got {sentence_pooling!r}")
        model = BertModel(config.replace(fp8=False))  # FP8 is pretraining's: features in the model's dtype
        self.params = jax.device_put(params)

        def run(params, ids, mask, seg):
            out = model.apply({"params": params}, ids, mask, seg, output_hidden_states=True)
            hidden = out.hidden_states.astype("float32")  # [layers + 1, batch, length, hidden]
            result = {"layers": hidden[np.array(indexes, np.int32)] if indexes else None}
            base = combine(hidden, combine_how) if combine_how != "none" else hidden[-1]
            if combine_how != "none":
                result["combined"] = base  # [batch, length, features]
            if sentence_pooling == "mean":
                m = mask[..., None].astype(base.dtype)
                result["sentence"] = (base * m).sum(1) / m.sum(1)  # [batch, features]
            elif sentence_pooling == "cls":
                result["sentence"] = base[:, 0]
            return result

        self._run = jax.jit(run)

    def __call__(self, ids: np.ndarray, mask: np.ndarray, seg: np.ndarray) -> dict:
        import jax
        return jax.device_get(self._run(self.params, ids, mask, seg))


def _values(row: np.ndarray) -> list:
    # Google: round(float(x), 6) per value (Python's correctly rounded decimal).
    return [round(x, 6) for x in row.tolist()]


def to_json(feature: Features, out: dict, b: int, layers: Sequence[int]) -> str:
    record = {"linex_index": feature.index, "features": []}
    for i, token in enumerate(feature.tokens):
        entry = {"token": token}
        if layers:
            entry["layers"] = [{"index": layer, "values": _values(out["layers"][j, b, i])}
                               for j, layer in enumerate(layers)]
        if "combined" in out:
            entry["combined"] = _values(out["combined"][b, i])
        record["features"].append(entry)
    if "sentence" in out:
        record["sentence_embedding"] = _values(out["sentence"][b])
    return json.dumps(record)


def extract(examples, tokenizer, extractor: FeatureExtractor, max_seq_length: int, batch_size: int,
            progress: bool = False, total: Optional[int] = None) -> Iterator[str]:
    """JSON lines for `examples`, in order; the last batch is padded (one compiled shape).

    `progress` shows a tqdm bar, with an ETA when `total` (the number of examples) is given.
    """
    from tqdm import tqdm

    def batches():
        batch = []
        for ex in examples:
            batch.append(featurize(ex, tokenizer, max_seq_length))
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    bar = tqdm(total=total, unit=" lines", disable=not progress, dynamic_ncols=True)
    for batch in batches():
        n = len(batch)
        pad = batch_size - n
        stack = lambda field: np.stack([getattr(f, field) for f in batch]
                                       + [np.zeros(max_seq_length, np.int32)] * pad)
        out = extractor(stack("input_ids"), stack("input_mask"), stack("segment_ids"))
        for b, feature in enumerate(batch):
            yield to_json(feature, out, b, extractor.layers)
        bar.update(n)
    bar.close()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _define_flags():
    from absl import flags

    flags.DEFINE_string("input_file", None, "Text, one example per line ('a ||| b' for pairs).")
    flags.DEFINE_string("output_file", None, "JSON lines output.")
    flags.DEFINE_string("layers", "-1,-2,-3,-4", "Comma-separated layer indexes (-1 = last layer).")
    flags.DEFINE_string("bert_config_file", None, "Model config; default: the checkpoint's.")
    flags.DEFINE_integer("max_seq_length", 128, "Maximum sequence length (longer input is truncated).")
    flags.DEFINE_string("init_checkpoint", None, "Checkpoint: Google TF1, HuggingFace or bert_jax.")
    flags.DEFINE_string("vocab_file", None, "vocab.txt; default: the checkpoint's.")
    flags.DEFINE_enum("google_gelu", None, ["erf", "tanh"], "A Google checkpoint's \"gelu\": erf (default: "
                      "the 2018 releases) or tanh (trained with google-research/bert since 2019-02).")
    flags.DEFINE_bool("do_lower_case", True, "Lower-case the input (uncased models); default: the "
                      "checkpoint's casing when it records one, else true.")
    flags.DEFINE_integer("batch_size", 32, "Examples per batch.")
    flags.DEFINE_enum("combine", "none", list(COMBINATIONS), "Feature-based combination of layers "
                      "(paper Table 7), added per token as 'combined'.")
    flags.DEFINE_enum("sentence_pooling", "none", ["none", "mean", "cls"],
                      "Add a per-line 'sentence_embedding' (mean over tokens, or [CLS]).")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_enum("cpu_bf16", "auto", ["auto", "on", "off"], "On a CPU with --dtype=float32: matmuls with "
                      "bf16 inputs and float32 outputs, the rest float32 (auto: where the CPU has bf16 units "
                      "and a timed matmul is faster; bert_jax/training/cpu_bf16.py).")
    flags.mark_flags_as_required(["input_file", "output_file", "init_checkpoint"])


def main(argv):
    del argv
    from absl import flags, logging
    from bert_jax import convert
    from bert_jax.model.model_config import BertConfig
    from bert_jax.training import cpu_bf16
    from data_pipeline import tokenization
    from data_pipeline.tokenization.fast import FastTokenizer

    FLAGS = flags.FLAGS
    # Before anything runs: an unusable path is named (and no local folder "gs:" is made).
    for flag in ("input_file", "output_file", "init_checkpoint", "vocab_file", "bert_config_file"):
        if FLAGS[flag].value:
            storage_paths.check(FLAGS[flag].value, f"--{flag}")
    try:
        layers = [int(x) for x in FLAGS.layers.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers={FLAGS.layers!r}: expected comma-separated integers like -1,-2") from None
    if FLAGS.batch_size < 1:
        raise ValueError(f"--batch_size={FLAGS.batch_size} must be at least 1")
    if FLAGS.max_seq_length < 3:
        raise ValueError(f"--max_seq_length={FLAGS.max_seq_length}: must be at least 3 ([CLS] x [SEP])")
    pretrained = convert.load_pretrained(FLAGS.init_checkpoint, google_gelu=FLAGS.google_gelu)
    config = pretrained.config
    if FLAGS.bert_config_file:
        config = BertConfig.from_json_file(FLAGS.bert_config_file)
    config = cpu_bf16.for_checkpoint(config.replace(dtype=FLAGS.dtype, mixed_matmuls=False), FLAGS.cpu_bf16)
    if FLAGS.max_seq_length > config.max_position_embeddings:
        raise ValueError(f"--max_seq_length={FLAGS.max_seq_length} exceeds the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")
    vocab_file = FLAGS.vocab_file or pretrained.vocab_file
    if not vocab_file:
        raise ValueError(f"--init_checkpoint={FLAGS.init_checkpoint} has no vocab.txt: pass --vocab_file")
    do_lower_case = FLAGS.do_lower_case
    if not FLAGS["do_lower_case"].present and pretrained.do_lower_case is not None:
        do_lower_case = pretrained.do_lower_case
    elif pretrained.do_lower_case is not None and pretrained.do_lower_case != do_lower_case:
        logging.warning("--do_lower_case=%s but the checkpoint is %s: features will be poor",
                        do_lower_case, "uncased" if pretrained.do_lower_case else "cased")
    tokenizer = FastTokenizer(vocab_file, do_lower_case=do_lower_case)
    tokenization.require_tokens(tokenizer.vocab, vocab_file, ("[CLS]", "[SEP]"))
    extractor = FeatureExtractor(config, convert.model_params(pretrained, config, heads=False)["bert"],
                                 layers, FLAGS.combine, FLAGS.sentence_pooling)
    stats: dict = {}
    storage.makedirs(storage_paths.dirname(storage_paths.abspath(FLAGS.output_file)))
    count = 0
    if not storage.isfile(FLAGS.input_file):
        raise FileNotFoundError(f"--input_file={FLAGS.input_file}: no such file")
    progress = sys.stderr.isatty()
    total = count_lines(FLAGS.input_file) if progress else None
    # A complete file or none: written under a temporary name and renamed into place (local), or
    # uploaded whole when closed (gs://); on an error, nothing partial is left behind.
    with storage.open(FLAGS.output_file, "w", encoding="utf-8") as f:
        for line in extract(read_examples(FLAGS.input_file, stats), tokenizer, extractor,
                            FLAGS.max_seq_length, FLAGS.batch_size, progress=progress, total=total):
            f.write(line + "\n")
            count += 1
    if stats["lines_with_bad_utf8"]:
        logging.warning("%s: %d line(s) were not valid UTF-8 (bad bytes replaced by U+FFFD)",
                        FLAGS.input_file, stats["lines_with_bad_utf8"])
    print(json.dumps({"examples": count, "output_file": FLAGS.output_file, **stats}))


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
