"""Public specifications of the chips: the figures a pod plan is made with (`bert_jax.pod`), the
shapes of their slices, and the peak FLOP/s the loops' MFU divides by (`peak_flops`, by jax's
`device_kind`: `training.run_setup.peak_flops_per_device`). Each chip's peak is written once, here.

Sources (docs/pod_planning.md lists them with the quotes):
[cloud-v4]  https://cloud.google.com/tpu/docs/v4   ("System architecture": 275 TFLOP/s bf16,
            32 GiB HBM2 at 1200 GBps, 3D mesh / 3D torus on slices whose dims are multiples of 4)
[cloud-v5e] https://cloud.google.com/tpu/docs/v5e  (197 TFLOP/s, 16 GB at 819 GBps, 400 GBps
            bidirectional ICI per chip, 4 ports, 2D torus, 256 chips)
[cloud-v5p] https://cloud.google.com/tpu/docs/v5p  (459 TFLOP/s, 95 GB at 2765 GBps, 1200 GBps
            bidirectional ICI per chip, 3D torus)
[cloud-v6e] https://cloud.google.com/tpu/docs/v6e  (918 TFLOP/s, 32 GB at 1638 GBps, 800 GBps
            bidirectional ICI per chip, 4 ports, 2D torus, 256 chips)
[scaling]   Austin et al., "How To Scale Your Model", part 2 "How to Think About TPUs",
            https://jax-ml.github.io/scaling-book/tpus/ : ICI bandwidth per link and direction
            (v4 4.5e10, v5e 5e10, v5p 1e11, v6e 1e11 B/s), 6 neighbours on v4/v5p and 4 on
            v5e/v6e, wraparound only on whole 4x4x4 cubes (v4/v5p) and on axes of 16 (v5e/v6e).
            Links x per-link bandwidth reproduces the Cloud pages' per-chip figures (v5p 6 x 2e11
            = 1.2e12 B/s bidirectional; v5e 4 x 1e11; v6e 4 x 2e11); for v4 this book is the only
            per-link source (the v4 page gives no per-chip ICI figure).
[h100]      NVIDIA H100 SXM datasheet: 1,979 TFLOP/s bf16 with sparsity, half without (989);
            80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s per GPU (18 links x 25 GB/s each way).
            The H200 has the H100's compute (989 TFLOP/s dense bf16) with more and faster HBM.
[a100]      NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense.

HBM capacities are read as GiB: the pages mix "GB" and "GiB" for the same chip (v5p's newer page
says 95 GiB), and HBM stacks come in binary sizes; the TPU compiler's own limit is what refuses a
program that does not fit.

Not found in a public price list we could read (so no cost is computed from these): on-demand
prices per chip-hour; a plan reports chip-hours, which the user multiplies by their price.
"""

from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # bf16 dense FLOP/s
    hbm_gib: float  # capacity per chip, GiB (2**30 B)
    hbm_bw: float  # bytes/s
    link_bw: float  # ICI bytes/s per link, one direction
    torus_dims: int  # 3: v4/v5p; 2: v5e/v6e
    cores_in_name: bool  # "v4-8" counts TensorCores (2 per chip); "v5e-8" counts chips
    topology_prefix: str  # jax.experimental.topologies' name: "v4", "v5e", "v5p", "v6e"
    chip_config: str  # libtpu's chip config for AOT compiles
    source: str
    chips_per_host_bounds: tuple = (2, 2, 1)

    def wraparound(self, dims: tuple) -> tuple:
        """Per axis: whether the slice closes it into a ring [scaling]."""
        if self.torus_dims == 3:  # OCS wraparound on whole 4x4x4 cubes only
            whole = all(d % 4 == 0 for d in dims)
            return tuple(whole and d > 1 for d in dims)
        return tuple(d == 16 for d in dims)  # v5e/v6e: an axis of 16 is a ring


CHIPS = {
    "v4": Chip("TPU v4", 275e12, 32, 1200e9, 4.5e10, 3, True, "v4", "megacore", "[cloud-v4] [scaling]"),
    "v5p": Chip("TPU v5p", 459e12, 95, 2765e9, 1e11, 3, True, "v5p", "megacore",
                "[cloud-v5p] [scaling]"),
    "v5e": Chip("TPU v5e", 197e12, 16, 819e9, 5e10, 2, False, "v5e", "default",
                "[cloud-v5e] [scaling]"),
    "v6e": Chip("TPU v6e", 918e12, 32, 1638e9, 1e11, 2, False, "v6e", "default",
                "[cloud-v6e] [scaling]"),
}

