"""Plan a pod run before renting it: projected step time, scaling and time-to-train from the compiled step.

The planner behind `python -m bert_jax.plan` (`bert_jax/plan.py`, the command's entry point):

    pip install 'libtpu==0.0.42.*'      # the TPU compiler; no TPU needed
    python -m bert_jax.plan --config=configs/large.py --topology=v4-8,v4-32,v4-128,v4-512 \\
        [--mesh=data,fsdp,tensor] [--seq_len=128] [--batch_per_chip=32] [--recipes=paper,lamb] \\
        [--json=plan.json] [--config.model.attention_impl=dot_product ...]

For each slice and mesh the pretraining step (`steps.train_step`, as `bert_jax.main` runs it) is
compiled for the slice's real devices (`pod.planning.aot`), and the step time is projected with the
model of `pod.planning.cost` (stated there): compute at the chip's peak, HBM traffic at its bandwidth
(XLA's FLOPs; the HBM traffic of the program's instructions, by memory space), and every
collective of the compiled program (`pod.planning.hlo`: bytes, replica groups, executions) on the
slice's interconnect: the groups' devices' physical
coordinates say which torus axes each collective crosses. Chip figures: `training.chips` (public
specifications, cited). Reported per slice and mesh: the per-chip batch that fits (halved from
--batch_per_chip until the TPU compiler accepts it), HBM per chip, the step time with and without
overlapping the collectives with compute, sequences/s, MFU, and the collectives' share, and the
calibrated sequences/s (compute and memory at the fraction of the peak-rate projection a measured
step achieved, `training.chips.ACHIEVED`: what to budget for); per mesh, weak-scaling efficiency
from the smallest slice; per slice, the recommended mesh; per recipe, the projected wall time and
chip-hours on every slice that can run it, at the peaks and calibrated. `--config.key=value` overrides
the config file as `bert_jax.main` takes them (the dtype, the length and the batch come from the
planner's own flags; BERT's layers are always scanned). `config.model_family="modernbert"` plans
ModernBERT (unrolled, 30% predictions: docs/pod_planning.md, "ModernBERT"), on the same meshes as BERT.

Recipes (--recipes): `paper` = BERT-Large as Devlin et al.: 900k steps at length 128 + 100k at 512,
batch 256; `lamb` = You et al. 2019: 7,038 steps at 128 with batch 65,536 + 1,563 at 512 with
batch 32,768. A phase's step time on a slice comes from the plan's compile at that length on the
recommended mesh, scaled to the recipe's per-chip batch: compute, traffic and batch-sized
collectives in proportion to the rows, the optimizer's and the gradients' part fixed (per-chip
batches above what fits run as gradient accumulation: the same rows per chip in several passes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

RECIPES = {
    "paper": [{"seq_len": 128, "steps": 900_000, "batch": 256}, {"seq_len": 512, "steps": 100_000, "batch": 256}],
    "lamb": [{"seq_len": 128, "steps": 7_038, "batch": 65_536}, {"seq_len": 512, "steps": 1_563, "batch": 32_768}],
}


# Set by the planner itself (from its own flags, or always): not overridable with --config.
PLANNER_KEYS = {"config.model.dtype": "--dtype", "config.model.scan_layers": "(always scanned)",
                "config.max_seq_length": "--seq_len", "config.global_batch_size": "--batch_per_chip"}


def load_config(path: str, seq_len: int, dtype: str, overrides=()):
    """`(ConfigDict, model config)` of a config file (the one `bert_jax.main` would train), with
    `--config.key=value` overrides (e.g. `--config.model.attention_impl=dot_product`): a `BertConfig`,
    or a `ModernBertConfig` for `config.model_family="modernbert"` (`run_setup.model_config_from`)."""
    from bert_jax.config_overrides import apply_overrides, load_config as load_config_file
    from bert_jax.training import run_setup

    config = load_config_file(path, module_name="plan_config")
    apply_overrides(config, overrides, path)
    config.model.dtype = dtype
    if config.get("model_family", "bert") == "bert":
        # The real program with scanned layers, as the docs say: compile memory and time flat in
        # depth (BERT-Large unrolled took 14 GB of host memory on v4-8 before it was stopped); the
        # FLOPs and bytes come from unrolled 1- and 2-layer programs (pod.planning.aot.counted_costs).
        # ModernBERT has no scanned encoder: its real program is unrolled.
        config.model.scan_layers = True
    config.max_seq_length = seq_len
    return config, run_setup.model_config_from(config)


def predictions_per_row(config, seq_len: int) -> int:
    """The masked positions a planned row carries: BERT's 20 per 128 tokens (Devlin et al.'s
    `max_predictions_per_seq`), `ceil(masked_lm_prob * seq_len)` for ModernBERT (30%: 308 at 1,024)."""
    if config.get("model_family", "bert") == "modernbert":
        return max(1, math.ceil(config.masked_lm_prob * seq_len - 1e-9))
    return max(1, round(seq_len * 20 / 128))


def comm_seconds(collectives, mesh, net) -> tuple[float, float, dict]:
    """Seconds per step of every collective on the slice's interconnect; the part that grows with
    the batch (activations: groups inside one tensor-parallel group); the split by kind."""
    import numpy as np
    from bert_jax.pod.planning import cost

    flat = list(mesh.devices.flat)  # the program's device ids are positions in this list
    tensor_groups = []
    if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1:
        pos = np.arange(len(flat)).reshape(mesh.devices.shape)
        axis = mesh.axis_names.index("tensor")
        tensor_groups = [set(g) for g in np.moveaxis(pos, axis, -1).reshape(-1, mesh.shape["tensor"]).tolist()]
    total, batch_sized, by_kind = 0.0, 0.0, {}
    for c in collectives:
        group = c.groups[0] if c.groups else []
        if c.kind == "collective-permute":
            axes = [(0, 2)] if group else []  # neighbours: one hop, pipelined beyond
        else:
            axes = cost.spanned_axes([tuple(flat[i].coords) for i in group])
        seconds = cost.collective_s(c.kind, c.bytes, c.full_bytes, axes, net) * c.executions
        total += seconds
        if group and any(set(group) <= g for g in tensor_groups):
            batch_sized += seconds
        row = by_kind.setdefault(c.kind, {"executions": 0, "bytes": 0, "elements": 0, "seconds": 0.0})
        row["executions"] += c.executions
        row["bytes"] += c.bytes * c.executions
        row["elements"] += c.elements * c.executions
        row["seconds"] += seconds
    return total, batch_sized, by_kind


def plan_one(config, bert_config, slice_name: str, mesh_kind: str, seq_len: int, batch_per_chip: int) -> dict:
    """Compile, read the program, project the step (module docstring)."""
    from bert_jax.pod.planning import aot, cost, hlo, traffic as traffic_lib
    from bert_jax.training import chips
    from bert_jax.pretrain import model_family

    spec = chips.parse_slice(slice_name)
    devices = aot.slice_devices(slice_name)
    predictions = predictions_per_row(config, seq_len)
    started = time.perf_counter()
    compiled, analysis, b, mesh = aot.fitting_step(config, bert_config, devices, mesh_kind, batch_per_chip, seq_len,
                                                   predictions, spec.chip.hbm_gib, f"{slice_name} {mesh_kind}")
    rows = analysis["global_batch"]
    found = hlo.collectives(compiled.as_text())
    net = cost.Interconnect(spec.chip.link_bw, spec.wraparound)
    comm_s, batch_comm_s, by_kind = comm_seconds(found, mesh, net)
    # The FLOP-counting compiles: on the chip's 4-chip slice under data parallelism (the same
    # per-chip program, chips.smallest_slice), on the slice itself for the sharded meshes.
    count_slice = chips.smallest_slice(spec) if mesh_kind == "data" else spec
    count_devices = devices if count_slice.dims == spec.dims else aot.slice_devices(count_slice.name)
    costs, loops = aot.counted_costs(config, bert_config, count_devices, mesh_kind, b, seq_len, predictions)
    traffic = traffic_lib.memory_traffic(compiled.as_text())  # the real program's HBM traffic
    t = cost.step_time(costs["flops"], traffic.hbm, comm_s, peak_flops=spec.chip.peak_flops,
                       hbm_bw=spec.chip.hbm_bw, layers=bert_config.num_hidden_layers)
    model_flops = model_family.train_flops_per_sequence(bert_config, seq_len, predictions) * rows / spec.chips
    # The optimizer's share of the traffic (reads and writes the state once per step: fixed in the
    # batch): the arguments' bytes, read and written.
    state_bytes = analysis["hbm_fixed_gib"] * 2**30
    out = {
        "slice": slice_name, "topology": spec.topology_name, "chips": spec.chips, "mesh_kind": mesh_kind,
        "mesh": aot.mesh_axes(mesh_kind, spec.chips), "seq_len": seq_len, "batch_per_chip": b,
        "global_batch": rows, "hbm_gib": analysis["hbm_gib"], "hbm_capacity_gib": spec.chip.hbm_gib,
        "xla_flops": costs["flops"], "model_flops": model_flops, "flop_count_loops": loops,
        "flop_count_slice": count_slice.topology_name,
        # HBM traffic (pod.planning.traffic.memory_traffic) and, for comparison, XLA's "bytes accessed",
        # which on TPU also counts on-chip accesses (docs/pod_planning.md)
        "hbm_bytes": traffic.hbm, "hbm_copy_bytes": traffic.copies, "on_chip_bytes": traffic.on_chip,
        "xla_bytes": costs["bytes"], "fixed_bytes": min(2 * state_bytes, traffic.hbm),
        "compute_s": t.compute_s, "memory_s": t.memory_s, "comm_s": comm_s, "comm": by_kind,
        "batch_comm_s": batch_comm_s, "peak_flops": spec.chip.peak_flops, "hbm_bw": spec.chip.hbm_bw,
        "step_s_no_overlap": t.no_overlap_s, "step_s": t.overlap_s, "roofline_s": t.roofline_s,
        "layers": bert_config.num_hidden_layers, "wraparound": list(spec.wraparound),
        "unknown_trip_counts": sum(c.unknown_trip_count for c in found),
    }
    tc = cost.calibrated(t, chips.ACHIEVED)  # at the measured fraction of the peaks (training.chips)
    out.update(achieved=chips.ACHIEVED, step_s_calibrated=tc.overlap_s)
    out["sequences_per_s"] = rows / out["step_s"]
    out["sequences_per_s_calibrated"] = rows / out["step_s_calibrated"]
    out["sequences_per_s_no_overlap"] = rows / out["step_s_no_overlap"]
    out["mfu"] = cost.mfu(model_flops, out["step_s"], spec.chip.peak_flops)
    out["mfu_no_overlap"] = cost.mfu(model_flops, out["step_s_no_overlap"], spec.chip.peak_flops)
    out["mfu_calibrated"] = cost.mfu(model_flops, out["step_s_calibrated"], spec.chip.peak_flops)
    out["plan_s"] = time.perf_counter() - started
    return out


def scaled_step_s(row: dict, batch_per_chip: float, overlap: bool = True, achieved: float = 1.0) -> float:
    """The step time of `row`'s program at another per-chip batch (module docstring): compute,
    the batch-sized traffic and the activation collectives in proportion to the rows, the
    optimizer's traffic and the gradient/weight collectives fixed; compute and traffic at
    `achieved` of the peak rates (1 = the peak-rate projection; training.chips.ACHIEVED)."""
    from bert_jax.pod.planning import cost

    k = batch_per_chip / row["batch_per_chip"]
    traffic = row["fixed_bytes"] + (row["hbm_bytes"] - row["fixed_bytes"]) * k
    comm = row["comm_s"] + row["batch_comm_s"] * (k - 1)
    t = cost.StepTime(row["compute_s"] * k, traffic / row["hbm_bw"], comm, row["layers"])
    if achieved != 1.0:
        t = cost.calibrated(t, achieved)
    return t.overlap_s if overlap else t.no_overlap_s


def recipe_plan(name: str, phases: list, rows_by_len: dict) -> list:
    """Per slice (the recommended mesh at each length): wall time and chip-hours, at the peak
    rates and calibrated (`entry["calibrated"]`), or why not."""
    from bert_jax.pod.planning import cost
    from bert_jax.training import chips

    out = []
    slices = sorted({r["slice"] for rs in rows_by_len.values() for r in rs}, key=lambda s: _chips(rows_by_len, s))
    for slice_name in slices:
        entry, per_phase = {"recipe": name, "slice": slice_name}, []
        for phase in phases:
            best = recommended([r for r in rows_by_len.get(phase["seq_len"], []) if r["slice"] == slice_name])
            if best is None:
                entry["error"] = f"no plan at length {phase['seq_len']} (add it to --seq_len)"
                break
            ways = best["global_batch"] // best["batch_per_chip"]  # chips holding distinct rows
            per_chip = phase["batch"] / ways
            if per_chip < 1:
                entry["error"] = (f"batch {phase['batch']} over {ways} data-parallel chips is under one row per chip "
                                  f"({best['mesh_kind']} mesh)")
                break
            passes = math.ceil(per_chip / best["batch_per_chip"])  # gradient accumulation beyond what fits
            step_s = passes * scaled_step_s(best, per_chip / passes)
            calibrated_s = passes * scaled_step_s(best, per_chip / passes, achieved=chips.ACHIEVED)
            per_phase.append({"seq_len": phase["seq_len"], "steps": phase["steps"], "batch": phase["batch"],
                              "mesh": best["mesh_kind"], "batch_per_chip": per_chip, "accumulation": passes,
                              "step_s": step_s, "step_s_calibrated": calibrated_s, "chips": best["chips"]})
        if "error" not in entry:
            entry.update(cost.time_to_train(per_phase), phases=per_phase)
            entry["calibrated"] = cost.time_to_train([dict(p, step_s=p["step_s_calibrated"]) for p in per_phase])
        out.append(entry)
    return out


def _chips(rows_by_len: dict, slice_name: str) -> int:
    return next(r["chips"] for rs in rows_by_len.values() for r in rs if r["slice"] == slice_name)


def recommended(rows: list) -> dict | None:
    """The fastest mesh (projected sequences/s with overlap) of a slice's plans."""
    return max(rows, key=lambda r: r["sequences_per_s"]) if rows else None


