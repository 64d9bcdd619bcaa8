"""Hosts agreeing on a checkpoint's verdicts: whether a step is intact, whether its restore failed.

Several hosts agree on every verdict: a step is intact only if every host verified it, and a
restore that fails on one host (a read error, missing input state) fails on all of them, with the
same error, so they all fall back to the same step; no host resumes alone and none waits forever
(`Checkpointer` restores through orbax's handlers, which hold no barrier a failing host would
skip). Each exchange names the step it is about, and a host that is sent another step's finding
raises `CheckpointRestoreError` naming both steps rather than combine them.

`HostAgreement` only exchanges and combines findings; `restorer.Restorer` (a restore) and
`checkpointer.Checkpointer` make them (verifying, reading) and act on the combined one. One
process: every exchange is the host's own finding, and nothing is sent.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import jax
import orbax.checkpoint as ocp

from bert_jax.checkpoints import integrity
from bert_jax.checkpoints.step_dirs import STATE, CheckpointCorruptError, CheckpointRestoreError

# How long a host waits for the others' findings or at a barrier: a slow host may be verifying or
# reading a large step. A host that died ends the wait sooner (jax's coordination service reports
# it to every process).
AGREEMENT_TIMEOUT_S = 3600

# A step's verification, as exchanged: its index in this tuple.
_STATUSES = ("ok", "unverified", "damaged")


class HostAgreement:
    """The exchanges of one checkpoint directory's hosts; every host makes the same calls in the same order.

    Args:
        directory: the checkpoint directory, which names the exchanges (two `Checkpointer`s of one
            process never share a key) and the messages.
        process_index, process_count: this host and how many there are; default `jax.process_index()`
            and `jax.process_count()` (tests pass them to play several hosts in one process).
    """

    def __init__(self, directory: str, process_index: Optional[int] = None, process_count: Optional[int] = None):
        self._directory = directory
        self._process_index = jax.process_index() if process_index is None else process_index
        self._process_count = jax.process_count() if process_count is None else process_count
        self._exchanges = 0  # how many exchanges and barriers so far: the same on every host

    def _key(self, what: str) -> str:
        """A key no earlier exchange of this directory's agreement (or another one's) used; the same on every host."""
        self._exchanges += 1
        digest = hashlib.sha256(self._directory.encode()).hexdigest()[:12]
        return f"bert_jax_checkpointing/{digest}/{self._exchanges}/{what}"

    def all_hosts(self, step: int, what: str, code: int, text: str) -> list[tuple[int, str]]:
        """Every host's (code, text) about `step`, in host order: the same list on every host.

        Through the key-value store of jax's coordination service, not a collective: no device
        program, and no collective's short timeout (gloo's 30 s on CPU) for a host that is slower
        to verify or read. Each host publishes its finding under a key naming the step,
        `<exchange>/step_<step>/<host>`, then the step it is at under `<exchange>/step/<host>`;
        every host reads each host's step first, so hosts whose exchanges drifted apart (one
        verifying a step another skipped) can never combine findings about different steps.

        Raises:
            CheckpointRestoreError: a host is at another step in this exchange (a bug: every host
                must make the same calls in the same order), naming both steps.
        """
        if self._process_count == 1:
            return [(code, text)]
        client = ocp.multihost.get_jax_distributed_client()
        key = self._key(what)
        client.key_value_set(f"{key}/step_{step}/{self._process_index}", json.dumps([code, text]))
        client.key_value_set(f"{key}/step/{self._process_index}", str(step))
        verdicts = []
        for i in range(self._process_count):
            theirs = int(client.blocking_key_value_get(f"{key}/step/{i}", AGREEMENT_TIMEOUT_S * 1000))
            if theirs != step:
                raise CheckpointRestoreError(
                    f"checkpointing: host {self._process_index} exchanged its {what} about step {step} of "
                    f"{self._directory} with host {i}, which sent its {what} about step {theirs} ({key}): the "
                    f"hosts' checkpoint calls went out of step (a bug); not combining them")
            verdicts.append(tuple(json.loads(client.blocking_key_value_get(f"{key}/step_{step}/{i}",
                                                                           AGREEMENT_TIMEOUT_S * 1000))))
        return verdicts

    def barrier(self, what: str) -> None:
        """Every host waits until all got here (the coordination service's barrier, not a collective).

        One process: returns at once.
        """
        if self._process_count == 1:
            return
        ocp.multihost.sync_global_processes(self._key(what), timeout=AGREEMENT_TIMEOUT_S,
                                            processes=set(range(self._process_count)))

    def verdict(self, step: int, status: str, damage: Optional[integrity.Damage]
                ) -> tuple[str, Optional[integrity.Damage]]:
        """A step's verification ("ok" | "unverified" | "damaged", damage), combined over hosts:
        damaged when any host found damage (the first such host's finding, everywhere), else
        unverified when any host could not verify."""
        text = f"{damage.file}\0{damage.problem}" if damage is not None else ""
        verdicts = self.all_hosts(step, "verdicts", _STATUSES.index(status), text)
        for host, (code, found) in enumerate(verdicts):
            if _STATUSES[code] == "damaged":
                if host == self._process_index:
                    return status, damage
                file, problem = found.split("\0", 1)
                return "damaged", integrity.Damage(file, f"{problem} (found by host {host})")
        return ("unverified" if any(_STATUSES[c] == "unverified" for c, _ in verdicts) else "ok"), None

    def failure(self, step: int, failure: Optional[CheckpointRestoreError]) -> Optional[CheckpointRestoreError]:
        """A restore's outcome, combined over hosts: if any host's read failed, every host gets a
        failure (its own, or the first failing host's), corrupt ones first, so all fall back."""
        code = 0 if failure is None else 2 if isinstance(failure, CheckpointCorruptError) else 1
        verdicts = self.all_hosts(step, "restores", code, "" if failure is None else str(failure))
        worst = max(c for c, _ in verdicts)
        if worst == 0 or code == worst:
            return failure
        host, text = next((h, t) for h, (c, t) in enumerate(verdicts) if c == worst)
        message = f"host {host}: {text}"
        if worst == 1:
            return CheckpointRestoreError(message)
        error = CheckpointCorruptError(message)
        error.step = step
        error.damage = integrity.Damage(STATE, f"host {host} could not restore it: {text[:300]}")
        return error
