"""Fine-tuning the ModernBERT encoder (`config.model_family="modernbert"`) through the one loop.

    python -m bert_jax.main --config=configs/glue.py --config.task=sst2 --config.data_dir=DIR \\
        --config.model_family=modernbert --config.init_checkpoint=HF_MODERNBERT_DIR \\
        --workdir=W    # ModernBERT's tokenizer.json from HF_MODERNBERT_DIR (or --config.vocab_file=VOCAB_TXT)

What differs from BERT's fine-tuning, and only that, lives here; the loop, its batches, packing,
evaluation, seeds and checkpoints are BERT's (`bert_jax.finetune.loop`):

* the model: `TaskModel`, transformers' task classes (`bert_jax.model.modernbert.ModernBertForTask`)
  behind `BertForTask`'s call and outputs. A task family's head kind maps to transformers' (`KINDS`):
  classification and regression are `ModernBertForSequenceClassification` (regression: one output),
  span is `...ForQuestionAnswering`, token `...ForTokenClassification`, multiple choice
  `...ForMultipleChoice`. Sentence pairs are `[CLS] a [SEP] b [SEP]` as BERT's featurization writes
  them; ModernBERT has no token types, so `segment_ids` are not read (transformers has none either).
  Packed rows (`config.packing`): attention stays within each sequence and positions restart at each
  (`pack_ids`), and the sequence head reads each sequence's `[CLS]` (`cls_positions`);
* the init checkpoint: a transformers ModernBERT folder (`config.json` + `model.safetensors`,
  `bert_jax.formats.modernbert_hf`); its config decides the architecture. Its encoder (`model`) and
  prediction head (`head`: dense, activation, norm) are loaded as transformers loads them into a task
  class; the `classifier` starts fresh, drawn as transformers draws it. `config.model`'s `dtype`,
  `attention_impl` and `local_blocks` apply, and `mixed_matmuls` as `config.cpu_bf16` decides on this
  backend (as BERT's: bf16 matmuls with float32 outputs on a CPU where they pay; the decision recorded in
  the workdir); without an init checkpoint `config.model` holds `ModernBertConfig`'s fields
  (`bert_jax.training.run_setup.modernbert_config_from`);
* the vocabulary: ModernBERT's own BPE `tokenizer.json` (`config.tokenizer_json`, else the checkpoint
  folder's when it has no `vocab.txt`; `data_pipeline.tasks.tokenizer_json`: the file's `[CLS]`,
  `[SEP]` and `[PAD]` ids, SQuAD answers from character offsets), or a WordPiece `vocab.txt`
  (`config.vocab_file`, or the checkpoint folder's);
* the export: after each epoch that improves on the best, `W/transformers/` holds the model in
  transformers' format (`config.json` naming the task class, with `num_labels`, `id2label` and
  `label2id`; `model.safetensors`; the `tokenizer.json` with a `tokenizer_config.json` naming its
  special tokens, which `transformers.AutoTokenizer` loads, or `vocab.txt` with the casing), which
  `transformers.AutoModelForSequenceClassification` (etc.) loads;
* BERT-only options are refused by name (`check_config`: FP8, the Pallas kernels, scanned layers,
  remat, Google's GELU, `head_init="normal"`);
* the mesh: `init_params` boxes the parameters with their logical axis names
  (`bert_jax.model.modernbert_axes`), so `config.mesh`'s fsdp and tensor sizes split them and the
  optimizer state as they split BERT's (the state's shardings, `mode=predict`'s too).

`mode=predict` reads the best epoch from `W/transformers/` (`finetuned`; `task.json` says
`"model_family": "modernbert"`); `bert_jax.convert --input=W` points to `W/transformers/`. The workdir's
`modernbert_config.json` is `bert_jax.workdir.write_model_files`' (as a ModernBERT pretraining run's).
This module must not import tensorflow.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from bert_jax import layout, workdir as workdir_files
from bert_jax.finetune import heads
from bert_jax.formats import modernbert_hf
from bert_jax.formats.common import tokenizer_config_json
from bert_jax.model import modernbert_axes
from bert_jax.model.modernbert import ModernBertConfig, ModernBertForTask
from bert_jax.training import run_setup
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import tokenizer_json

FAMILIES = ("bert", "modernbert")
# The loop's head kinds (data_pipeline.tasks.HEAD_KINDS) -> ModernBertForTask's (transformers' classes).
KINDS = {"classification": "sequence", "regression": "sequence", "span": "span", "token": "token",
         "multiple_choice": "multiple_choice"}
# config.model's fields that ModernBERT takes from the run, not from the checkpoint (transformers has no key).
RUN_FIELDS = modernbert_hf.OWN_FIELDS
# BERT's model options with no ModernBERT meaning: refused when set (truthy).
BERT_ONLY = ("fp8", "fused_ops", "fused_ffn", "fused_qkv", "separate_qkv", "scan_layers", "causal_attention")
# The parameters an init checkpoint gives a task model (transformers loads the same into its task classes).
PRETRAINED_PARTS = ("model", "head")


def wanted(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` fine-tunes ModernBERT; ValueError naming `config.model_family` otherwise than the two."""
    family = config.get("model_family", "bert")
    if family not in FAMILIES:
        raise ValueError(f"config.model_family={family!r}: one of {FAMILIES}")
    return family == "modernbert"


