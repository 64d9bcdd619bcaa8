"""Our own format: an export directory, or a pretraining / fine-tuning workdir.

On disk: one directory with `bert_config.json` (`BertConfig.to_json_file`), `vocab.txt`,
`tokenizer_config.json`, `params/` (an orbax checkpoint of the parameter tree) and, for a
fine-tuned model, `task.json` (what its `params["head"]` is, `common.check_task`). A pretraining
workdir (`checkpoints/<step>/state`) is read too: its newest intact step. A fine-tuning workdir
(one with `task.json`) holds two sets of parameters, its best epoch (`best/<step>/state`) and its
last state (`checkpoints/<step>/state`): `finetuned="best"|"last"` picks one, by default the best
epoch when there is one. Shapes are checked through the Google name table.
"""

from __future__ import annotations

from typing import Optional

from absl import logging

from bert_jax import layout
from bert_jax.layout import TASK_FILE
from bert_jax.formats.common import (FINETUNED, HEADS, TASK_HEAD, Pretrained, _maybe, _prepare_dir,
                                     _read_casing, _require, _write_tokenizer_files, check_head, read_task,
                                     task_of, unrolled, write_task)
from bert_jax.formats.google import from_google, to_google
from bert_jax.model.model_config import BertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths


def _step_dirs(directory: str) -> list[int]:
    if not storage.isdir(directory):
        return []
    return sorted(int(d) for d in storage.listdir(directory)
                  if d.isdigit() and storage.isdir(storage_paths.join(directory, d, "state")))


def _bert_jax_source(path: str, finetuned: Optional[str] = None) -> Optional[tuple[str, str]]:
    """(kind, directory): ("params", DIR/params) for an export; ("best", DIR/best) or ("last", the
    checkpoint directory: DIR/checkpoints or DIR itself) for a workdir, as `finetuned` asks (None:
    the best epoch of a fine-tuning workdir when it has one, else the last state). None: nothing."""
    if finetuned not in (None,) + FINETUNED:
        raise ValueError(f"finetuned must be one of {FINETUNED}, got {finetuned!r}")
    if storage.isdir(storage_paths.join(path, layout.EXPORTED_PARAMS)):
        return "params", storage_paths.join(path, layout.EXPORTED_PARAMS)
    best = storage_paths.join(path, layout.BEST)
    if finetuned == "best" or (finetuned is None and storage.isfile(storage_paths.join(path, TASK_FILE))):
        if _step_dirs(best):
            return "best", best
        if finetuned == "best":
            return None
    for ckpt_dir in (storage_paths.join(path, layout.CHECKPOINTS), path):
        if _step_dirs(ckpt_dir):
            return "last", ckpt_dir
    if finetuned is None and _step_dirs(best):  # a fine-tuning workdir whose checkpoints/ was deleted
        return "best", best
    return None


def load_bert_jax(path: str, finetuned: Optional[str] = None) -> Pretrained:
    """An export directory or a workdir (module docstring); `finetuned` ("best" or "last") picks the
    parameters of a fine-tuning workdir (default: "best" when `best/` has a step, else "last")."""
    source = _bert_jax_source(path, finetuned)
    if source is None:
        if finetuned == "best":
            raise FileNotFoundError(f"{path}: no best/<step>/state (finetuned='best'); a run whose evaluation "
                                    f"never gave a metric has none: read its last state with finetuned='last'")
        raise FileNotFoundError(f"{path}: no params/ or committed checkpoints/<step>/state")
    kind, ckpt_dir = source
    if kind == "params" and finetuned is not None:
        raise ValueError(f"{path} is an export (params/), one set of parameters: finetuned={finetuned!r} "
                         f"picks between a fine-tuning workdir's best/ and checkpoints/")
    config = BertConfig.from_json_file(_require(storage_paths.join(path, layout.MODEL_CONFIG), layout.MODEL_CONFIG))
    task = read_task(path)
    import orbax.checkpoint as ocp

    ckpt = ckpt_dir
    if kind != "params":  # the newest step that passes its integrity manifest; damaged ones are named
        from bert_jax.checkpoints import saved_state
        step = saved_state.newest_intact_step(ckpt_dir, _step_dirs(ckpt_dir))
        ckpt = storage_paths.join(ckpt_dir, str(step), "state")
        if task is not None:
            logging.info("%s: the fine-tuned parameters of %s (step %d)", path,
                         "the best epoch" if kind == "best" else "the last state", step)
    with ocp.StandardCheckpointer() as checkpointer:  # orbax takes a gs:// path as it is
        tree = checkpointer.restore(storage_paths.abspath(ckpt))
    if kind != "params":  # a TrainState, or best/'s {"params": ...}: keep the parameters
        tree = tree["params"]
    params = unrolled(tree)
    heads = [h for h in HEADS if h in params]
    kept = {"bert": params["bert"], **{h: params[h] for h in heads}}
    if task is not None:
        if TASK_HEAD not in params:
            raise ValueError(f"{path}: {TASK_FILE} names a {task['head']} head but {ckpt} holds none")
        check_head(params, task, config, ckpt)
        kept[TASK_HEAD] = params[TASK_HEAD]
    # Without task.json a "head" (a fine-tuning workdir of an older bert_jax) is reported skipped.
    other = sorted(k for k in params if k not in kept)
    # Validate shapes (and the encoder's completeness) through the Google table.
    checked, missing, _ = from_google(to_google(kept, config), config, where=ckpt)
    del checked
    return Pretrained(config, kept, _maybe(storage_paths.join(path, layout.VOCAB)), _read_casing(path),
                      "bert_jax", missing, tuple(other), task,
                      None if task is None or kind == "params" else kind)


def save_bert_jax(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `bert_config.json` + `params/` (orbax) + `vocab.txt` + `tokenizer_config.json`, and
    `task.json` for a fine-tuned model (its head is in `params/`)."""
    import orbax.checkpoint as ocp

    task = task_of(p, path)
    _prepare_dir(path, overwrite)
    params = unrolled({k: v for k, v in p.params.items() if k in ("bert",) + HEADS + (TASK_HEAD,)})
    to_google(params, p.config)  # validates every shape against the config
    p.config.to_json_file(storage_paths.join(path, layout.MODEL_CONFIG))
    target = storage_paths.abspath(storage_paths.join(path, layout.EXPORTED_PARAMS))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(target, params, force=True)
        checkpointer.wait_until_finished()
    _write_tokenizer_files(p, path)
    write_task(task, path)
    return path