def weak_scaling(rows: list) -> dict:
    """`{mesh: {chips: efficiency}}` at each mesh's per-chip batch (as planned)."""
    from bert_jax.pod.planning import cost

    out = {}
    for mesh_kind in sorted({r["mesh_kind"] for r in rows}):
        rates = {r["chips"]: r["sequences_per_s"] / r["chips"] for r in rows if r["mesh_kind"] == mesh_kind}
        if len(rates) > 1:
            out[mesh_kind] = cost.weak_scaling(rates)
    return out


def print_header() -> None:
    print(f"{'slice':9s} {'mesh':6s} {'len':>4s} {'b/chip':>6s} {'HBM GiB':>8s} {'compute':>8s} {'HBM':>7s} "
          f"{'comm':>7s} {'step':>8s} {'no-ovl':>8s} {'seq/s':>9s} {'MFU':>5s} {'cal seq/s':>9s}  plan", flush=True)


def print_rows(rows: list) -> None:
    for r in rows:
        print(f"{r['slice']:9s} {r['mesh_kind']:6s} {r['seq_len']:4d} {r['batch_per_chip']:6d} "
              f"{r['hbm_gib']:8.2f} {r['compute_s'] * 1e3:6.1f}ms {r['memory_s'] * 1e3:5.1f}ms "
              f"{r['comm_s'] * 1e3:5.1f}ms {r['step_s'] * 1e3:6.1f}ms {r['step_s_no_overlap'] * 1e3:6.1f}ms "
              f"{r['sequences_per_s']:9.0f} {r['mfu']:5.0%} {r['sequences_per_s_calibrated']:9.0f}  "
              f"{r['plan_s']:.0f}s", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/large.py")
    p.add_argument("--topology", default="v4-16,v4-64,v4-256",
                   help="comma-separated slices: v4-N, v5p-N (N TensorCores), v5e-N, v6e-N (N chips), or v4:AxBxC")
    p.add_argument("--mesh", default=None, help="comma-separated, of data, fsdp, tensor (default: all three)")
    p.add_argument("--seq_len", default="128", help="comma-separated lengths to plan (the recipes need 128,512)")
    p.add_argument("--batch_per_chip", type=int, default=32, help="rows per chip, halved until the step fits")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--recipes", default="", help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--json", default="", help="write the whole plan here")
    args, rest = p.parse_known_args(argv)
    # --config.key=value overrides, as bert_jax.main takes them: checked here, before any compile.
    args.overrides = [a for a in rest if a.startswith("--config.")]
    if len(args.overrides) != len(rest):
        p.error(f"unrecognized arguments: {' '.join(a for a in rest if not a.startswith('--config.'))}")
    for a in args.overrides:
        key = a[len("--"):].split("=", 1)[0]
        if key in PLANNER_KEYS:
            p.error(f"--{key}: the planner sets it ({PLANNER_KEYS[key]})")
    from bert_jax.pod.planning import aot
    from bert_jax.training import chips

    try:
        args.slices = [chips.parse_slice(s).name for s in args.topology.split(",") if s]
    except ValueError as e:
        p.error(str(e))
    args.meshes = None if args.mesh is None else [m for m in args.mesh.split(",") if m]
    for m in args.meshes or ():
        if m not in aot.MESHES:
            p.error(f"--mesh: unknown mesh {m!r} (use {', '.join(aot.MESHES)})")
    args.seq_lens = [int(v) for v in args.seq_len.split(",") if v]
    args.recipe_names = [r for r in args.recipes.split(",") if r]
    for r in args.recipe_names:
        if r not in RECIPES:
            p.error(f"--recipes: unknown recipe {r!r} (use {', '.join(RECIPES)})")
        missing = {ph["seq_len"] for ph in RECIPES[r]} - set(args.seq_lens)
        if missing:
            p.error(f"--recipes={r} needs --seq_len to include {sorted(missing)}")
    if args.json:
        try:
            storage_paths.check(args.json, "--json")
        except storage_paths.StorageError as e:
            p.error(str(e))
    if storage_paths.is_remote(args.config):  # imported as a Python module: a local file
        p.error(f"--config={args.config}: a config is a local Python file (copy it here first)")
    try:  # a file, or a config's name (`--config=large`) from any folder: config_overrides.resolve_config
        load_config(args.config, args.seq_lens[0] if args.seq_lens else 128, args.dtype, args.overrides)
    except ValueError as e:
        p.error(str(e))
    args.meshes = list(args.meshes or aot.MESHES)
    return args


