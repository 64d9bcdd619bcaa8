"""One Cloud TPU VM slice, reached through gcloud: what it is, and how to make it again.

`Slice.describe` reads the node (`gcloud compute tpus tpu-vm describe`) and, for a slice made
through a queued resource, the request (`queued-resources describe`): a `Reading` is the state, or
NOT_FOUND when gcloud's structured error says that resource does not exist, or an error that says
nothing either way (no network, no credentials, a timeout: the supervisor decides nothing on it).
NOT_FOUND is read from gcloud's error line itself, `ERROR: (gcloud.compute.tpus.tpu-vm.describe)
NOT_FOUND: Resource '.../nodes/<name>' was not found`, naming this slice: a "not found" anywhere
else in a message (a missing key file, a proxy's page) is not a deleted slice.

`spec_of` records what recreating the slice needs; `create_args` turns it back into gcloud's
create (through the queued resource when the slice was made through one); `start` starts a STOPPED
slice again. Every call is bounded in time (`calls.run`); none raises for gcloud's sake.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
from typing import Optional

from bert_jax.pod import calls

# Node states after which the VMs will not come back by themselves: recreate (delete + create).
GONE = ("PREEMPTED", "TERMINATED")
# A queued resource waiting for capacity: its node does not exist yet, and must not be recreated
# (deleting the request loses its place in the queue).
QUEUED_WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")
# A queued resource that will not give its node: delete it and queue again.
QUEUED_FAILED = ("FAILED", "SUSPENDED")
NOT_FOUND = "NOT_FOUND"
_STATUS = re.compile(r"^ERROR: \(gcloud\.[\w.-]+\) ([A-Z][A-Z_]+): (.*)$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Reading:
    """One answer of `describe`: `state` (READY, PREEMPTED, ..., NOT_FOUND), or None with `error`
    when gcloud's answer says nothing about the slice."""

    state: Optional[str]
    node: Optional[dict] = None
    error: Optional[str] = None


def status_of(stderr: str) -> Optional[tuple[str, str]]:
    """(code, message) of gcloud's structured error line (`ERROR: (gcloud.x.y) CODE: message`), if any."""
    found = _STATUS.search(stderr or "")
    return (found.group(1), found.group(2)) if found else None


def says_not_found(stderr: str, collection: str, name: str) -> bool:
    """Whether gcloud's error says the resource `.../<collection>/<name>` does not exist."""
    status = status_of(stderr)
    return bool(status and status[0] == NOT_FOUND and re.search(rf"/{collection}/{re.escape(name)}\b", status[1]))


