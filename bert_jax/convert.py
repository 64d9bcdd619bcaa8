"""Checkpoint interop: Google TF1 <-> bert_jax <-> HuggingFace, and the conversion CLI.

    python -m bert_jax.convert --input=uncased_L-12_H-768_A-12 --output=/tmp/bert_base \\
        [--input_format=google|hf|bert_jax] --output_format=bert_jax|hf|google [--google_gelu=erf|tanh]
    python -m bert_jax.convert --input=FINETUNING_WORKDIR --output=/tmp/sst2_hf --output_format=hf \\
        [--finetuned=best|last]

Every format passes through one in-memory form, `Pretrained` (`bert_jax.formats.common`). Each format
has its module, which says what it holds on disk: `bert_jax.formats.google` (TF1 checkpoints, and the
one name table), `bert_jax.formats.hf` (safetensors, Flax msgpack, torch .bin) and
`bert_jax.formats.native` (our export directory and training workdirs). This module detects the
format, reads and writes any of them, fetches Google's release archives, and is the CLI; it
re-exports none of the formats' names (import `unrolled`, `to_hf`, ... from their modules).

Encoder-only checkpoints report the missing heads; variables we have no place for (optimizer slots,
`global_step`, HF's `position_ids` buffer, a fine-tuning head nothing describes) are listed and
skipped. A fine-tuned model (a fine-tuning workdir with its `task.json`, or an export of one) keeps
its task head: `Pretrained.task` says what it is, and each format writes it under its own names
(transformers' task classes, google-research/bert's `run_classifier.py`/`run_squad.py` names).
tensorflow is imported only to read or write a Google checkpoint. A ModernBERT pretraining workdir
(`modernbert_config.json`) is exported by `export_modernbert` to transformers' format only
(`bert_jax.formats.modernbert_hf`).
"""

from __future__ import annotations

import functools
import json
import logging as std_logging
import os
from typing import Optional, Sequence

import numpy as np
from absl import logging

from bert_jax import layout
from bert_jax.formats.common import FINETUNED, FORMATS, Pretrained, _require
from bert_jax.formats.google import _google_prefix, load_google, read_google_config, save_google
from bert_jax.formats.hf import _HF_WEIGHTS, _read_hf_config, load_hf, save_hf
from bert_jax.formats.native import _bert_jax_source, load_bert_jax, save_bert_jax
from bert_jax.model.model_config import DEFAULT_GOOGLE_GELU, GOOGLE_GELUS, BertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths, staging as storage_staging


# ---------------------------------------------------------------------------------------------
# Format detection and loading
# ---------------------------------------------------------------------------------------------


def detect_format(path: str) -> str:
    """"bert_jax", "google" or "hf" from the files at `path` (local or gs://); a clear error otherwise."""
    is_dir = storage.isdir(path)
    if is_dir and storage.isfile(storage_paths.join(path, "config.json")) \
            and any(storage.exists(storage_paths.join(path, w)) for w in _HF_WEIGHTS):
        return "hf"
    if _google_prefix(path):
        return "google"
    if is_dir and _bert_jax_source(path):
        return "bert_jax"
    if not storage.exists(path) and not storage.exists(path + ".index"):
        raise FileNotFoundError(f"checkpoint {path}: no such file or directory")
    found = storage.listdir(path)[:20] if is_dir else [storage_paths.basename(path)]
    raise ValueError(
        f"checkpoint {path}: format not recognized (found {found}). Expected a Google TF1 checkpoint "
        f"(bert_model.ckpt.index + bert_config.json), a HuggingFace directory (config.json + "
        f"model.safetensors or flax_model.msgpack) or a bert_jax directory (params/ or checkpoints/ + "
        f"bert_config.json)")


def _is_download(source: str) -> bool:
    """An http(s):// URL, or a file:// URL of a .zip (a release archive on disk): what `fetch`
    downloads. Every other source (a local path, gs://) is a storage path."""
    s = storage_paths.scheme(source)
    return s in storage_paths.URL_SCHEMES or (source.lower().startswith("file://") and source.lower().endswith(".zip"))


