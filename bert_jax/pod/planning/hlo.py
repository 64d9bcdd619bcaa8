"""The collectives of a compiled program, read from its optimized HLO text, and the reading of that
text (types and their bytes, replica groups, computations, instructions, loops) that
`bert_jax.pod.planning.traffic` shares for the program's memory traffic.

    collectives(compiled.as_text()) -> [Collective(kind, bytes, groups, executions, ...), ...]

What a pod planner needs of every collective: its kind (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute), the bytes it moves per chip, which devices take part together
(its replica groups, or a permute's source->target pairs), and how many times one step runs it.

- Bytes: the result's size in bytes (a tuple's elements summed). For asynchronous pairs
  (`all-gather-start` / `all-gather-done`, ...) the `-done` op's result (the start op's result
  also holds the input buffers). all-gather: the gathered buffer; reduce-scatter: one chip's
  shard (`full_bytes` = shard x group size); all-reduce, all-to-all, collective-permute: the
  buffer each chip holds.
- Groups: the three forms XLA prints: explicit (`{{0,1},{2,3}}`; `{}` = every device), iota
  (`[2,4]<=[4,2]T(1,0)`: iota reshaped, transposed, read as rows) and mesh
  (`mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`: devices laid on the named mesh, a group
  per combination of the other axes). Ids are the program's device (partition) ids: with
  `jax.jit` on a mesh, the positions in the compiled devices list.
- Executions: a collective inside a `while` body runs the loop's `known_trip_count` times (the
  scanned encoder's: once per layer), or N times for a loop whose condition is `counter < N`
  (the TPU compiler's collective-matmul loops, which carry no trip count: once per chunk);
  counts multiply through nested loops and calls. Any other loop counts once and is flagged
  (`unknown_trip_count`); a collective in a `conditional` branch counts as run (flagged
  `conditional`). The TPU compiler also decomposes collectives into chains of async pieces
  (`frontend_attributes={chain_id="N"}`) spread over other work, collective-matmul loops
  included; every piece names the whole buffer. A chain counts as one collective, run as often as
  its least repeated piece (not counting chunk-loop iterations): read so from the programs (the
  pieces of one chain gather one weight), the HLO says no more.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# bits per element of XLA's primitive types
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64,
         "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0}


@dataclasses.dataclass
class Collective:
    kind: str  # one of KINDS
    name: str  # the HLO instruction's name
    computation: str  # where it sits
    bytes: int  # the result's bytes per chip (see the module docstring)
    groups: list  # [[device ids], ...]; for collective-permute: [[source, target], ...]
    executions: int  # times one run of the program executes it
    elements: int = 0  # array elements in the result
    unknown_trip_count: bool = False
    conditional: bool = False

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    @property
    def full_bytes(self) -> int:
        """The whole buffer a group reduces or gathers (reduce-scatter: shard x group size)."""
        return self.bytes * self.group_size if self.kind == "reduce-scatter" else self.bytes


# An array in an HLO type: element type, dimensions, and the layout if printed (`{1,0:T(8,128)S(3)}`).
ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\](\{[^}]*\})?")


def element_bits(dtype: str):
    """Bits per element of an XLA primitive type, or None for one this table does not know."""
    return 8 if dtype.startswith("f8") else _BITS.get(dtype)


def element_count(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1


def _arrays(text: str) -> list[tuple[int, int]]:
    """`[(bits per element, elements), ...]` of an HLO type: `f32[128,256]{1,0}`, `bf16[]`,
    `(f32[2]{0}, s32[])`, TPU layouts."""
    out = []
    for dtype, dims, _ in ARRAY_TYPE.findall(text):
        bits = element_bits(dtype)
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in {text!r}")
        out.append((bits, element_count(dims)))
    return out


def type_bytes(text: str) -> int:
    return sum(bits * n // 8 for bits, n in _arrays(text))


def type_elements(text: str) -> int:
    return sum(n for bits, n in _arrays(text) if bits)


def _split_type(rest: str) -> tuple[str, str]:
    """`TYPE op(...)...` -> (TYPE, `op(...)...`); a tuple type is parenthesized."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text)]


