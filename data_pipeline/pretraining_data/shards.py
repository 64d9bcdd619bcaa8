"""One shard of `create_pretraining_data`'s fast mode, shared by its local and Beam runners.

What a shard needs and makes, and how shards add up: the `Options` (Google's flags), the
per-process worker state (`init_worker`: the `FastTokenizer` and vocabulary, or with
`--tokenizer_json` the `HFTokenizer` and its words; with `--chinese_whole_word_mask` the word
segmenter; loaded once per process), `shard_records` (an input shard -> framed TFRecord bytes per output bucket + statistics,
a function of (seed, shard) only through `shard_rng`), `output_index` (which output file a shard's
bucket goes to: the reference's round-robin), `ShardTotals` and `run_info` (the statistics
the run's manifest reports; `tokenizer_record`: a tokenizer.json's), `check_output_dir_free` (what a run may write into a folder that
other runs' records are in).

`create_pretraining_data` (the CLI and local process pool) and `beam_pipeline` (the Beam runner)
both import this module, so the two runners write the same files for the same flags, seed and
inputs. Nothing here imports jax, bert_jax or Beam.
"""

from __future__ import annotations

import dataclasses
import resource
from typing import List, Optional, Sequence

import numpy as np

from data_pipeline import storage, tokenization
from data_pipeline.pretraining_data import chinese_words, corpora, fast_instances, instances as inst
from data_pipeline.records import manifests, schema, tfrecord
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tokenization import fast as fast_tokenization, hf_tokenizer


@dataclasses.dataclass(frozen=True)
class Options:
    vocab_file: Optional[str]  # WordPiece vocab.txt (or a SentencePiece .model); None with tokenizer_json
    do_lower_case: bool = True
    do_whole_word_mask: bool = False
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    random_seed: int = 12345
    dupe_factor: int = 10
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    chinese_whole_word_mask: bool = False  # whole words are a segmenter's (jieba) Chinese words too
    chinese_user_dict: Optional[str] = None  # the segmenter's user dictionary
    tokenizer_json: Optional[str] = None  # a HuggingFace tokenizer.json instead of vocab_file (hf_tokenizer.py)

    @property
    def vocabulary(self) -> str:
        """The file the ids come from: the tokenizer.json or the vocab.txt (its sha256 is the manifest's)."""
        return self.tokenizer_json or self.vocab_file

    def validate(self) -> None:
        if self.max_seq_length < 5:
            raise ValueError(f"--max_seq_length={self.max_seq_length}: needs room for [CLS] A [SEP] B [SEP] (>= 5)")
        if self.max_predictions_per_seq < 1:
            raise ValueError(f"--max_predictions_per_seq={self.max_predictions_per_seq} must be >= 1")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"--masked_lm_prob={self.masked_lm_prob} must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short_seq_prob={self.short_seq_prob} must be in [0, 1]")
        if self.dupe_factor < 1:
            raise ValueError(f"--dupe_factor={self.dupe_factor} must be >= 1")
        if bool(self.vocab_file) == bool(self.tokenizer_json):
            raise ValueError(f"--vocab_file={self.vocab_file} and --tokenizer_json={self.tokenizer_json}: give "
                             "exactly one (a WordPiece vocab.txt, or a HuggingFace tokenizer.json)")
        if self.tokenizer_json:
            self._validate_tokenizer_json()
        else:
            if not storage.exists(storage_paths.check(self.vocab_file, "--vocab_file")):
                raise FileNotFoundError(f"--vocab_file={self.vocab_file}: not found")
            tokenization.require_tokens(tokenization.load_vocab(self.vocab_file), f"--vocab_file={self.vocab_file}",
                                        (tokenization.CLS_TOKEN, tokenization.SEP_TOKEN, tokenization.MASK_TOKEN))
        if self.chinese_whole_word_mask and not self.do_whole_word_mask:
            raise ValueError("--chinese_whole_word_mask chooses the words of whole-word masking: it needs "
                             "--do_whole_word_mask too")
        if self.chinese_user_dict and not self.chinese_whole_word_mask:
            raise ValueError(f"--chinese_user_dict={self.chinese_user_dict} needs --chinese_whole_word_mask")
        if self.chinese_whole_word_mask:
            chinese_words.segmenter_version()  # jieba installed?
            if self.chinese_user_dict:
                chinese_words.read_user_dict(self.chinese_user_dict)  # missing or malformed: named now

    def _validate_tokenizer_json(self) -> None:
        name = f"--tokenizer_json={self.tokenizer_json}"
        if not storage.exists(storage_paths.check(self.tokenizer_json, "--tokenizer_json")):
            raise FileNotFoundError(f"{name}: not found")
        if self.chinese_whole_word_mask:
            raise ValueError(f"{name}: --chinese_whole_word_mask aligns jieba's words with WordPiece tokens; "
                             "with a tokenizer.json, --do_whole_word_mask uses its pre-tokenizer's words")
        hf_tokenizer.HFTokenizer(self.tokenizer_json)  # unreadable, or no [CLS]/[SEP]/[MASK]: named now