def is_model(model_config) -> bool:
    """Whether a model config (the loop's `bert_config`) is ModernBERT's."""
    return isinstance(model_config, ModernBertConfig)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Refuses (ValueError naming the field) the BERT-only options of a ModernBERT run."""
    model = config.model.to_dict()
    for key in BERT_ONLY:
        if model.get(key):
            raise ValueError(f"config.model.{key}={model[key]!r} is a BERT option (bert_jax.model.modeling); "
                             "it does not apply to config.model_family=modernbert: set it to False")
    if model.get("remat_policy", "none") != "none":
        raise ValueError(f"config.model.remat_policy={model['remat_policy']!r} is a BERT option; "
                         "config.model_family=modernbert has no remat: set it to 'none'")
    if config.get("google_gelu"):
        raise ValueError(f"config.google_gelu={config.google_gelu!r} reads Google's BERT checkpoints; "
                         "config.model_family=modernbert reads transformers' ModernBERT: leave it unset")
    if config.get("head_init", "truncated_normal") != "truncated_normal":
        raise ValueError(f"config.head_init={config.head_init!r} draws BERT's head; ModernBERT's classifier is "
                         "drawn as transformers draws it: leave config.head_init at 'truncated_normal'")


def vocabulary(config: ml_collections.ConfigDict) -> str:
    """`config.tokenizer_json` or `config.vocab_file` (both set: refused by name), "" for neither."""
    tokenizer_json, vocab_file = config.get("tokenizer_json", ""), config.vocab_file
    if tokenizer_json and vocab_file:
        raise ValueError(f"config.tokenizer_json={tokenizer_json} and config.vocab_file={vocab_file}: set one")
    if tokenizer_json and not tokenizer_json.endswith(".json"):
        raise ValueError(f"config.tokenizer_json={tokenizer_json}: a HuggingFace tokenizer.json (a .json file)")
    if tokenizer_json and not storage.isfile(tokenizer_json):
        raise FileNotFoundError(f"config.tokenizer_json={tokenizer_json} does not exist")
    return tokenizer_json or vocab_file


def load(config: ml_collections.ConfigDict,
         workdir: Optional[str] = None) -> tuple[ModernBertConfig, Optional[dict], str, Optional[bool]]:
    """(model config, the init checkpoint's `{"model", "head"}` parameters or None, vocabulary (a
    tokenizer.json or a vocab.txt), casing or None) of a ModernBERT run; `workdir` keeps
    `config.cpu_bf16`'s decision for a resumed run."""
    check_config(config)
    init = config.get("init_checkpoint", "")
    vocab_file, do_lower_case = vocabulary(config), config.do_lower_case
    if not init:
        logging.warning("config.init_checkpoint is empty: the encoder starts from a random initialization")
        return run_setup.modernbert_config_from(config, workdir), None, vocab_file, do_lower_case
    model = config.model.to_dict()
    ours = {k: model[k] for k in RUN_FIELDS if k in model}
    try:
        mb_config, params, task = modernbert_hf.load(init, **ours)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"config.init_checkpoint={init}: not a transformers ModernBERT folder "
                         f"(config.model_family=modernbert): {e}") from e
    if task is not None:
        logging.info("config.init_checkpoint is a fine-tuned %s: its classifier is not used", task["kind"])
    mb_config = run_setup.modernbert_cpu_bf16(config, mb_config, workdir)
    if not vocab_file:  # the folder's vocab.txt, else its tokenizer.json
        vocab_file = next((p for p in (storage_paths.join(init, n) for n in (layout.VOCAB, layout.TOKENIZER_JSON))
                           if storage.isfile(p)), "")
    return mb_config, {k: params[k] for k in PRETRAINED_PARTS}, vocab_file, do_lower_case