def parse_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The replica groups of an instruction's attribute text (every form XLA prints)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(?([^)\s]*(?:\([^)]*\))?)\)?)?\s*\{([^}]*)\}",
                  attrs)
    if m:  # mesh form
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, shape = [a for a, _ in axes], [int(s) for _, s in axes]
        size = int(np.prod(shape))
        ids = np.arange(size)
        if m.group(2):  # `[dims]T(perm)` / `[dims]` (an iota: ids include 0, so a list of ids has
            # product 0 and dims of an iota multiply to the mesh's size) or the ids themselves
            dm = re.fullmatch(r"\[?([\d,]+)\]?(?:T\(([\d,]+)\))?", m.group(2))
            if dm is None:
                raise ValueError(f"unrecognized device_ids in {attrs[:200]!r}")
            values = _ints(dm.group(1))
            if dm.group(2) or int(np.prod(values)) == size:
                ids = _iota(values, _ints(dm.group(2)) if dm.group(2) else None).reshape(-1)
            else:
                ids = np.array(values)
        grid = ids.reshape(shape)
        reduced = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        kept = [i for i in range(len(shape)) if i not in reduced]
        grid = grid.transpose(kept + reduced).reshape(-1, int(np.prod([shape[i] for i in reduced] or [1])))
        return grid.tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:  # iota form
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return ids.reshape(_ints(m.group(1))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:  # explicit form; {} is every device
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        return groups or [list(range(num_devices))]
    return [list(range(num_devices))]


def computations(hlo: str):
    """{name: [instruction lines]}, the entry computation's name, and the module's device count."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    header = re.search(r"^HloModule\b.*$", hlo, re.M)
    partitions = re.search(r"num_partitions=(\d+)", header.group(0)) if header else None
    replicas = re.search(r"replica_count=(\d+)", header.group(0)) if header else None
    num_devices = (int(partitions.group(1)) if partitions else 1) * (int(replicas.group(1)) if replicas else 1)
    for line in hlo.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
        elif line.rstrip() == "}":  # the computation's end: a lone brace
            current = None
        elif line.startswith("  "):  # an instruction
            if "=" in line:
                comps[current].append(line)
        elif comps[current]:
            # A continuation: a string attribute printed over several lines (a Pallas kernel's
            # backend_config, whose JSON lines may start with "}}"), part of the instruction above.
            comps[current][-1] += " " + line.strip()
    return comps, entry, num_devices


def instruction(line: str):
    """(name, type text, op, rest) of an instruction line."""
    m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
    if not m:
        return None
    type_text, rest = _split_type(m.group(2))
    op = re.match(r"([\w\-]+)\(", rest)
    return (m.group(1), type_text, op.group(1), rest) if op else None


def _counted_loop_bound(cond_lines: list[str]):
    """N of a loop condition `ROOT compare(counter, constant(N)), direction=LT`: the TPU
    compiler's collective-matmul loops count a counter from 0 by 1 and carry no
    known_trip_count. None for any other condition."""
    constants = {}
    for line in cond_lines:
        m = re.match(r"^\s*%?([\w.\-]+)\s*=\s*[su]\d+\[\]\S*\s+constant\((\d+)\)", line)
        if m:
            constants[m.group(1)] = int(m.group(2))
    for line in cond_lines:
        m = re.match(r"^\s*ROOT\s.*\scompare\(%?([\w.\-]+),\s*%?([\w.\-]+)\),\s*direction=LT", line)
        if m and m.group(2) in constants:
            return constants[m.group(2)]
    return None


def while_loop(comps: dict, rest: str):
    """(body, condition, trips or None, trips given by `known_trip_count`) of a `while`."""
    body = re.search(r"\bbody=%?([\w.\-]+)", rest)
    cond = re.search(r"\bcondition=%?([\w.\-]+)", rest)
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    trips = int(known.group(1)) if known else (_counted_loop_bound(comps.get(cond.group(1), [])) if cond else None)
    return body and body.group(1), cond and cond.group(1), trips, bool(known)


def conditional_branches(rest: str) -> list[str]:
    """The computations a `conditional` chooses between."""
    branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
    if branches:
        return re.findall(r"%?([\w.\-]+)", branches.group(1))
    return re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)


def collectives(hlo: str) -> list[Collective]:
    """Every collective of an optimized HLO module, with the times one step runs it."""
    comps, entry, num_devices = computations(hlo)
    # (caller, callee, (runs factor, runs factor without chunk loops), unknown trips, conditional)
    edges: list[tuple[str, str, tuple, bool, bool]] = []
    for caller, lines in comps.items():
        for line in lines:
            inst = instruction(line)
            if not inst:
                continue
            _, _, op, rest = inst
            if op == "while":
                body, cond, trips, known = while_loop(comps, rest)
                # A loop without known_trip_count whose bound is read off its condition is one of the
                # TPU compiler's collective-matmul (chunk) loops.
                chunk = 1 if not known else None
                if body:
                    edges.append((caller, body, (trips or 1, chunk or trips or 1), trips is None, False))
                if cond:
                    edges.append((caller, cond, ((trips or 0) + 1, chunk or (trips or 0) + 1), trips is None, False))
            elif op == "conditional":
                edges.extend((caller, callee, (1, 1), False, True) for callee in conditional_branches(rest))
            else:
                for callee in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", rest):
                    edges.append((caller, callee, (1, 1), False, False))
    callers: dict[str, list] = {}
    for src, dst, factor, unk, cnd in edges:
        callers.setdefault(dst, []).append((src, factor, unk, cnd))
    runs: dict[str, tuple[int, int, bool, bool]] = {}

    def run_count(comp: str, seen: frozenset = frozenset()) -> tuple[int, int, bool, bool]:
        """(times one run of the entry runs `comp`, the same not counting chunk-loop iterations,
        unknown trip count on the way, inside a conditional): sums over its call sites (HLO's
        call graph is acyclic)."""
        if comp == entry:
            return (1, 1, False, False)
        if comp not in runs:
            if comp in seen:
                raise ValueError(f"HLO call graph has a cycle through {comp}")
            total, outside, unknown, conditional = 0, 0, False, False
            for src, (factor, chunk_factor), unk, cnd in callers.get(comp, []):
                n, o, u, c = run_count(src, seen | {comp})
                if n:
                    total += n * factor
                    outside += o * chunk_factor
                    unknown, conditional = unknown or u or unk, conditional or c or cnd
            runs[comp] = (total, outside, unknown, conditional)
        return runs[comp]

    found: list[Collective] = []
    chains: dict[str, list[Collective]] = {}
    starts: dict[str, tuple[str, str, str]] = {}
    for comp, lines in comps.items():
        count, outside_chunks, unknown, conditional = run_count(comp)
        for line in lines:
            inst = instruction(line)
            if not inst:
                continue
            name, type_text, op, rest = inst
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind in KINDS and op.endswith("-start"):
                starts[name] = (kind, rest, comp)
                continue
            if op.endswith("-done") and op[:-len("-done")] in KINDS:
                operand = re.match(r"[\w\-]+\(%?([\w.\-]+)", rest).group(1)
                kind, rest, _ = starts.pop(operand)
            elif kind not in KINDS:
                continue
            if count == 0:
                continue
            chain = re.search(r'chain_id="(\d+)"', rest)
            if kind == "collective-permute":
                pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
                groups = [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))] if pairs else []
            else:
                groups = parse_groups(rest, num_devices)
            c = Collective(kind, name, comp, type_bytes(type_text), groups, count, type_elements(type_text),
                           unknown, conditional)
            if chain:
                c.executions = outside_chunks
                chains.setdefault(chain.group(1), []).append(c)
            else:
                found.append(c)
    # A chain (`chain_id`) is one collective the TPU compiler decomposed into async pieces spread
    # over other work, collective-matmul loops included; each piece names the whole buffer. One
    # collective per chain, run as often as its least repeated piece outside chunk loops.
    for chain_id, pieces in sorted(chains.items(), key=lambda kv: int(kv[0])):
        first = min(pieces, key=lambda c: c.executions)
        found.append(dataclasses.replace(first, name=f"{first.name} (chain {chain_id}: {len(pieces)} pieces)"))
    return found


def summarize(found: list[Collective]) -> dict:
    """`{kind: {"ops": instructions, "executions": per step, "bytes": per chip per step}}`."""
    out: dict = {}
    for c in found:
        row = out.setdefault(c.kind, {"ops": 0, "executions": 0, "bytes": 0})
        row["ops"] += 1
        row["executions"] += c.executions
        row["bytes"] += c.bytes * c.executions
    return out
