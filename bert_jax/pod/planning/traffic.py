"""The memory traffic of a compiled program, read from its optimized HLO text (the HLO reading
itself, and the collectives, are `bert_jax.pod.planning.hlo`'s).

    memory_traffic(compiled.as_text()) -> Traffic(by_space={memory space: bytes}, copies)

The roofline reading (`memory_traffic`): every instruction outside a fusion reads its operands and
writes its result once, each array counted in the memory space its layout names (`S(n)`; none =
HBM), and asynchronous copies between memories counted apart; a fusion reads only the slices it
takes of an operand and writes only the update of an in-place `dynamic-update-slice`. The
planner's HBM term (`bert_jax.pod.planning.cost`) is `Traffic.hbm`; docs/pod_planning.md compares
it with XLA's own "bytes accessed".
"""

from __future__ import annotations

import dataclasses
import re

from bert_jax.pod.planning.hlo import (ARRAY_TYPE, KINDS, computations, conditional_branches, element_bits,
                                       element_count, instruction, type_bytes, type_elements, while_loop)


# Instructions that move no data of their own: names for buffers, control flow (its bodies are
# counted), or data the collectives' term accounts for (`pod.planning.cost`).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier", "add-dependency", "domain", "while", "conditional", "call",
               "copy-start", "copy-done", "slice-start", "slice-done", "send", "send-done", "recv", "recv-done"}


@dataclasses.dataclass
class Traffic:
    """Bytes one run of a program moves to and from each memory, per chip (`memory_traffic`)."""
    by_space: dict  # {memory space: bytes read and written by the instructions (operands + results)}
    copies: int  # bytes of the asynchronous copies between memories (copy/slice-start ... -done)

    @property
    def hbm(self) -> int:
        """Off-chip traffic: memory space 0's operands and results, and every copy between
        memories (one side of which is HBM)."""
        return self.by_space.get(0, 0) + self.copies

    @property
    def on_chip(self) -> int:
        return sum(v for k, v in self.by_space.items() if k)


def _space_bytes(text: str) -> dict:
    """`{memory space: bytes}` of the arrays in an HLO type or operand list; a layout's `S(n)`
    names the space, none = 0 (HBM)."""
    out: dict = {}
    for dtype, dims, layout in ARRAY_TYPE.findall(text):
        bits = element_bits(dtype)
        if bits is None:
            continue
        space = re.search(r"S\((\d+)\)", layout)
        key = int(space.group(1)) if space else 0
        out[key] = out.get(key, 0) + element_count(dims) * bits // 8
    return out


def _operand_names(rest: str) -> list[str]:
    """The operand names of an instruction (`op(%a, %b)`, or with their types printed inline:
    `op(f32[8]{0} %a, ...)`)."""
    start = rest.index("(")
    depth, end = 0, len(rest)
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            end = i
            break
    inner = rest[start + 1:end]
    if "%" in inner:
        return re.findall(r"%([\w.\-]+)", inner)
    return [part.split()[-1] for part in inner.split(",") if part.strip() and "[" not in part.split()[-1]]


_SLICING = ("dynamic-slice", "slice", "gather")  # read only the part of operand 0 they return
_PASS_THROUGH = ("bitcast", "copy", "convert", "reshape", "transpose")  # element for element


def _arrays_of(type_text: str) -> list[str]:
    """The array types of a (possibly tuple) type, in order."""
    return [m.group(0) for m in ARRAY_TYPE.finditer(type_text)]


def _fusion_parts(comps: dict, callee: str, memo: dict) -> tuple[dict, list]:
    if callee not in memo:
        memo[callee] = ({}, [])  # a cycle (none in HLO) reads whole
        memo[callee] = _fusion_parts_uncached(comps, callee, memo)
    return memo[callee]


def _fusion_parts_uncached(comps: dict, callee: str, memo: dict) -> tuple[dict, list]:
    """What a fusion body reads of each operand and writes of each output, where less than whole:
    `({parameter index: bytes read}, [bytes written per output or None])`. A parameter only
    sliced (`dynamic-slice`, `slice`, `gather`; also through element-for-element ops and nested
    fusions, which XLA computes only where sliced) is read as the slices' bytes; one
    that is the buffer of a `dynamic-update-slice` output is updated in place: not read, and the
    output writes the update's bytes (a scanned layer's weights and saved activations)."""
    lines = comps.get(callee, [])
    insts = [i for i in (instruction(line) for line in lines) if i]
    types = {i[0]: i[1] for i in insts}
    params = {}
    for name, _, op, rest in insts:
        if op == "parameter":
            params[name] = int(re.search(r"parameter\((\d+)\)", rest).group(1))
    users: dict = {}
    for name, _, op, rest in insts:
        for k, operand in enumerate(_operand_names(rest)):
            users.setdefault(operand, []).append((name, op, k, rest))
    root = next((instruction(line) for line in lines if line.lstrip().startswith("ROOT")), None)

    def sliced_fraction(name: str, depth: int = 0):
        """The fraction of `name` read if only slicing ops read it (directly, through
        element-for-element ops such as bitcasts, copies and converts, or inside nested fusions);
        None if anything reads it whole."""
        full = type_bytes(types.get(name, ""))
        if not full or depth > 6 or not users.get(name):  # an output (or unused): whole
            return None
        total = 0.0
        for user, op, k, rest in users.get(name, []):
            nested = re.search(r"\bcalls=%?([\w.\-]+)", rest) if op == "fusion" else None
            nested_reads = _fusion_parts(comps, nested.group(1), memo)[0] if nested else {}
            if op in _SLICING and k == 0:
                total += type_bytes(types[user]) / full
            elif k in nested_reads:  # sliced inside a nested fusion
                total += nested_reads[k] / full
            elif (op in _PASS_THROUGH or (nested and len(_operand_names(rest)) == 1)) and \
                    type_elements(types[user]) == type_elements(types[name]):
                inner = sliced_fraction(user, depth + 1)  # an element-for-element copy, itself sliced
                if inner is None:
                    return None
                total += inner
            else:
                return None
        return min(total, 1.0)

    outputs = [root] if root and root[2] != "tuple" else [
        (n, types.get(n, ""), "", "") for n in (_operand_names(root[3]) if root else [])]
    writes, updated = [], set()
    for out in outputs:
        inst = next((i for i in insts if i[0] == out[0]), None)
        if inst and inst[2] == "dynamic-update-slice":
            buffer, update = _operand_names(inst[3])[:2]
            writes.append(type_bytes(types.get(update, "")))
            updated.add(buffer)
        else:
            writes.append(None)
    reads = {}
    for name, index in params.items():
        if name in updated:
            reads[index] = 0
        else:
            part = sliced_fraction(name)
            if part is not None:
                reads[index] = int(part * type_bytes(types[name]))
    return reads, writes