def main(argv=None) -> dict:
    from bert_jax.pod.planning import aot

    aot.quiet_libtpu_env()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args = parse_args(argv)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        sys.exit("bert_jax.plan needs the TPU compiler: pip install 'libtpu==0.0.42.*' (no TPU needed)")
    rows_by_len: dict = {}
    rows = []
    print_header()
    for seq_len in args.seq_lens:
        config, bert_config = load_config(args.config, seq_len, args.dtype, args.overrides)
        if seq_len > bert_config.max_position_embeddings:
            sys.exit(f"--seq_len={seq_len} exceeds {args.config}'s max_position_embeddings="
                     f"{bert_config.max_position_embeddings}")
        for slice_name in args.slices:
            for mesh_kind in args.meshes:
                row = plan_one(config, bert_config, slice_name, mesh_kind, seq_len, args.batch_per_chip)
                rows.append(row)
                rows_by_len.setdefault(seq_len, []).append(row)
                print_rows([row])
    report = {"config": args.config, "overrides": args.overrides, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"), "plans": rows,
              "weak_scaling": {seq: weak_scaling(rs) for seq, rs in rows_by_len.items()},
              "recommended": {seq: {s: recommended([r for r in rs if r["slice"] == s])["mesh_kind"]
                                    for s in args.slices} for seq, rs in rows_by_len.items()},
              "recipes": [e for r in args.recipe_names for e in recipe_plan(r, RECIPES[r], rows_by_len)]}
    for seq, table in report["weak_scaling"].items():
        for mesh_kind, eff in table.items():
            print(f"weak scaling, length {seq}, {mesh_kind}: " +
                  ", ".join(f"{n} chips {e:.0%}" for n, e in eff.items()))
    for e in report["recipes"]:
        if "error" in e:
            print(f"recipe {e['recipe']} on {e['slice']}: {e['error']}")
        else:
            cal = e["calibrated"]
            print(f"recipe {e['recipe']} on {e['slice']}: {e['wall_days']:.2f} days, {e['chip_hours']:,.0f} chip-hours "
                  f"({', '.join(f'''{p['steps']} x {p['step_s'] * 1e3:.1f} ms''' for p in e['phases'])}); "
                  f"calibrated {cal['wall_days']:.2f} days, {cal['chip_hours']:,.0f} chip-hours")
    if args.json:
        storage.write_text(args.json, json.dumps(report, indent=1))  # local or gs://
    return report


if __name__ == "__main__":
    main()