class Slice:
    """One Cloud TPU VM slice, reached through gcloud."""

    def __init__(self, name: str, zone: str, project: str, gcloud: str = "gcloud", env: Optional[dict] = None):
        self.name, self.zone, self.project, self.gcloud, self.env = name, zone, project, gcloud, env

    def _gcloud(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return calls.run([self.gcloud, *args, f"--zone={self.zone}", f"--project={self.project}"], timeout,
                         env=self.env)

    def _describe(self, group: str, collection: str, name: str) -> Reading:
        r = self._gcloud("compute", "tpus", group, "describe", name, "--format=json", timeout=120)
        if r.returncode != 0:
            if says_not_found(r.stderr, collection, name):
                return Reading(NOT_FOUND)
            return Reading(None, error=f"gcloud {group} describe {name}: {(r.stderr or '').strip()[-500:]}")
        try:
            node = json.loads(r.stdout)
        except ValueError:
            return Reading(None, error=f"gcloud {group} describe {name}: not JSON: {r.stdout[:200]!r}")
        state = node.get("state")
        if isinstance(state, dict):  # a queued resource: {"state": {"state": "ACTIVE", ...}}
            state = state.get("state")
        return Reading(state or "UNKNOWN", node=node)

    def describe(self) -> Reading:
        """The node's state (`NOT_FOUND` when gcloud says this node does not exist)."""
        return self._describe("tpu-vm", "nodes", self.name)

    def describe_queued(self, queued_resource: str) -> Reading:
        """A queued resource's state (`ACCEPTED`, `WAITING_FOR_RESOURCES`, `ACTIVE`, `FAILED`, ...)."""
        return self._describe("queued-resources", "queuedResources", queued_resource)

    def read(self, queued_resource: Optional[str], tries: int = 3, sleep=time.sleep) -> Reading:
        """The slice's state for the supervisor: `describe`, tried up to `tries` times (1 s, 2 s
        apart) while gcloud's answer says nothing; for a slice made through a queued resource, a
        missing node is read through the request: QUEUED while it waits for capacity (ACCEPTED,
        WAITING_FOR_RESOURCES, PROVISIONING), QUEUED_FAILED or QUEUED_SUSPENDED when it will not
        give its node, QUEUED_<state> while it changes (DELETING, SUSPENDING)."""
        for attempt in range(tries):
            reading = self.describe()
            if reading.state is not None:
                break
            if attempt < tries - 1:
                sleep(2 ** attempt)
        if reading.state != NOT_FOUND or not queued_resource:
            return reading
        queued = self.describe_queued(queued_resource)
        if queued.state is None or queued.state == NOT_FOUND:
            return queued
        if queued.state in QUEUED_WAITING:
            return Reading("QUEUED", node=queued.node)
        return reading if queued.state == "ACTIVE" else Reading(f"QUEUED_{queued.state}", node=queued.node)

    @staticmethod
    def spec_of(node: dict) -> dict:
        """What recreating the slice needs, from its description."""
        scheduling = node.get("schedulingConfig") or {}
        network = node.get("networkConfig") or {}
        account = node.get("serviceAccount") or {}
        return {
            "accelerator_type": node.get("acceleratorType") or (node.get("acceleratorConfig") or {}).get("type"),
            "runtime_version": node.get("runtimeVersion"),
            "spot": bool(scheduling.get("spot")),
            "preemptible": bool(scheduling.get("preemptible")),
            "network": network.get("network"),
            "subnetwork": network.get("subnetwork"),
            "internal_ips": network.get("enableExternalIps") is False,
            "service_account": account.get("email"),
            "scopes": account.get("scope") or [],
            "labels": node.get("labels") or {},
            "tags": node.get("tags") or [],
            # projects/P/locations/Z/queuedResources/NAME when created through a queued resource.
            "queued_resource": (node.get("queuedResource") or "").rsplit("/", 1)[-1] or None,
        }

    def create_args(self, spec: dict) -> tuple[list[str], list[str]]:
        """The gcloud commands that delete what is left of the slice and create it again."""
        flags = [f"--accelerator-type={spec['accelerator_type']}"]
        if spec.get("spot"):
            flags.append("--spot")
        elif spec.get("preemptible"):
            flags.append("--preemptible" if not spec.get("queued_resource") else "--spot")
        for key, flag in (("network", "--network"), ("subnetwork", "--subnetwork"),
                          ("service_account", "--service-account")):
            if spec.get(key):
                flags.append(f"{flag}={spec[key]}")
        if spec.get("internal_ips"):
            flags.append("--internal-ips")
        if spec.get("scopes"):
            flags.append("--scopes=" + ",".join(spec["scopes"]))
        if spec.get("labels"):
            flags.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(spec["labels"].items())))
        if spec.get("tags"):
            flags.append("--tags=" + ",".join(spec["tags"]))
        if spec.get("queued_resource"):
            qr = spec["queued_resource"]
            return (["compute", "tpus", "queued-resources", "delete", qr, "--quiet", "--force"],
                    ["compute", "tpus", "queued-resources", "create", qr, f"--node-id={self.name}",
                     f"--runtime-version={spec['runtime_version']}", *flags])
        return (["compute", "tpus", "tpu-vm", "delete", self.name, "--quiet"],
                ["compute", "tpus", "tpu-vm", "create", self.name, f"--version={spec['runtime_version']}", *flags])

    def delete(self, spec: dict, timeout: float = 1800) -> Optional[str]:
        """Deletes what is left (node or queued resource); None when done or already gone, else the error."""
        delete, _ = self.create_args(spec)
        r = self._gcloud(*delete, timeout=timeout)
        collection = "queuedResources" if spec.get("queued_resource") else "nodes"
        if r.returncode == 0 or says_not_found(r.stderr, collection, delete[4]):
            return None
        return f"gcloud {' '.join(delete[2:5])}: {(r.stderr or '').strip()[-500:]}"

    def create(self, spec: dict, timeout: float = 3600) -> Optional[str]:
        """Asks for the slice again from `spec`; None when gcloud accepted it, else the error (a
        stockout's RESOURCE_EXHAUSTED, a quota). A timeout is an error too: the node may still be
        coming up, which the next `describe` tells."""
        _, create = self.create_args(spec)
        r = self._gcloud(*create, timeout=timeout)
        return None if r.returncode == 0 else f"gcloud {' '.join(create[2:5])}: {(r.stderr or '').strip()[-500:]}"

    def start(self, timeout: float = 1800) -> Optional[str]:
        """Starts a STOPPED slice (its disks kept); None when gcloud accepted it, else the error."""
        r = self._gcloud("compute", "tpus", "tpu-vm", "start", self.name, timeout=timeout)
        return None if r.returncode == 0 else f"gcloud tpu-vm start {self.name}: {(r.stderr or '').strip()[-500:]}"


def maintenance_of(node: Optional[dict]) -> Optional[dict]:
    """What a node's description says of its health and of maintenance to come (None: nothing)."""
    if not node:
        return None
    found = {k: node[k] for k in ("health", "healthDescription", "upcomingMaintenance", "symptoms") if node.get(k)}
    if found.get("health") == "HEALTHY" and len(found) == 1:
        return None
    return found or None