def fetch(source: str, cache_dir: str) -> str:
    """A checkpoint directory for `source`: a path, local or gs:// (returned as is), or a URL of a
    .zip such as Google's releases
    (`https://storage.googleapis.com/bert_models/2020_02_20/uncased_L-4_H-256_A-4.zip`), downloaded
    into `cache_dir` once, unpacked, and the folder holding its files returned (named after the
    archive, so that casing detection by name works)."""
    import urllib.parse
    import urllib.request
    import zipfile

    if not _is_download(source):
        return storage_paths.check(source, "checkpoint")
    name = os.path.basename(urllib.parse.urlparse(source).path)
    if not name.endswith(".zip"):
        raise ValueError(f"{source}: only .zip archives are fetched (Google's checkpoint releases)")
    target = storage_paths.join(cache_dir, name[: -len(".zip")])
    if not storage.isdir(target):
        storage.makedirs(cache_dir)
        archive = target + ".zip.part"
        from tqdm import tqdm
        with urllib.request.urlopen(source) as response, storage.open(archive, "wb") as f:  # noqa: S310
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=name) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        tmp = target + ".tmp"
        storage.rmtree(tmp)
        with zipfile.ZipFile(storage_staging.local_copy(archive)) as z:  # storage: local (storage_staging.local_copy)
            for member in z.namelist():  # no absolute paths or ".." in an archive we unpack
                if member.startswith("/") or ".." in member.split("/"):
                    raise ValueError(f"{source}: unsafe path {member!r} in the archive")
            with storage_staging.writing_dir(tmp) as local:  # the folder itself, or staging uploaded at the end
                z.extractall(local)
        storage.remove(archive)
        storage.rename(tmp, target)
    configs = sorted(storage.glob(storage_paths.join(target, "**", "bert_config.json"))
                     + storage.glob(storage_paths.join(target, "**", "config.json")))
    if not configs:
        raise ValueError(f"{source}: the archive holds no bert_config.json or config.json")
    return storage_paths.dirname(min(configs, key=len))  # the 2018 releases have their own top folder


def _check_google_gelu(google_gelu: Optional[str]) -> None:
    """A bad value is an error whatever the format (only Google's reads it)."""
    if google_gelu is not None and google_gelu not in GOOGLE_GELUS:
        raise ValueError(f"google_gelu must be one of {tuple(GOOGLE_GELUS)}, got {google_gelu!r}")


def _checkpoint_path(path) -> str:
    """A checkpoint path as given, `~` expanded when local; refused (naming it) when no backend
    reads it (an unknown scheme, gs:// without gcsfs, a `gs:` folder)."""
    path = storage_paths.check(os.fspath(path), "checkpoint")
    return path if storage_paths.is_remote(path) else os.path.expanduser(path)


def load_pretrained(path: str, format: Optional[str] = None, *,  # pylint: disable=redefined-builtin
                    google_gelu: Optional[str] = None, finetuned: Optional[str] = None) -> Pretrained:
    """Reads a checkpoint in any supported format (detected from its files when `format` is None).

    `google_gelu` says what a Google checkpoint's `hidden_act="gelu"` is: "erf" (default: the 2018
    releases) or "tanh" (trained with google-research/bert code of 2019-02-07 or later); HF and
    bert_jax checkpoints name their GELU exactly and ignore it.

    `finetuned` picks the parameters of a fine-tuning workdir: "best" (its best epoch, `best/`) or
    "last" (its last state, `checkpoints/`); None: the best epoch when there is one, else the last
    state. A fine-tuned model comes with its head (`params["head"]`) and `task` (its `task.json`).
    """
    _check_google_gelu(google_gelu)
    if finetuned is not None and finetuned not in FINETUNED:
        raise ValueError(f"finetuned must be one of {FINETUNED}, got {finetuned!r}")
    path = _checkpoint_path(path)
    format = format or detect_format(path)
    loaders = {"google": functools.partial(load_google, google_gelu=google_gelu), "hf": load_hf,
               "bert_jax": functools.partial(load_bert_jax, finetuned=finetuned)}
    if format not in loaders:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if finetuned is not None and format != "bert_jax":
        raise ValueError(f"{path} is a {format} checkpoint, one set of parameters: finetuned={finetuned!r} "
                         f"picks between a fine-tuning workdir's best/ and checkpoints/")
    pretrained = loaders[format](path)
    if pretrained.missing:
        logging.info("%s: no %s head(s) in the checkpoint", path, ", ".join(pretrained.missing))
    if pretrained.skipped:
        logging.info("%s: skipped %d variable(s) with no place in BERT: %s", path, len(pretrained.skipped),
                     ", ".join(pretrained.skipped[:10]) + (" ..." if len(pretrained.skipped) > 10 else ""))
    return pretrained


