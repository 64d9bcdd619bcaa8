"""Pretraining's checks before compiling: the settings, the mesh, the data and the vocabulary agree.

A mistake in a pretraining config should stop the run at startup, on every host, with a message
that names the field and the fix, rather than as a trace error, a silent clamp, or a NaN hours in.
`pretrain.run` calls these in order:

- `check_same_config_on_all_hosts`: every host resolved the same config (else all hosts exit,
  naming the keys that differ);
- `check_sequence_lengths`: each phase's length fits the position table and is the records' length
  (and `check_data_vocab_size`: a tokenizer.json's records fit the embedding table);
- `check_mesh`: the batch, gradient accumulation and the model divide over the mesh;
- `check_one_vocabulary`, `special_token_ids`, `check_vocab_matches_data`,
  `check_tokenizer_matches_data`: one vocabulary (a vocab.txt, `config.vocab_file`, or a HuggingFace
  tokenizer.json, `config.tokenizer_json`), it has the special tokens and is the one the data was
  made with (records a tokenizer.json made are refused with a vocab.txt, and the other way round);
  `check_token_ids` checks each batch against the embedding table;
- `report_schedule_change`: a resumed run says when its learning-rate schedule differs from the
  checkpoint's (allowed, but worth a line);
- `data_casing`: the casing the data was made with, for the workdir's tokenizer config.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional, Sequence

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from bert_jax import exit_codes
from bert_jax.model.model_config import BertConfig
from bert_jax.pretrain.phases import Phase
from bert_jax.training import sharding
from bert_jax.training.run_setup import flatten_dict

# The config fields of the learning-rate schedule, saved with each checkpoint to compare on resume.
SCHEDULE_KEYS = ("learning_rate", "warmup_steps", "num_train_steps", "lr_decay_power", "google_lr_schedule",
                 "lr_decay_steps", "lr_decay_shape", "optimizer")


# ---------------------------------------------------------------------------------------------
# The config: the same on every host
# ---------------------------------------------------------------------------------------------


def config_fingerprint(config: ml_collections.ConfigDict) -> str:
    """sha256 of the resolved config's canonical JSON."""
    return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()


def config_differences(mine: dict, theirs: dict, limit: int = 8) -> list[str]:
    """`config.key: a != b` for each flattened key whose values differ (or that one side lacks)."""
    missing = object()
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k, missing) != theirs.get(k, missing))
    lines = [f"config.{k}: {json.dumps(mine.get(k, '<absent>'))} != {json.dumps(theirs.get(k, '<absent>'))}"
             for k in keys[:limit]]
    return lines + ([f"... and {len(keys) - limit} more"] if len(keys) > limit else [])


def check_same_config_on_all_hosts(config: ml_collections.ConfigDict) -> None:
    """Exits every host before compiling when one host resolved a different config, naming the keys
    that differ from process 0's (every host gathers every host's config, so all exit together)."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(bytes.fromhex(config_fingerprint(config)), dtype=np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest))  # [hosts, 32]
    if (digests == digests[0]).all():
        return
    text = np.frombuffer(config.to_json(sort_keys=True).encode(), dtype=np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([text.size], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:text.size] = text
    texts = np.asarray(multihost_utils.process_allgather(padded))  # [hosts, longest]
    flat = [flatten_dict(json.loads(bytes(t[:n]).decode())) for t, n in zip(texts, lengths)]
    report = [f"process {host} vs process 0: " + "; ".join(config_differences(flat[host], flat[0]))
              for host in range(1, len(flat)) if not (digests[host] == digests[0]).all()]
    raise SystemExit(f"process {jax.process_index()}: config mismatch across hosts (every host must get "
                     f"the same config file and overrides): " + " | ".join(report))


# ---------------------------------------------------------------------------------------------
# The settings against the model and the mesh
# ---------------------------------------------------------------------------------------------


def check_mesh(config, bert_config: BertConfig, mesh) -> None:
    """The batch sizes and intervals are positive, and the batch (per accumulation step) and the
    model's heads and widths divide over the mesh."""
    for field in ("global_batch_size", "checkpoint_every_steps"):
        if config[field] < 1:
            raise ValueError(f"config.{field}={config[field]} must be at least 1")
    if config.eval_batch_size < 0:
        raise ValueError(f"config.eval_batch_size={config.eval_batch_size} must be >= 0 (0: global_batch_size)")
    sharding.check_divisibility(
        mesh, global_batch_size=config.global_batch_size,
        num_attention_heads=bert_config.num_attention_heads,
        intermediate_size=bert_config.intermediate_size, hidden_size=bert_config.hidden_size)
    k = config.grad_accum_steps
    if k < 1 or config.global_batch_size % k or (config.global_batch_size // k) % sharding.axis_size(
            mesh, sharding.BATCH_AXES):
        raise ValueError(
            f"config.grad_accum_steps={k}: global_batch_size={config.global_batch_size} / {k} must be "
            f"a whole number divisible by data*fsdp={sharding.axis_size(mesh, sharding.BATCH_AXES)}")