# GPU figures for the calibration against measured GPU steps (no slices: one device).
H100 = {"name": "NVIDIA H100 SXM", "peak_flops": 989e12, "hbm_gib": 80e9 / 2**30, "hbm_bw": 3.35e12,
        "source": "[h100]"}

# Peak dense bf16 FLOP/s by jax's `device_kind` prefix, for the loops' MFU (the TPU chips' from
# CHIPS; a GPU's from its datasheet).
DEVICE_KIND_PEAK_FLOPS = {
    "TPU v4": CHIPS["v4"].peak_flops,
    "TPU v5 lite": CHIPS["v5e"].peak_flops,
    "TPU v5e": CHIPS["v5e"].peak_flops,
    "TPU v5p": CHIPS["v5p"].peak_flops,
    "TPU v6 lite": CHIPS["v6e"].peak_flops,
    "NVIDIA H100": H100["peak_flops"],
    "NVIDIA H200": H100["peak_flops"],  # the H100's compute [h100]
    "NVIDIA A100": 312e12,  # [a100]
}


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device whose jax `device_kind` is `device_kind` (None: unknown)."""
    for prefix, flops in DEVICE_KIND_PEAK_FLOPS.items():
        if device_kind.startswith(prefix):
            return flops
    return None


# The calibration (docs/pod_planning.md, "Calibration"): the fraction of the peak-rate projection
# a measured step achieves. One H100, BERT-Large 24 layers, length 128, batch 256, bf16
# (2026-11-24): 120.6 ms projected at peak (60.5 ms of matmuls at 989 TFLOP/s + 60.1 ms of bytes
# at 3.35 TB/s) against 178.7 ms measured. A plan's calibrated figures run the compute and memory
# terms at this fraction of the peaks (the collectives stay at the links' rates: nothing measured
# them); checked on the H200 (two programs), bracketed by MLPerf's TPU v4 rate.
ACHIEVED = round(120.6 / 178.7, 3)  # 0.675

# Chips -> physical shape, as Cloud TPU provisions them.
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16),
              6144: (16, 16, 24)}
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
              256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str
    chip: Chip
    dims: tuple  # chips along each physical axis

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    @property
    def topology_name(self) -> str:
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.dims))}"

    @property
    def wraparound(self) -> tuple:
        return self.chip.wraparound(self.dims)


def smallest_slice(s: Slice) -> Slice:
    """The 4-chip slice of `s`'s chip (2x2x1, or 2x2): where a data-parallel plan counts its FLOPs.
    Under data parallelism every chip runs the same program on its own rows, so XLA's per-chip
    FLOPs and bytes hardly depend on the slice (equal for the test-sized model on v4-8 and v4-32,
    v5e-4 and v5e-16; for BERT-Large 0.15% above v4-2048's: docs/pod_planning.md), and the two
    counting compiles need not be partitioned for 1,024 chips."""
    shapes = _SHAPES_3D if s.chip.torus_dims == 3 else _SHAPES_2D
    dims = shapes[4]
    return Slice(f"{s.chip.topology_prefix}:{'x'.join(map(str, dims))}", s.chip, dims)


def parse_slice(name: str) -> Slice:
    """"v4-128" (64 chips: v4/v5p names count TensorCores), "v5e-16" (16 chips), or an explicit
    shape "v4:4x4x8"."""
    m = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+(?:x\d+)+)", name)
    if m:
        chip = CHIPS[m.group(1)]
        dims = tuple(int(d) for d in m.group(2).split("x"))
        if len(dims) != chip.torus_dims:
            raise ValueError(f"--topology {name!r}: {chip.name} slices have {chip.torus_dims} axes")
        return Slice(name, chip, dims)
    m = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name)
    if not m:
        raise ValueError(f"--topology {name!r}: expected e.g. v4-128, v5p-256, v5e-16, v6e-64 or v4:4x4x8")
    chip = CHIPS[m.group(1)]
    n = int(m.group(2))
    chips = n // 2 if chip.cores_in_name else n
    if chip.cores_in_name and n % 2:
        raise ValueError(f"--topology {name!r}: {chip.name} names count TensorCores (2 per chip): use an even number")
    shapes = _SHAPES_3D if chip.torus_dims == 3 else _SHAPES_2D
    if chips not in shapes:
        raise ValueError(f"--topology {name!r}: no standard {chip.name} shape of {chips} chips "
                         f"(known: {sorted(shapes)}); give one as {chip.topology_prefix}:AxBxC")
    return Slice(name, chip, shapes[chips])