# ---------------------------------------------------------------------------------------------
# The worker state and one shard
# ---------------------------------------------------------------------------------------------


_WORKER: dict = {}
BATCH_INSTANCES = 4096  # instances masked, encoded and framed at once (bounds worker memory)


def init_worker(opts: Options, num_outputs: int = 1) -> None:
    """Loads what `shard_records` needs into this process (the local pool's workers, Beam's DoFns)."""
    words = None  # the tokens that continue a word, where the vocabulary's spelling ("##") does not tell
    if opts.tokenizer_json:
        tok = hf_tokenizer.HFTokenizer(opts.tokenizer_json)
        vocab = fast_instances.Vocab.from_dict(tok.vocab, (tok.cls_token, tok.sep_token, tok.mask_token),
                                               subword_prefix=None)
        words = tok.word_continuations if opts.do_whole_word_mask else None
    else:
        tok = fast_tokenization.FastTokenizer(opts.vocab_file, do_lower_case=opts.do_lower_case)
        vocab = fast_instances.Vocab.from_dict(tok.vocab)
    segmenter = (chinese_words.ChineseWordSegmenter(opts.chinese_user_dict) if opts.chinese_whole_word_mask
                 else None)
    if segmenter:
        words = _word_continuations(segmenter, tok)
    _WORKER.update(opts=opts, tok=tok, vocab=vocab, num_outputs=num_outputs, words=words)


def _word_continuations(segmenter: "chinese_words.ChineseWordSegmenter", tok: fast_tokenization.FastTokenizer):
    """`tokenize_shard`'s `word_continuations` for Chinese whole-word masking, over `tok`'s tokens."""
    def count_tokens(texts):
        return [len(ids) for ids in tok.encode_batch(texts)]

    def continuations(sentences: List[str], encoded: List[List[int]]) -> List[List[bool]]:
        out = []
        for text, ids in zip(sentences, encoded):
            bits = segmenter.continuations(text, count_tokens)
            chinese_words.check_alignment(bits, len(ids), text)
            out.append(bits)
        return out
    return continuations


def worker_options() -> Optional[Options]:
    """The options this process's worker state was loaded with (`init_worker`), or None."""
    return _WORKER.get("opts")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def shard_rng(random_seed: int, shard_index: int) -> np.random.Generator:
    """The fast mode's random stream of one shard: a function of (seed, shard) only."""
    return np.random.default_rng([random_seed % 2**64, shard_index])


