"""Pretraining's input: the training batches of a phase, the evaluation pass, and its scores.

`make_train_input` builds this host's share of a phase's data (`ShardedInput`: a fixed number of
file shards, so the global batch does not depend on the host count) from
`data_pipeline.input.pretraining`; it yields host-local numpy batches and saves/restores its position
with each checkpoint. `make_eval_input` is one padded pass over held-out records and `run_eval`
sums `eval_step` over it. The batches become global arrays in `run_eval` here and in the loop
(`sharding.to_global`).

Given the run's workdir, both keep the hashes of verified files in a bucket in
`WORKDIR/verified_data/process_<i>.json` as well as on local disk (`records.known_hashes.KnownHashes`), so a
VM recreated after a preemption does not hash the dataset again; `make_train_input` logs one line
per phase it starts: `data verification: hashed N files (B bytes), trusted T from earlier runs`.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax import layout
from bert_jax.pretrain import steps
from bert_jax.pretrain.phases import Phase
from bert_jax.training import sharding
from data_pipeline.storage import paths as storage_paths


class ShardedInput:
    """This host's share of `num_shards` file shards, one pipeline each, rows concatenated.

    With `config.data_shards` fixed, the global batch does not depend on how many processes read
    it: 1 process reading 2 shards yields exactly the batches of 2 processes reading 1 each. That
    is what makes a run reproducible across host counts (and testable on one machine).
    """

    def __init__(self, make, num_shards: int):
        count, index = jax.process_count(), jax.process_index()
        if num_shards % count:
            raise ValueError(f"config.data_shards={num_shards} must be a multiple of the number of "
                             f"processes ({count})")
        per_host = num_shards // count
        self.num_shards, self.first = num_shards, index * per_host
        self.shards = [make(index * per_host + j, num_shards, per_host) for j in range(per_host)]

    def __next__(self) -> dict:
        parts = [next(s) for s in self.shards]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def save_state(self, directory: str) -> None:
        for j, s in enumerate(self.shards):
            s.save_state(storage_paths.join(directory, f"shard_{j}"))

    def restore_state(self, directory: str) -> None:
        for j, s in enumerate(self.shards):
            s.restore_state(storage_paths.join(directory, f"shard_{j}"))

    def restore_shards(self, shard_dir) -> None:
        """Each shard's position from `shard_dir(global shard index)`, wherever the process that
        saved it put it (`pretrain.input_position`: a resume on another number of processes)."""
        for j, s in enumerate(self.shards):
            s.restore_state(shard_dir(self.first + j))

    @property
    def verification(self) -> dict:
        """What checking this host's files took, over its shards (`PretrainingInput.verification`)."""
        counts = [s.verification for s in self.shards]
        return {k: sum(c[k] for c in counts) for k in counts[0]}


def known_hashes_file(workdir: Optional[str]) -> Optional[str]:
    """This process's `WORKDIR/verified_data/process_<i>.json`, where the hashes of its verified data
    files are kept (`records.known_hashes.KnownHashes`; None without a workdir)."""
    if not workdir:
        return None
    return storage_paths.join(workdir, layout.VERIFIED_DATA, layout.verified_data_file(jax.process_index()))


def _verify(config):
    """The input pipeline's `verify`: False, True (unchanged files by identity) or "full" (rehash_data)."""
    return "full" if config.verify_data and config.get("rehash_data") else config.verify_data