class TaskModel(nn.Module):
    """`ModernBertForTask` (its parameters at the top: `model`, `head`, `classifier`, transformers'
    tree) called as `heads.BertForTask` is, with its outputs: {"logits"} ([batch(, slots), classes];
    [batch(, slots)] for regression; [batch, length, classes] for tokens; [batch, choices]) or
    {"start_logits", "end_logits"} ([batch, length])."""

    config: ModernBertConfig
    head: str
    num_outputs: int

    def setup(self):
        if self.head not in KINDS:
            raise ValueError(f"head must be one of {tuple(KINDS)}, got {self.head!r}")
        width = {"span": 2, "multiple_choice": 1}.get(self.head, self.num_outputs)
        self.task = ModernBertForTask(self.config, KINDS[self.head], width)
        nn.share_scope(self, self.task)

    def __call__(self, input_ids, input_mask, segment_ids, position_ids=None, pack_ids=None,
                 cls_positions=None, *, deterministic: bool = True) -> dict:
        # No token types in ModernBERT; positions restart at each packed sequence from pack_ids alone.
        del segment_ids, position_ids
        if pack_ids is not None and self.head not in heads.PACKED_HEADS:
            raise ValueError(f"packed rows are for the {heads.PACKED_HEADS} heads, not {self.head!r}")
        logits = self.task(input_ids, input_mask, pack_ids, deterministic,
                           cls_positions if self.head in ("classification", "regression") else None)
        if self.head == "span":  # [batch, length, 2] -> two [batch, length]
            return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}
        return {"logits": logits[..., 0] if self.head == "regression" else logits}


def init_params(model: nn.Module, rng: jax.Array, *inputs) -> dict:
    """`model.init`'s parameters (a `TaskModel` or BERT's `heads.BertForTask`); a `TaskModel`'s boxed with
    their logical axis names (`modernbert_axes`), as BERT's modules create theirs."""
    params = model.init(rng, *inputs)["params"]
    return modernbert_axes.with_logical_axes(params) if isinstance(model, TaskModel) else params