def check_sequence_lengths(config: ml_collections.ConfigDict, bert_config: BertConfig, phases: list) -> None:
    """Each phase's length against the position table and against its records, before compiling
    (else: a trace error without the field, or a tf parse error, at phase 2 hours into a run); and
    the size of a tokenizer.json its records were made with against the embedding table
    (`check_data_vocab_size`)."""
    from data_pipeline.records import reader
    for i, phase in enumerate(phases):
        where = f"config.phases[{i}]." if config.phases else "config."
        if phase.max_seq_length > bert_config.max_position_embeddings:
            raise ValueError(
                f"{where}max_seq_length={phase.max_seq_length} exceeds config.model.max_position_embeddings="
                f"{bert_config.max_position_embeddings}: the model has no position embedding past "
                f"{bert_config.max_position_embeddings} (lower the length or enlarge the model's table)")
        length, predictions = reader.record_shape(phase.train_data)
        if (length, predictions) != (phase.max_seq_length, phase.max_predictions_per_seq):
            raise ValueError(
                f"the records {phase.train_data} were written with max_seq_length={length}, "
                f"max_predictions_per_seq={predictions}, but {where}max_seq_length={phase.max_seq_length}, "
                f"{where}max_predictions_per_seq={phase.max_predictions_per_seq}: set these to the records' "
                f"values, or write records at this length (create_pretraining_data --max_seq_length=... "
                f"--max_predictions_per_seq=...)")
    check_data_vocab_size(bert_config.vocab_size, [p.train_data for p in phases])


# ---------------------------------------------------------------------------------------------
# The vocabulary and the data
# ---------------------------------------------------------------------------------------------


def check_one_vocabulary(config: ml_collections.ConfigDict) -> None:
    """At most one of config.vocab_file (a WordPiece vocab.txt) and config.tokenizer_json (a HuggingFace
    tokenizer.json): the records' ids are one of them."""
    if config.get("vocab_file") and config.get("tokenizer_json"):
        raise ValueError(f"config.vocab_file={config.vocab_file} and config.tokenizer_json={config.tokenizer_json}: "
                         "give one, the vocabulary the records were made with (create_pretraining_data's "
                         "--vocab_file or --tokenizer_json), and set the other to ''")


def check_vocabulary(config: ml_collections.ConfigDict, model_vocab_size: int,
                     patterns: Sequence[str]) -> Optional[dict]:
    """The run's vocabulary checked (one of them, its special tokens, its size against the model's, the
    data's own, one for dynamic masking); returns its special ids (`special_token_ids`)."""
    check_one_vocabulary(config)
    tokenizer_json = config.get("tokenizer_json", "")
    special_ids = special_token_ids(config.vocab_file, tokenizer_json)
    check_special_ids_fit(special_ids, model_vocab_size, vocabulary_key(config))
    if config.dynamic_masking and special_ids is None:
        raise ValueError("config.dynamic_masking needs config.vocab_file or config.tokenizer_json (for the [MASK] "
                         "id and the vocabulary)")
    check_vocab_matches_data(config.vocab_file, patterns)
    check_tokenizer_matches_data(tokenizer_json, patterns)
    return special_ids


def check_special_ids_fit(special_ids: Optional[dict], model_vocab_size: int, where: str) -> None:
    """Raises naming `where` (the vocabulary's key) when the vocabulary has more ids than the model."""
    if special_ids and special_ids["vocab_size"] > model_vocab_size:
        raise ValueError(f"{where} has {special_ids['vocab_size']} tokens but config.model.vocab_size="
                         f"{model_vocab_size}: set the model's vocab_size to the vocabulary's size (ids past the "
                         "embedding table would be silently clamped)")


def vocabulary_key(config: ml_collections.ConfigDict) -> str:
    """`config.vocab_file=PATH` or `config.tokenizer_json=PATH`, whichever is set, for messages."""
    if config.get("tokenizer_json"):
        return f"config.tokenizer_json={config.tokenizer_json}"
    return f"config.vocab_file={config.get('vocab_file')}"