def load_finetuned(path: str, which: Optional[str] = "best") -> Pretrained:
    """A fine-tuned model: the encoder, its task head (`params["head"]`) and `task` (its `task.json`:
    task, head kind, num_outputs, labels, max_seq_length), for `bert_jax.finetune.heads.BertForTask`.

    `path` is a fine-tuning workdir, whose parameters `which` picks: "best" (the best epoch,
    `W/best/`; an error naming "last" when the run kept none) or "last" (`W/checkpoints/`); or,
    with `which=None`, any checkpoint with a task head (an export, an HF task class). A checkpoint
    without one is a ValueError.

        p = convert.load_finetuned(workdir, which="best")
        model = heads.BertForTask(config, p.task["head"], p.task["num_outputs"])
        model.apply({"params": convert.model_params(p, config)}, input_ids, input_mask, segment_ids)
    """
    pretrained = load_pretrained(path, finetuned=which)
    if pretrained.task_head is None:
        raise ValueError(f"{path} is not a fine-tuned model: no task head with a task.json saying what it is "
                         f"(a workdir fine-tuned before bert_jax wrote task.json: fine-tune it again)")
    return pretrained


def load_config(path: str, format: Optional[str] = None, *,  # pylint: disable=redefined-builtin
                google_gelu: Optional[str] = None, **overrides) -> BertConfig:
    """Only the `BertConfig` of a checkpoint in any format (no weights are read); `google_gelu` as
    in `load_pretrained`."""
    _check_google_gelu(google_gelu)
    path = _checkpoint_path(path)
    format = format or detect_format(path)
    if format == "google":
        config = read_google_config(storage_paths.join(storage_paths.dirname(_google_prefix(path)), "bert_config.json"),
                                    google_gelu)
    elif format == "hf":
        config = _read_hf_config(path)
    else:
        config = BertConfig.from_json_file(_require(storage_paths.join(path, layout.MODEL_CONFIG), layout.MODEL_CONFIG))
    return config.replace(**overrides) if overrides else config


def model_params(pretrained: Pretrained, config: Optional[BertConfig] = None, *, heads: bool = True) -> dict:
    """The parameters as the model with `config` (default: the checkpoint's) wants them: cast to
    its `param_dtype`, layers stacked when it scans; heads dropped when `heads=False`.

    A fine-tuned checkpoint's parameters (`{"bert", "head"}`) are `bert_jax.finetune.heads.BertForTask`'s, e.g.
    `BertForTask(config, p.task["head"], p.task["num_outputs"]).apply({"params": model_params(p, config)}, ...)`.
    """
    import jax
    from bert_jax.model import modeling

    config = config or pretrained.config
    params = {k: v for k, v in pretrained.params.items() if heads or k == "bert"}
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, config.param_dtype), params)
    if config.scan_layers:
        params = modeling.stack_layers(params, config.num_hidden_layers)
        params = jax.tree_util.tree_map(np.asarray, params)
    return params


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def save_pretrained(p: Pretrained, path: str, format: str, *, overwrite: bool = False) -> str:  # pylint: disable=redefined-builtin
    savers = {"google": save_google, "hf": save_hf, "bert_jax": save_bert_jax}
    if format not in savers:
        raise ValueError(f"output format must be one of {FORMATS}, got {format!r}")
    return savers[format](p, path, overwrite=overwrite)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