def shard_records(task) -> tuple:
    """One input shard -> (framed TFRecord bytes per output bucket, records per bucket, read
    stats, mask stats, this process's peak RSS in MB).

    Record m of the shard (in its shuffled order) goes to bucket m % num_outputs; the driver
    writes bucket b to file `output_index(records written before the shard, b, num_outputs)`,
    which is the reference's round-robin over the output files.
    """
    shard_index, source = task
    opts: Options = _WORKER["opts"]
    tok = _WORKER["tok"]
    vocab: fast_instances.Vocab = _WORKER["vocab"]
    num_outputs: int = _WORKER["num_outputs"]
    read_stats, mask_stats = corpora.ReadStats(), inst.MaskStats()
    if source[0] == "text":
        docs = corpora.read_google_text(source[1], read_stats)
    else:
        _, name, split, key, data_dir, num_shards, download = source
        docs = corpora.read_tfds_documents(name, split, key, data_dir, shard_index, num_shards, read_stats,
                                           download=download)
    shard = fast_instances.tokenize_shard(docs, tok.encode_batch, word_continuations=_WORKER["words"])
    read_stats.documents_without_tokens += shard.num_input_documents - shard.num_documents
    read_stats.one_sentence_documents += int(np.sum(shard.doc_end - shard.doc_first == 1))
    rng = shard_rng(opts.random_seed, shard_index)
    pairs = fast_instances.make_pairs(shard, max_seq_length=opts.max_seq_length,
                                      short_seq_prob=opts.short_seq_prob, dupe_factor=opts.dupe_factor, rng=rng)
    pairs = fast_instances.truncate_pairs(pairs, opts.max_seq_length - 3, rng)
    order = rng.permutation(len(pairs))  # the reference's final shuffle (within the shard)
    buckets: List[List[bytes]] = [[] for _ in range(num_outputs)]
    counts = np.zeros(num_outputs, np.int64)
    for begin in range(0, len(order), BATCH_INSTANCES):
        index = order[begin:begin + BATCH_INSTANCES]
        bucket = (begin + np.arange(len(index))) % num_outputs
        by_bucket = np.argsort(bucket, kind="stable")
        features = fast_instances.masked_features(
            shard.ids, pairs.take(index[by_bucket]), vocab, max_seq_length=opts.max_seq_length,
            max_predictions_per_seq=opts.max_predictions_per_seq, masked_lm_prob=opts.masked_lm_prob,
            do_whole_word_mask=opts.do_whole_word_mask, rng=rng, stats=mask_stats, continues=shard.continues)
        buffer, starts, lengths = schema.encode_examples(features, head=tfrecord.HEADER_BYTES,
                                                         tail=tfrecord.FOOTER_BYTES)
        tfrecord.frame(buffer, starts, lengths)
        per_bucket = np.bincount(bucket, minlength=num_outputs)
        ends = np.cumsum(per_bucket)
        slot_end = np.append(starts[1:] - tfrecord.HEADER_BYTES, len(buffer))
        cut = 0
        for b in range(num_outputs):
            if per_bucket[b]:
                end = int(slot_end[ends[b] - 1])
                buckets[b].append(buffer[cut:end].tobytes())
                cut = end
        counts += per_bucket
    return [b"".join(parts) for parts in buckets], counts, read_stats, mask_stats, _peak_rss_mb()


# ---------------------------------------------------------------------------------------------
# Adding shards up (the output files, the statistics)
# ---------------------------------------------------------------------------------------------


def output_index(records_before: int, bucket: int, num_outputs: int) -> int:
    """The output file of bucket `bucket` of a shard (see `shard_records`) that follows
    `records_before` records: the reference's round-robin, record n of the whole output going to
    file n % num_outputs.

    Example: with 3 files and 7 records before a shard, the shard's record 0 (bucket 0) is
    record 7 overall and goes to file 1: `output_index(7, 0, 3) == 1`.
    """
    return (records_before + bucket) % num_outputs


@dataclasses.dataclass
class ShardTotals:
    """The shards' statistics added up (what the run's manifest reports)."""

    read_stats: corpora.ReadStats = dataclasses.field(default_factory=corpora.ReadStats)
    mask_stats: inst.MaskStats = dataclasses.field(default_factory=inst.MaskStats)
    worker_rss_mb: float = 0.0  # the largest peak RSS a shard's process reported

    def add(self, read_stats: corpora.ReadStats, mask_stats: inst.MaskStats, rss_mb: float) -> None:
        self.read_stats.add(read_stats)
        self.mask_stats.add(mask_stats)
        self.worker_rss_mb = max(self.worker_rss_mb, rss_mb)


def output_dir(outputs: Sequence[str]) -> str:
    """The one directory of all `outputs` (the run's manifest goes there)."""
    out_dirs = {storage_paths.dirname(storage_paths.abspath(storage_paths.check(p, "--output_file"))) for p in outputs}
    if len(out_dirs) != 1:
        raise ValueError("--output_file: all outputs must be in one directory (the run's manifest goes there)")
    return out_dirs.pop()