def special_token_ids(vocab_file: str, tokenizer_json: str = "") -> Optional[dict]:
    """The ids of [PAD], [CLS], [SEP], [MASK] in `vocab_file` (or the special tokens of the tokenizer.json
    `tokenizer_json`: `HFTokenizer.special_ids`) and its size in ids (None without either); raises naming
    the file when one of those tokens is missing. A tokenizer.json without a padding token gets
    pad_id -1 (no real token is taken for padding)."""
    if tokenizer_json:
        from data_pipeline.tokenization import hf_tokenizer
        ids = hf_tokenizer.HFTokenizer(tokenizer_json).special_ids()
        return dict(ids, pad_id=-1 if ids["pad_id"] is None else ids["pad_id"])
    if not vocab_file:
        return None
    from data_pipeline import tokenization  # the loop's checks may touch the data side
    vocab = tokenization.load_vocab(vocab_file)
    tokenization.require_tokens(vocab, f"config.vocab_file={vocab_file}", ("[PAD]", "[CLS]", "[SEP]", "[MASK]"))
    return dict(pad_id=vocab["[PAD]"], cls_id=vocab["[CLS]"], sep_id=vocab["[SEP]"],
                mask_id=vocab["[MASK]"], vocab_size=max(vocab.values()) + 1)  # ids, not distinct tokens


def check_tokenizer_matches_data(tokenizer_json: str, patterns: Sequence[str]) -> None:
    """Raises, naming both files, when `tokenizer_json` is not the tokenizer.json the data was made with
    (its dataset_info.json's `tokenizer`): equal bytes pass, and so does another file with the same
    ids and special tokens while the recorded one is readable. Records of a vocab.txt are refused."""
    if not tokenizer_json:
        return
    from data_pipeline import storage
    from data_pipeline.records import manifests, reader
    from data_pipeline.tokenization import hf_tokenizer

    digest = None
    for pattern in storage.split_patterns(patterns):
        info = reader.dataset_info(pattern)
        made_by = info.get("tokenizer")
        if not (isinstance(made_by, dict) and made_by.get("kind") == "tokenizer.json"):
            if info.get("vocab_sha256"):
                made_with = info.get("flags", {}).get("vocab_file")
                raise ValueError(f"config.tokenizer_json={tokenizer_json}, but {pattern} was made with the vocab.txt "
                                 f"{made_with} (per its dataset_info.json): set config.vocab_file={made_with} and "
                                 "config.tokenizer_json=''")
            continue  # no manifest to compare with
        if digest is None:
            digest = manifests.sha256_file(tokenizer_json)
        if digest == made_by.get("sha256"):
            continue
        recorded = made_by.get("file")
        if recorded and storage.exists(recorded):
            mine, theirs = hf_tokenizer.HFTokenizer(tokenizer_json), hf_tokenizer.HFTokenizer(recorded)
            if mine.vocab == theirs.vocab and mine.special_ids() == theirs.special_ids():
                continue  # the same ids and special tokens in another file
            raise ValueError(f"config.tokenizer_json={tokenizer_json} is not the tokenizer.json {pattern} was made "
                             f"with ({recorded}, per its dataset_info.json): their vocabularies or special tokens "
                             "differ, so the data's token ids would mean other tokens")
        mine = hf_tokenizer.HFTokenizer(tokenizer_json)
        if (mine.vocab_size, mine.special_ids()) != (made_by.get("vocab_size"), made_by.get("special_ids")):
            raise ValueError(f"config.tokenizer_json={tokenizer_json} is not the tokenizer.json {pattern} was made "
                             f"with ({recorded}, no longer readable): {mine.vocab_size} ids and special ids "
                             f"{mine.special_ids()}, the records' {made_by.get('vocab_size')} and "
                             f"{made_by.get('special_ids')}")
        logging.warning("config.tokenizer_json=%s differs byte-wise from the tokenizer.json %s was made with "
                        "(%s, no longer readable; same size and special ids): make sure it has the same tokens",
                        tokenizer_json, pattern, recorded)


def check_data_vocab_size(vocab_size: int, patterns: Sequence[str]) -> None:
    """Raises naming config.model.vocab_size when records were made with a tokenizer.json of more ids
    (their manifest's `tokenizer.vocab_size`): at startup, not at the first batch holding a large id
    (`check_token_ids`). Records of a vocab.txt record no size and pass."""
    from data_pipeline.records import reader

    for pattern in patterns:
        made_by = reader.dataset_info(pattern).get("tokenizer")
        size = made_by.get("vocab_size") if isinstance(made_by, dict) else None
        if size and size > vocab_size:
            raise ValueError(f"config.model.vocab_size={vocab_size}, but {pattern} was made with the tokenizer.json "
                             f"{made_by.get('file')} of {size} ids (per its dataset_info.json): set "
                             f"config.model.vocab_size >= {size}")


