"""The library versions a checkpoint was saved with, and their check when a run resumes from it.

A training run records `installed()` in the meta of every checkpoint it saves (`pretrain.run`,
`finetune.train_and_evaluate`). On resume, `check_resume` compares the checkpoint's versions with
the installed ones before anything compiles: a pod recreated after a preemption may have installed
newer packages (an unpinned `pip install`, a new TPU VM image), and a run that silently goes on
under another jax, jaxlib, libtpu, flax or orbax-checkpoint is no longer the run it was (other
numerics, another random-bit stream, another state layout). A difference refuses the resume with
one error naming each package, unless `config.allow_version_change` is set (then a warning names
them). optax differences only warn: its state is arrays whose layout flax's TrainState and
orbax hold, not a format of optax's own. A checkpoint saved before versions were recorded resumes
with one warning.

This module reads package metadata only (`importlib.metadata`): no jax, no orbax.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Optional

from bert_jax.checkpoints.step_dirs import CheckpointRestoreError

# Every package recorded, by its distribution name (`pip install NAME==VERSION`).
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "libtpu")
# What a difference in these refuses the resume for: they compute the step or read and write the
# state. optax (the rest) only warns.
STRICT = ("jax", "jaxlib", "flax", "orbax-checkpoint", "libtpu")
# The meta key the versions are saved under.
META_KEY = "versions"
_OVERRIDE = "--config.allow_version_change=true"


class VersionMismatchError(CheckpointRestoreError):
    """A resume refused: the checkpoint was saved under other versions of a STRICT package."""


def installed() -> dict[str, Optional[str]]:
    """{package: installed version, or None when it is not installed} for every package of PACKAGES."""
    versions: dict[str, Optional[str]] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def differences(saved: dict, now: dict) -> list[str]:
    """The packages whose version differs between `saved` and `now`, in PACKAGES order.

    A package absent from `saved` (recorded by a bert_jax that did not know it) is no difference.
    """
    return [name for name in PACKAGES if name in saved and saved[name] != now.get(name)]


def _listed(names: list[str], saved: dict, now: dict) -> str:
    return ", ".join(f"{name} {saved[name]} (installed: {now.get(name)})" for name in names)


def check_resume(saved: Optional[dict], *, allow_change: bool, where: str) -> None:
    """Refuses (or, with `allow_change`, warns about) a resume under other library versions.

    Args:
        saved: the checkpoint meta's `versions` (None: saved before versions were recorded).
        allow_change: `config.allow_version_change`: warn about STRICT differences instead of raising.
        where: the checkpoint, for the messages (e.g. "checkpoint step 12 in W/checkpoints").

    Raises:
        VersionMismatchError: a STRICT package's version differs and not `allow_change`; the
            message names each package with the checkpoint's version and the installed one, and
            the override.
    """
    if saved is None:
        logging.warning("%s records no library versions (saved by an older bert_jax): resuming without "
                        "checking them", where)
        return
    now = installed()
    changed = differences(saved, now)
    strict = [name for name in changed if name in STRICT]
    lenient = [name for name in changed if name not in STRICT]
    if strict and not allow_change:
        pins = " ".join(f"{name}=={saved[name]}" for name in strict if saved[name] is not None)
        install = f"install the checkpoint's versions (pip install {pins}) and resume, or " if pins else ""
        raise VersionMismatchError(
            f"{where} was saved with other library versions than are installed: {_listed(strict, saved, now)}; "
            f"a resume under them may compute other numbers or misread the state: {install}"
            f"resume anyway with {_OVERRIDE}")
    if strict:
        logging.warning("%s was saved with other library versions: %s; resuming anyway (%s)",
                        where, _listed(strict, saved, now), _OVERRIDE[2:])
    if lenient:
        logging.warning("%s was saved with other library versions: %s (no state format of its own: resuming)",
                        where, _listed(lenient, saved, now))