class _NotOrbaxInfo(std_logging.Filter):
    """Keeps orbax's warnings and errors, drops its per-read INFO lines (throughput, handlers)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bert_jax.convert",
        description="Convert BERT checkpoints between Google TF1, HuggingFace and bert_jax formats.")
    parser.add_argument("--input", required=True, help="checkpoint directory (or TF checkpoint prefix)")
    parser.add_argument("--input_format", choices=FORMATS, default=None, help="default: detected")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--output_format", choices=FORMATS, required=True)
    parser.add_argument("--vocab_file", default=None, help="vocab.txt when the input has none next to it")
    parser.add_argument("--do_lower_case", choices=("true", "false"), default=None,
                        help="casing to record (default: the input's, when it says)")
    parser.add_argument("--drop_heads", action="store_true",
                        help="write the encoder only (no MLM/NSP heads, no fine-tuning head)")
    parser.add_argument("--finetuned", choices=FINETUNED, default=None,
                        help="which parameters of a fine-tuning workdir: 'best' (its best epoch, best/) or "
                             "'last' (its last state, checkpoints/); default: best when it has one, else last")
    parser.add_argument("--google_gelu", choices=tuple(GOOGLE_GELUS), default=None,
                        help=f"what a Google checkpoint's hidden_act='gelu' is: 'erf' (default "
                             f"{DEFAULT_GOOGLE_GELU!r}: the 2018 releases) or 'tanh' (trained with "
                             f"google-research/bert code of 2019-02-07 or later); see docs/checkpoints.md")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    args = parser.parse_args(argv)
    storage_paths.check(args.input, "--input")  # before anything runs: no local folder named "gs:"
    storage_paths.check(args.output, "--output")
    if args.vocab_file:
        storage_paths.check(args.vocab_file, "--vocab_file")
    logging.set_verbosity(logging.INFO)  # ours: missing heads, skipped variables; not orbax's chatter
    logging.get_absl_logger().addFilter(_NotOrbaxInfo())
    std_logging.getLogger("bert_jax").setLevel(std_logging.INFO)  # e.g. the Google GELU chosen
    if not std_logging.getLogger().handlers:
        std_logging.basicConfig()
    from bert_jax.formats import modernbert_hf
    if modernbert_hf.is_workdir(args.input):
        return export_modernbert(args)
    p = load_pretrained(args.input, args.input_format, google_gelu=args.google_gelu, finetuned=args.finetuned)
    if args.vocab_file:
        p.vocab_file = _require(args.vocab_file, "--vocab_file")
    if args.do_lower_case is not None:
        p.do_lower_case = args.do_lower_case == "true"
    if args.drop_heads:
        p.params, p.task = {"bert": p.params["bert"]}, None
    if p.vocab_file:
        with storage.open(p.vocab_file, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > p.config.vocab_size:
            raise ValueError(f"{p.vocab_file} has {n} tokens but the model's vocab_size is only "
                             f"{p.config.vocab_size}: is it the model's vocabulary?")
        if n == 0:
            raise ValueError(f"{p.vocab_file} is empty: pass the model's vocab.txt with --vocab_file")
    save_pretrained(p, args.output, args.output_format, overwrite=args.overwrite)
    from bert_jax.model.modeling import count_params
    print(json.dumps({"input": args.input, "input_format": p.format, "output": args.output,
                      "output_format": args.output_format, "hidden_act": p.config.hidden_act,
                      "parameters": count_params(p.params),
                      "heads": list(p.heads), "missing_heads": list(p.missing),
                      "task_head": p.task_head, "task": p.task if p.task_head else None,
                      "finetuned": p.finetuned, "skipped": list(p.skipped)}, indent=2))
    return 0


def export_modernbert(args) -> int:
    """A ModernBERT pretraining workdir (`modernbert_config.json`) -> transformers' `config.json` +
    `model.safetensors` (`ModernBertForMaskedLM`) and the workdir's vocab.txt or tokenizer.json; only `--output_format=hf`."""
    from bert_jax.formats import modernbert_hf
    if storage.isfile(storage_paths.join(args.input, layout.TASK_FILE)):  # bert_jax/finetune/modernbert_tasks.py
        raise ValueError(f"{args.input} is a ModernBERT fine-tuning workdir: its best epoch is already in "
                         f"transformers' format, {storage_paths.join(args.input, layout.TRANSFORMERS)}")
    if args.output_format != "hf":
        raise ValueError(f"--output_format={args.output_format}: a ModernBERT workdir ({args.input}) exports to "
                         "transformers' format only (--output_format=hf)")
    for flag in ("input_format", "finetuned", "google_gelu", "do_lower_case"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag}: does not apply to a ModernBERT pretraining workdir ({args.input})")
    if args.drop_heads:
        raise ValueError("--drop_heads: a ModernBERT export is transformers' ModernBertForMaskedLM, head included")
    if not args.overwrite and storage.isdir(args.output) and storage.listdir(args.output):
        raise ValueError(f"--output={args.output} is not empty (pass --overwrite to write into it)")
    config, params, step = modernbert_hf.load_workdir(args.input)
    modernbert_hf.save(args.output, config, params)
    for name, source in ((layout.VOCAB, args.vocab_file or storage_paths.join(args.input, layout.VOCAB)),
                         (layout.TOKENIZER_JSON, storage_paths.join(args.input, layout.TOKENIZER_JSON)),
                         (layout.TOKENIZER_CONFIG, storage_paths.join(args.input, layout.TOKENIZER_CONFIG))):
        if storage.isfile(source):  # the vocabulary (or tokenizer.json) the records were made with, and its casing
            storage.copy(source, storage_paths.join(args.output, name))
    from bert_jax.model.modeling import count_params
    print(json.dumps({"input": args.input, "input_format": "bert_jax (ModernBERT workdir)", "step": step,
                      "output": args.output, "output_format": "hf", "model_type": "modernbert",
                      "parameters": count_params(params)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
