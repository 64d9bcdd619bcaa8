"""Our own format: an export directory, or a pretraining / fine-tuning workdir.

On disk: one directory with `bert_config.json` (`BertConfig.to_json_file`), `vocab.txt`,
`tokenizer_config.json` and `params/` (an orbax checkpoint of the parameter tree); a pretraining or
fine-tuning workdir (`checkpoints/<step>/state`) is read too (its newest intact step). Shapes are
checked through the Google name table.
"""

from __future__ import annotations

from typing import Optional

from bert_jax.formats.common import (HEADS, Pretrained, _maybe, _prepare_dir, _read_casing, _require,
                                     _write_tokenizer_files, unrolled)
from bert_jax.formats.google import from_google, to_google
from bert_jax.modeling import BertConfig
from data_pipeline import storage


def _step_dirs(directory: str) -> list[int]:
    if not storage.isdir(directory):
        return []
    return sorted(int(d) for d in storage.listdir(directory)
                  if d.isdigit() and storage.isdir(storage.join(directory, d, "state")))


def _bert_jax_source(path: str) -> Optional[tuple[str, str]]:
    """(kind, path): ("params", DIR/params) for an export, ("state", DIR/<step>/state) for a workdir."""
    if storage.isdir(storage.join(path, "params")):
        return "params", storage.join(path, "params")
    for ckpt_dir in (storage.join(path, "checkpoints"), path):
        steps = _step_dirs(ckpt_dir)
        if steps:
            return "state", storage.join(ckpt_dir, str(steps[-1]), "state")
    return None


def load_bert_jax(path: str) -> Pretrained:
    source = _bert_jax_source(path)
    if source is None:
        raise FileNotFoundError(f"{path}: no params/ or committed checkpoints/<step>/state")
    config = BertConfig.from_json_file(_require(storage.join(path, "bert_config.json"), "bert_config.json"))
    import orbax.checkpoint as ocp

    kind, ckpt = source
    if kind == "state":  # the newest step that passes its integrity manifest; damaged ones are named
        from bert_jax import checkpointing
        ckpt_dir = storage.dirname(storage.dirname(ckpt))
        ckpt = storage.join(ckpt_dir, str(checkpointing.newest_intact_step(ckpt_dir, _step_dirs(ckpt_dir))),
                            "state")
    with ocp.StandardCheckpointer() as checkpointer:  # orbax takes a gs:// path as it is
        tree = checkpointer.restore(storage.abspath(ckpt))
    if kind == "state":  # a TrainState: keep its params
        tree = tree["params"]
    params = unrolled(tree)
    heads = [h for h in HEADS if h in params]
    other = sorted(k for k in params if k not in ("bert",) + HEADS)
    kept = {"bert": params["bert"], **{h: params[h] for h in heads}}
    # Validate shapes (and the encoder's completeness) through the Google table.
    checked, missing, _ = from_google(to_google(kept, config), config, where=ckpt)
    del checked
    return Pretrained(config, kept, _maybe(storage.join(path, "vocab.txt")), _read_casing(path),
                      "bert_jax", missing, tuple(other))


def save_bert_jax(p: Pretrained, path: str, *, overwrite: bool = False) -> str:
    """Writes `bert_config.json` + `params/` (orbax) + `vocab.txt` + `tokenizer_config.json`."""
    import orbax.checkpoint as ocp

    _prepare_dir(path, overwrite)
    params = unrolled({k: v for k, v in p.params.items() if k in ("bert",) + HEADS})
    to_google(params, p.config)  # validates every shape against the config
    p.config.to_json_file(storage.join(path, "bert_config.json"))
    target = storage.abspath(storage.join(path, "params"))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(target, params, force=True)
        checkpointer.wait_until_finished()
    _write_tokenizer_files(p, path)
    return path