def _instruction_bytes(comps: dict, types: dict, type_text: str, op: str, rest: str, memo: dict) -> dict:
    """`{memory space: bytes}` an instruction outside a fusion reads and writes (`memory_traffic`)."""
    operands = _operand_names(rest)
    reads = {}
    out_arrays = _arrays_of(type_text)
    writes: list = [None] * len(out_arrays)
    if op == "fusion":
        callee = re.search(r"\bcalls=%?([\w.\-]+)", rest)
        if callee:
            reads, fused_writes = _fusion_parts(comps, callee.group(1), memo)
            if len(fused_writes) == len(out_arrays):
                writes = fused_writes
    elif op in _SLICING:
        reads = {0: type_bytes(type_text)}
    elif op == "dynamic-update-slice" and len(operands) > 1:
        reads = {0: 0}
        writes = [type_bytes(types.get(operands[1], ""))]
    out: dict = {}
    for array, written in zip(out_arrays, writes):
        for space, full in _space_bytes(array).items():
            out[space] = out.get(space, 0) + (full if written is None else min(full, written))
    for k, name in enumerate(operands):
        for space, full in _space_bytes(types.get(name, "")).items():
            out[space] = out.get(space, 0) + (min(full, reads[k]) if k in reads else full)
    return out


def memory_traffic(hlo: str) -> Traffic:
    """The bytes one run of an optimized HLO module reads and writes, by memory space.

    The roofline reading of a program: every instruction outside a fusion (a fusion, a matmul
    custom call, a copy, ...) reads its operands and writes its result once; what a fusion does
    inside stays in registers and on-chip buffers. Each array is counted in the memory space its
    layout names (`S(n)`; none = HBM): the TPU compiler places buffers that fit in on-chip memory
    (v4's 128 MiB CMEM: `S(3)`) and moves others there and back with asynchronous copies
    (`copy-start`/`slice-start`, counted once each in `copies`). Loops count their body
    `known_trip_count` times (or the bound read off a counted condition; unknown: once), a
    `conditional` its costliest branch, a `call` its callee once. Collectives are left to the
    network term. XLA's own cost analysis ("bytes accessed") counts differently: on TPU it also
    counts accesses inside fusions and those of on-chip buffers (BERT-Large on v4: 2.5x this
    HBM traffic at length 128, where much of the step lives in CMEM; at 512 the two totals
    happen to meet; docs/pod_planning.md).
    """
    comps, entry, _ = computations(hlo)
    memo: dict = {}
    fusions: dict = {}  # _fusion_parts of each fusion body
    collective_ops = set(KINDS) | {f"{k}-start" for k in KINDS} | {f"{k}-done" for k in KINDS}

    def add(into: dict, other: dict, times: int = 1) -> None:
        for k, v in other.items():
            into[k] = into.get(k, 0) + v * times

    def visit(comp: str, seen: frozenset = frozenset()) -> tuple[dict, int]:
        if comp in memo:
            return memo[comp]
        if comp in seen:
            raise ValueError(f"HLO call graph has a cycle through {comp}")
        seen = seen | {comp}
        spaces: dict = {}
        copies = 0
        insts = [i for i in map(instruction, comps.get(comp, [])) if i]
        types = {i[0]: i[1] for i in insts}  # name -> type text, for the operands
        for _, type_text, op, rest in insts:
            if op == "while":
                body, cond, trips, _ = while_loop(comps, rest)
                for callee, times in ((body, trips or 1), (cond, (trips or 0) + 1)):
                    if callee:
                        s, c = visit(callee, seen)
                        add(spaces, s, times)
                        copies += c * times
            elif op == "conditional":
                costs = [visit(n, seen) for n in conditional_branches(rest)]
                if costs:
                    s, c = max(costs, key=lambda sc: sum(sc[0].values()) + sc[1])
                    add(spaces, s)
                    copies += c
            elif op == "call":
                for callee in re.findall(r"\bto_apply=%?([\w.\-]+)", rest):
                    s, c = visit(callee, seen)
                    add(spaces, s)
                    copies += c
            elif op in ("copy-done", "slice-done"):
                copies += type_bytes(type_text)
            elif op not in _NO_TRAFFIC and op not in collective_ops and \
                    'custom_call_target="AllocateBuffer"' not in rest:  # a buffer reserved, not written
                add(spaces, _instruction_bytes(comps, types, type_text, op, rest, fusions))
        memo[comp] = (spaces, copies)
        return memo[comp]

    spaces, copies = visit(entry)
    return Traffic(spaces, copies)