def check_output_dir_free(out_dir: str, outputs: Sequence[str]) -> list[str]:
    """Refuses, before any work, a run that would leave a manifest of the folder wrong; returns
    the manifests this run's replaces (to delete once it is written).

    Any number of runs write into one folder, each its own manifest (`manifests.run_manifest_name`),
    so records of other runs are left alone. Refused: writing a file another run's manifest lists
    (that manifest would describe bytes that are gone), and rerunning under a name whose earlier
    run listed files this one does not write and that are still there (a rerun with another shard
    count: those files would be left unlisted, and the trainer refuses unlisted files). A folder
    of an earlier version's single `dataset_info.json` that lists only this run's files (a rerun
    there) is this run's: its manifest is replaced by this run's.
    """
    mine = {storage_paths.basename(p) for p in outputs}
    own = manifests.run_manifest_name(outputs)
    replaced = []
    for manifest in manifests.in_directory(out_dir, lenient=True):  # unreadable: describes nothing
        name = storage_paths.basename(manifest.path)
        listed = {storage_paths.basename(p) for p in manifest.files}
        there = sorted(n for n in listed - mine if storage.exists(storage_paths.join(out_dir, n)))
        if name == own or (manifest.legacy and listed & mine and not there):
            if there:
                raise ValueError(
                    f"--output_file: {manifest.path}, the manifest this run writes, lists other records that are "
                    f"still there ({len(there)} files: {_some(there)}), which this run would leave unlisted (the "
                    f"trainer refuses unlisted files). Delete them first (a rerun with another shard count), or name "
                    f"this run's output differently")
            if name != own:
                replaced.append(manifest.path)
            continue
        clash = sorted(listed & mine)
        if clash:
            raise ValueError(
                f"--output_file: {manifest.path} lists {len(clash)} of this run's output files ({_some(clash)}): "
                f"writing them would leave that manifest describing records that are gone. Name this run's "
                f"output differently (each run in a folder writes its own files and its own "
                f"<output name>.{manifests.MANIFEST_NAME}), or delete that manifest and its records first")
    return replaced


def _some(names: list) -> str:
    """The first three of `names`, then "..." if there are more (an error message's list)."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def run_info(opts: Options, totals: ShardTotals, *, num_instances: int, seconds: float, mode: str,
             compression: str, flags_used: Optional[dict], workers_rss: bool) -> dict:
    """The run manifest's fields besides the file list (`manifests.write_dataset_info` adds that).

    Args:
      workers_rss: whether the shards ran in processes other than this one (then their peak RSS
        is reported as the workers'; otherwise as None, the work having run in the parent).
    """
    info = {
        "flags": flags_used or dataclasses.asdict(opts),
        "random_seed": opts.random_seed,
        "mode": mode,
        "vocab_sha256": manifests.sha256_file(opts.vocabulary),
        "max_seq_length": opts.max_seq_length,
        "max_predictions_per_seq": opts.max_predictions_per_seq,
        "compression": compression,
        "read_stats": dataclasses.asdict(totals.read_stats),
        "mask_stats": totals.mask_stats.summary(),
        "num_instances": num_instances,
        "seconds": seconds,
        "instances_per_second": num_instances / max(seconds, 1e-9),
        "peak_rss_mb": {"parent": round(_peak_rss_mb(), 1),
                        "workers": round(totals.worker_rss_mb, 1) if workers_rss else None},
    }
    if opts.tokenizer_json:
        # The ids are this file's: a run checks its mask id and size against it (`tokenizer_record`).
        info["tokenizer"] = tokenizer_record(opts.tokenizer_json)
        info["flags"] = {**info["flags"], "do_lower_case": None}  # the file's normalizer decides casing
    if opts.chinese_whole_word_mask:
        info["chinese_segmenter"] = {
            "name": "jieba", "version": chinese_words.segmenter_version(), "hmm": chinese_words.HMM,
            "user_dict_sha256": manifests.sha256_file(opts.chinese_user_dict) if opts.chinese_user_dict else None}
    return info


def tokenizer_record(path: str) -> dict:
    """What a run's manifest records of the tokenizer.json that made its records: the file, its sha256,
    its size in ids and its special tokens' ids (`dataset_info.json`'s `tokenizer`)."""
    tok = hf_tokenizer.HFTokenizer(path)
    return {"kind": "tokenizer.json", "file": path, "sha256": manifests.sha256_file(path),
            "vocab_size": tok.vocab_size, "special_ids": tok.special_ids(),
            "special_tokens": {role: getattr(tok, f"{role}_token") for role in hf_tokenizer.ROLE_NAMES}}
