"""The stated cost model of a pod plan: a step's time from its compiled program and the chip's specs.

Everything here is arithmetic on numbers the compiled program and public specifications give;
tests/pod/test_planning_cost.py checks it against hand-computed cases.

Compute and memory (per chip, per step)
    compute_s = XLA FLOPs / peak FLOP/s;  memory_s = HBM traffic / HBM bandwidth, the traffic
    read off the program's instructions (`pod.planning.traffic.memory_traffic`: operands and results
    in HBM, and the copies to and from on-chip memory).
    Both are totals, not per-op pairs: a step takes between
    max(compute_s, memory_s) (every op overlaps its traffic with other ops' math) and
    compute_s + memory_s (no op does both at once). `core_s` is the sum unless said otherwise.

Collectives (per chip; the interconnect as a torus or mesh of links, each `link_bw` bytes/s in
each direction)
    A group spans some axes of the slice's physical torus (its devices' coordinates differ along
    them), with extents n_1..n_k. The model is the bandwidth-optimal ring algorithm run axis after
    axis (reduce-scatter along axis 1, then along axis 2 on the 1/n_1 that is left, ...; an
    all-gather is the same in reverse): on axis d the data left is B / (n_1 ... n_(d-1)), of which
    a ring moves the fraction (n_d - 1) / n_d through each chip. A ring along an axis with
    wraparound sends both ways round (2 link_bw per chip); along an axis without wraparound (a
    line) the ring runs out and back over the same links (link_bw per chip). To use every axis's
    links at once, the buffer is cut in k parts, part p going through the axes in the order
    rotated to start at axis p; the slowest part sets the time:

        reduce-scatter / all-gather:  max_p sum_d (n_d - 1) / (n_1 ... n_d) * (B_full / k) / bw_d
                                      (the product and the sum in part p's axis order)
        all-reduce:                   twice that (a reduce-scatter, then an all-gather)
        all-to-all:                   (n - 1) / n * B / bw over the group's slowest axis
                                      (optimistic beyond a few chips: bisection is not modelled)
        collective-permute:           B / link_bw (neighbours, pipelined over any hops)
    plus `hop_latency` per ring step (sum of (n_d - 1), twice for an all-reduce): an assumption,
    not a published figure (ICI hop latencies are of the order of a microsecond).

The step
    no overlap:    core_s + comm_s
    with overlap:  max(core_s, comm_s) + comm_s / layers: the collectives run beside the
                   compute (gradient reductions during the backward pass, FSDP gathers ahead of
                   the layer that needs them) except the last layer's share, which has nothing
                   left to hide behind.
    calibrated:    the same with compute_s and memory_s divided by the fraction of the peak-rate
                   projection that a measured step achieved (`calibrated`, training.chips.ACHIEVED).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Interconnect:
    link_bw: float  # bytes/s per link, one direction
    wraparound: tuple  # per physical axis: True where the axis is a ring (torus), False for a line
    hop_latency: float = 1e-6  # seconds per ring step (an assumption, see the docstring)

    def axis_bw(self, axis: int) -> float:
        return self.link_bw * (2 if self.wraparound[axis] else 1)


def spanned_axes(coords: list) -> list[tuple[int, int]]:
    """`[(axis, extent), ...]` of a group of devices given their physical coordinates: the axes
    along which they differ and how many distinct positions they take there."""
    if not coords:
        return []
    out = []
    for axis in range(len(coords[0])):
        extent = len({c[axis] for c in coords})
        if extent > 1:
            out.append((axis, extent))
    if math.prod(e for _, e in out) != len({tuple(c) for c in coords}):
        # Not a sub-grid (e.g. a diagonal group): treat it as a ring along its longest axis, with
        # every member on it.
        axis = max(out, key=lambda a: a[1])[0] if out else 0
        return [(axis, len(coords))]
    return out


def _axis_by_axis_s(part_bytes: float, order: list[tuple[int, int]], net: Interconnect) -> float:
    t, shrink = 0.0, 1
    for axis, n in order:
        shrink *= n
        t += (n - 1) / shrink * part_bytes / net.axis_bw(axis) + (n - 1) * net.hop_latency
    return t


def scatter_or_gather_s(full_bytes: float, axes: list[tuple[int, int]], net: Interconnect) -> float:
    """A reduce-scatter or all-gather of `full_bytes` (the whole buffer) over a group spanning
    `axes`: the buffer cut in k = len(axes) parts, part p run axis by axis starting from axis p
    (the k rotations of the order), all at once, each first on a different axis's links; the
    slowest part sets the time."""
    k = len(axes)
    return max(_axis_by_axis_s(full_bytes / k, axes[p:] + axes[:p], net) for p in range(k))


def collective_s(kind: str, bytes_: float, full_bytes: float, axes: list[tuple[int, int]],
                 net: Interconnect) -> float:
    """Seconds one execution of a collective takes (module docstring)."""
    if not axes:
        return 0.0
    if kind == "all-reduce":
        return 2 * scatter_or_gather_s(full_bytes, axes, net)
    if kind in ("all-gather", "reduce-scatter"):
        return scatter_or_gather_s(full_bytes, axes, net)
    if kind == "all-to-all":
        n = math.prod(e for _, e in axes)
        slowest = min(net.axis_bw(a) for a, _ in axes)
        return (n - 1) / n * bytes_ / slowest + sum(e - 1 for _, e in axes) * net.hop_latency
    if kind == "collective-permute":
        return bytes_ / net.link_bw + net.hop_latency
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float
    memory_s: float
    comm_s: float
    layers: int

    @property
    def core_s(self) -> float:
        return self.compute_s + self.memory_s

    @property
    def roofline_s(self) -> float:
        """The optimistic bound: compute and traffic fully overlapped, no communication."""
        return max(self.compute_s, self.memory_s)

    @property
    def no_overlap_s(self) -> float:
        return self.core_s + self.comm_s

    @property
    def overlap_s(self) -> float:
        return max(self.core_s, self.comm_s) + self.comm_s / max(1, self.layers)


def calibrated(t: StepTime, achieved: float) -> StepTime:
    """`t` with its compute and memory terms at `achieved` of the peak rates (a measured step's
    fraction of its projection, `training.chips.ACHIEVED`); the collectives unchanged."""
    if not 0 < achieved <= 1:
        raise ValueError(f"achieved fraction of peak must be in (0, 1], got {achieved}")
    return StepTime(t.compute_s / achieved, t.memory_s / achieved, t.comm_s, t.layers)


def step_time(flops: float, bytes_accessed: float, comm_s: float, *, peak_flops: float, hbm_bw: float,
              layers: int) -> StepTime:
    return StepTime(flops / peak_flops, bytes_accessed / hbm_bw, comm_s, layers)


def mfu(model_flops_per_chip: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilization: the model's FLOPs (not the program's) per second over the peak."""
    return model_flops_per_chip / seconds / peak_flops


def weak_scaling(per_chip_rate: dict) -> dict:
    """`{chips: efficiency}`: each slice's per-chip throughput over the smallest slice's."""
    base = per_chip_rate[min(per_chip_rate)]
    return {n: r / base for n, r in sorted(per_chip_rate.items())}


def time_to_train(phases: list[dict]) -> dict:
    """`phases`: [{"steps", "step_s", "chips"}, ...] -> wall seconds and chip-hours in all."""
    wall = sum(p["steps"] * p["step_s"] for p in phases)
    chip_hours = sum(p["steps"] * p["step_s"] * p["chips"] for p in phases) / 3600
    return {"wall_s": wall, "wall_days": wall / 86400, "chip_hours": chip_hours}