def check_token_ids(batch: dict, vocab_size: int, data: str) -> None:
    """Raises naming the data and config.model.vocab_size when a batch holds an id past the
    embedding table (on an accelerator it would be clamped or turn the loss into NaN). The error is
    classed as bad data (`exit_codes.DATA`): raised while training, it is no bug worth a retry."""
    for key in ("input_ids", "masked_lm_ids"):
        if key in batch and batch[key].size:
            largest = int(batch[key].max())
            if largest >= vocab_size:
                raise exit_codes.mark(ValueError(
                    f"{data}: {key} holds token id {largest} but config.model.vocab_size={vocab_size}: "
                    "the data was made with a larger vocabulary than the model's"), exit_codes.DATA)


def check_vocab_matches_data(vocab_file: str, patterns: Sequence[str]) -> None:
    """Raises when `vocab_file` is not the vocabulary the data was made with: ids would mean
    other tokens (dynamic masking's random tokens, fill-in-the-blank). The data's
    dataset_info.json records that vocabulary's sha256 and path; equal bytes pass, and so does
    another file with the same tokens (line endings, final newline). When the recorded file is
    gone and the bytes differ, the tokens cannot be compared: a warning."""
    if not vocab_file:
        return
    from data_pipeline import storage, tokenization
    from data_pipeline.records import reader
    from data_pipeline.records import manifests

    digest = None
    for pattern in storage.split_patterns(patterns):
        info = reader.dataset_info(pattern)
        made_by = info.get("tokenizer")
        if isinstance(made_by, dict) and made_by.get("kind") == "tokenizer.json":
            raise ValueError(
                f"config.vocab_file={vocab_file}, but {pattern} was made with the tokenizer.json "
                f"{made_by.get('file')} (per its dataset_info.json): its ids are that file's "
                f"({made_by.get('vocab_size')} ids, [MASK] = {(made_by.get('special_ids') or {}).get('mask_id')}), not "
                f"a vocab.txt's. Set config.tokenizer_json={made_by.get('file')} and config.vocab_file='', "
                f"and config.model.vocab_size >= {made_by.get('vocab_size')}")
        want = info.get("vocab_sha256")
        if not want:
            continue
        if digest is None:
            digest = manifests.sha256_file(vocab_file)  # as create_pretraining_data records it
        if digest == want:
            continue
        made_with = info.get("flags", {}).get("vocab_file")
        if made_with and storage.exists(made_with):
            if list(tokenization.load_vocab(made_with).items()) == list(tokenization.load_vocab(vocab_file).items()):
                continue  # the same tokens and ids in another file
            raise ValueError(f"config.vocab_file={vocab_file} is not the vocabulary {pattern} was made with "
                             f"({made_with}, per its dataset_info.json): their tokens differ, so the "
                             "data's token ids would mean other tokens")
        logging.warning("config.vocab_file=%s differs byte-wise from the vocabulary %s was made with (%s, "
                        "no longer readable; sha256 %s... in its dataset_info.json): make sure it has the "
                        "same tokens", vocab_file, pattern, made_with, want[:12])


def data_casing(phases: Sequence[Phase]) -> Optional[bool]:
    """`do_lower_case` the training data was made with (its dataset_info.json flags), if recorded
    and the same for every phase; None otherwise."""
    from data_pipeline.records import reader

    found = {reader.dataset_info(p.train_data).get("flags", {}).get("do_lower_case") for p in phases}
    if len(found) > 1:
        logging.warning("the phases' data disagree on do_lower_case (%s): no casing recorded in the workdir",
                        sorted(found, key=str))
        return None
    value = found.pop()
    return value if isinstance(value, bool) else None


# ---------------------------------------------------------------------------------------------
# Resuming
# ---------------------------------------------------------------------------------------------


def report_schedule_change(config: ml_collections.ConfigDict, meta: dict, step: int) -> None:
    """A resumed run whose learning rate or schedule differs from the checkpoint's says so, with both
    values (allowed: e.g. a longer run, or a lower rate after a loss spike)."""
    saved = meta.get("schedule") or {}
    for key in SCHEDULE_KEYS:
        if key in saved and saved[key] != config.get(key):
            logging.warning("resuming step %d with config.%s=%r; the checkpoint was trained with config.%s=%r",
                            step, key, config.get(key), key, saved[key])