def make_train_input(config, phase: Phase, special_ids: Optional[dict],
                     workdir: Optional[str] = None) -> ShardedInput:
    """This host's training batches of `phase`: its rows of `config.global_batch_size`, from
    `config.data_shards` file shards (default one per process). With `config.verify_data`, logs
    what checking the files took; with `workdir`, keeps their hashes there too (module docstring)."""
    from data_pipeline.input import masking, pretraining as input_pipeline

    if not 0.0 < config.get("masked_lm_prob", 0.15) < 1.0:
        raise ValueError(f"config.masked_lm_prob={config.masked_lm_prob} must be in (0, 1): the share of real "
                         "tokens dynamic masking predicts")
    # Which ids are `##` pieces: whole-word dynamic masking (asked, or as the records were made).
    subword = (masking.subword_table(config.vocab_file)
               if config.dynamic_masking and config.vocab_file else None)
    whole_word_mask = config.get("dynamic_whole_word_mask")
    if config.get("tokenizer_json") and config.dynamic_masking:
        # A tokenizer.json's words are its pre-tokenizer's, which the records do not carry.
        if whole_word_mask:
            raise ValueError(f"config.dynamic_whole_word_mask=True with config.tokenizer_json={config.tokenizer_json}: "
                             "the records carry no word boundaries of a tokenizer.json (BPE has no ## pieces), so "
                             "dynamic masking cannot re-draw whole words; set config.dynamic_whole_word_mask=False "
                             "(token by token), or config.dynamic_masking=False to train on the records' own masks")
        whole_word_mask = False

    def make(shard: int, num_shards: int, shards_per_host: int):
        per_host = config.global_batch_size // jax.process_count()
        if per_host % shards_per_host:
            raise ValueError(f"config.global_batch_size={config.global_batch_size} must divide into "
                             f"config.data_shards={num_shards} equal parts")
        return input_pipeline.PretrainingInput(
            phase.train_data,
            per_host_batch_size=per_host // shards_per_host,
            max_seq_length=phase.max_seq_length,
            max_predictions_per_seq=phase.max_predictions_per_seq,
            seed=config.seed,
            process_index=shard,
            process_count=num_shards,
            shuffle_buffer_size=config.shuffle_buffer_size,
            dynamic_masking=config.dynamic_masking,
            special_ids=special_ids,
            masked_lm_prob=config.get("masked_lm_prob", 0.15),
            whole_word_mask=whole_word_mask,
            subword=subword,
            packing=config.packing,
            max_seqs_per_pack=config.max_seqs_per_pack,
            verify=_verify(config),
            skip_corrupt=config.skip_corrupt_records,
            known_hashes_file=known_hashes_file(workdir),
        )

    batches = ShardedInput(make, config.data_shards or jax.process_count())
    if config.verify_data:
        # Grepped by the preemption rehearsal (a recreated VM must hash nothing): keep the wording.
        counts = batches.verification
        logging.info("data verification: hashed %d files (%d bytes), trusted %d from earlier runs",
                     counts["hashed_files"], counts["hashed_bytes"], counts["trusted_files"])
    return batches


def make_eval_input(config, data: str, workdir: Optional[str] = None):
    """One padded pass over `data`, at the records' own length and prediction count (whatever the
    training phase's are: a 128 -> 512 run evaluates on the same held-out records throughout).
    With `workdir`, the hashes of its verified files are kept there too (module docstring)."""
    from data_pipeline.input import evaluation
    from data_pipeline.records import reader
    max_seq_length, max_predictions_per_seq = reader.record_shape(data)
    global_batch = config.eval_batch_size or config.global_batch_size
    return evaluation.make_eval_iterator(
        data,
        per_host_batch_size=global_batch // jax.process_count(),
        max_seq_length=max_seq_length,
        max_predictions_per_seq=max_predictions_per_seq,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        verify=_verify(config),
        skip_corrupt=config.skip_corrupt_records,
        known_hashes_file=known_hashes_file(workdir),
    )


def run_eval(p_eval, params, batches, mesh, max_batches: int = 0) -> dict:
    """Sums over one pass (or `max_batches`) of a finite, padded eval iterator."""
    totals = None
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        sums = p_eval(params, sharding.to_global(batch, mesh))
        totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
    if totals is None:
        raise ValueError("the evaluation data yielded no batch (fewer records than one batch per host?)")
    return steps.summarize(jax.device_get(totals))