def finetuned(workdir: str, which: str, config: ml_collections.ConfigDict) -> tuple:
    """(model config, parameters, vocab file, casing) of a ModernBERT fine-tuning run for `mode=predict`:
    its best epoch, `W/transformers/` (`config.predict_params="last"` is refused: the last state is an
    orbax checkpoint of the loop, read back only by a resumed run)."""
    if which != "best":
        raise ValueError(f"config.predict_params={which!r}: a ModernBERT run ({workdir}) predicts with its best "
                         f"epoch, {layout.TRANSFORMERS}/ (config.predict_params='best')")
    directory = storage_paths.join(workdir, layout.TRANSFORMERS)
    model = config.model.to_dict()
    mb_config, params, exported = modernbert_hf.load(directory, **{k: model[k] for k in RUN_FIELDS if k in model})
    if exported is None:
        raise ValueError(f"{directory}: a ModernBERT masked LM, not a fine-tuned task model")
    mb_config = run_setup.modernbert_cpu_bf16(config, mb_config)
    vocab_file = vocabulary(config) or next(
        (p for p in (storage_paths.join(directory, n) for n in (layout.VOCAB, layout.TOKENIZER_JSON))
         if storage.isfile(p)), "")
    if not storage.isfile(vocab_file):
        raise FileNotFoundError(f"{directory}: no vocab.txt or tokenizer.json (set config.vocab_file or "
                                "config.tokenizer_json)")
    if tokenizer_json.is_tokenizer_json(vocab_file):
        return mb_config, params, vocab_file, None  # the file's normalizer decides the casing
    do_lower_case = config.do_lower_case
    if do_lower_case is None:
        path = storage_paths.join(directory, layout.TOKENIZER_CONFIG)
        do_lower_case = json.loads(storage.read_text(path)).get("do_lower_case") if storage.isfile(path) else None
    if do_lower_case is None:
        raise ValueError(f"{directory}: no tokenizer_config.json to say the casing (set config.do_lower_case)")
    return mb_config, params, vocab_file, bool(do_lower_case)


def export_task(description: dict) -> dict:
    """`bert_jax.formats.modernbert_hf.save`'s task from the loop's `task_description`."""
    return {"kind": KINDS[description["head"]], "num_outputs": int(description["num_outputs"]),
            "labels": list(description["labels"])}


def hf_tokenizer_config(path: str) -> str:
    """`tokenizer_config.json`'s text for the tokenizer.json at `path`: its special tokens, with which
    `transformers.AutoTokenizer` loads it as ModernBERT's (a `PreTrainedTokenizerFast`, no token types)."""
    tokenizer = tokenizer_json.TaskTokenizer(path).hf
    specials = {f"{role}_token": getattr(tokenizer, f"{role}_token") for role in ("cls", "sep", "pad", "mask", "unk")}
    return json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
                       "model_input_names": ["input_ids", "attention_mask"],
                       **{k: v for k, v in specials.items() if v is not None}}, indent=2) + "\n"


def _tokenizer_files(directory: str, vocab_file: str, do_lower_case: Optional[bool]) -> None:
    if tokenizer_json.is_tokenizer_json(vocab_file):  # ModernBERT's own: tokenizer.json, its specials named
        workdir_files.write_if_changed(storage_paths.join(directory, layout.TOKENIZER_JSON),
                                       storage.read_bytes(vocab_file))
        workdir_files.write_if_changed(storage_paths.join(directory, layout.TOKENIZER_CONFIG),
                                       hf_tokenizer_config(vocab_file).encode())
        return
    if vocab_file:
        workdir_files.write_if_changed(storage_paths.join(directory, layout.VOCAB), storage.read_bytes(vocab_file))
    if do_lower_case is not None:
        workdir_files.write_if_changed(storage_paths.join(directory, layout.TOKENIZER_CONFIG),
                                       tokenizer_config_json(do_lower_case).encode())


def export(workdir: str, mb_config: ModernBertConfig, description: dict, params, vocab_file: str,
           do_lower_case: bool) -> str:
    """`params` (the state's, on the mesh) as transformers' task model in `W/transformers/` (replacing what
    was there); every process calls it (the parameters are gathered), process 0 writes. Returns the folder."""
    host = jax.tree_util.tree_map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
    directory = storage_paths.join(workdir, layout.TRANSFORMERS)
    if jax.process_index() == 0:
        storage.rmtree(directory)
        modernbert_hf.save(directory, mb_config, host, export_task(description))
        _tokenizer_files(directory, vocab_file, do_lower_case)
    return directory
