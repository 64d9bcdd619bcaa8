"""Does the pretraining step fit a Cloud TPU pod slice: compiled ahead of time on a CPU machine.

    pip install 'libtpu==0.0.42.*'    # the TPU compiler, matching jax 0.10.2; no TPU needed
    python -m bert_jax.pod.planning.aot_check --config=configs/large.py \\
        [--topology=v4-32,v5p-64,v5e-16] [--mesh=data,fsdp,tensor] [--seq_len=128] \\
        [--batch_per_chip=32] [--max_batch_per_chip=1024] [--attention=einsum] [--json]

(`python -m benchmarks.step.aot_tpu` runs the same, with the same flags.) What it adds over the planner
(`python -m bert_jax.plan`, which projects the step's time from the same compile): the model's own
options (--remat, --attention, --no_scan, --predictions), the largest batch estimated from the
program, and the compute-only MFU ceiling. For each slice and mesh it lowers and compiles
`bert_jax.pretrain.steps.train_step` (the pretraining step: AdamW, clipping, dropout, donated
state, bf16 compute with float32 parameters) against the slice's real devices (`jax.experimental.topologies.get_topology_desc`), as MaxText checks its
configs, and reports:

* per-chip HBM (arguments + outputs - donated aliases + temporaries, from
  `compiled.memory_analysis()`) against the chip's capacity;
* XLA's FLOPs per chip per step (`compiled.cost_analysis()`) against our analytic count
  (`steps.train_flops_per_sequence` x the rows a chip processes);
* the collectives in the optimized HLO (all-reduce, all-gather, reduce-scatter, ...), and its
  Pallas (Mosaic) kernels: with `--attention=dot_product`, the splash attention kernels
  (forward, and the dq and dkv backward kernels) where the model uses them. XLA's cost analysis
  does not see inside them, so the FLOPs ratio and MFU bound below then leave attention out;
* the largest per-chip batch that fits, estimated from the compiled program: the state (weights,
  optimizer moments) is fixed and the temporaries grow with the batch (a program that does not
  fit is refused by the TPU compiler, RESOURCE_EXHAUSTED, and the reported batch is halved until
  it fits);
* an MFU upper bound from compute alone: model FLOPs / XLA FLOPs per chip (what recomputation,
  tensor-parallel duplication and non-matmul work leave); memory traffic and ICI communication
  are not in this bound. XLA counts a loop's body once (the scanned encoder's, and the
  collective-matmul loops the TPU compiler makes of FSDP's gathered-weight matmuls), so its FLOPs
  come from 1- and 2-layer unrolled compiles of the same step without collective-matmul loops
  (the same arithmetic), extrapolated in depth; `collective_matmul_loops` counts those loops in
  the real program.

Meshes: `data` (pure data parallel), `fsdp` (parameters and optimizer state sharded over every
chip), `tensor` (tensor parallel over 4 chips, data parallel over the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bert_jax.pod.planning import aot
from bert_jax.training import chips


def check(config, bert_config, slice_name: str, mesh_kind: str, seq_len: int, predictions: int,
          batch_per_chip: int, max_batch_per_chip: int) -> dict:
    """The step on one slice and mesh (module docstring): the per-chip batch that fits (from
    `batch_per_chip`, halved), HBM, XLA's FLOPs against the model's, the MFU ceiling, the largest
    batch estimated (capped at `max_batch_per_chip`; 0: not capped)."""
    from bert_jax.pretrain import steps

    spec = chips.parse_slice(slice_name)
    devices = aot.slice_devices(slice_name)
    _, analysis, b, _ = aot.fitting_step(config, bert_config, devices, mesh_kind, batch_per_chip, seq_len,
                                         predictions, spec.chip.hbm_gib, f"{slice_name} {mesh_kind}")
    result = {"slice": slice_name, "topology": spec.topology_name, "chips": spec.chips,
              "mesh": aot.mesh_axes(mesh_kind, spec.chips), "batch_per_chip": b, **analysis}
    rows = result["global_batch"]
    flops, loops = aot.counted_flops(config, bert_config, devices, mesh_kind, b, seq_len, predictions)
    result["xla_flops"] = flops  # per chip
    # Loops left in the counting compiles (expected none): their bodies are counted once.
    result["flop_count_loops"] = loops
    analytic = steps.train_flops_per_sequence(bert_config, seq_len, predictions) * rows / spec.chips
    result["analytic_flops_per_chip"] = analytic
    result["xla_over_analytic"] = flops / analytic
    # Compute ceiling: the share of the chip's work that is model FLOPs (recomputation, duplicated
    # work across tensor-parallel chips and non-matmul ops lower it); memory traffic and
    # communication are not in this bound.
    result["mfu_upper_bound"] = analytic / flops
    result["compute_bound_step_ms"] = flops / spec.chip.peak_flops * 1e3
    result["compute_bound_sequences_per_s"] = rows / (result["compute_bound_step_ms"] / 1e3)
    # Largest per-chip batch: the state (arguments) is fixed; temporaries grow with the batch.
    per_row = result["hbm_temp_gib"] / b
    result["hbm_gib_per_row"] = per_row
    estimate = int((spec.chip.hbm_gib - result["hbm_fixed_gib"]) / per_row) if per_row > 0 else max_batch_per_chip
    result["max_batch_per_chip"] = max(b, min(max_batch_per_chip or estimate, estimate))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/large.py")
    p.add_argument("--topology", default="v4-32,v5p-64,v5e-16",
                   help="comma-separated slices: v4-N, v5p-N (N TensorCores), v5e-N, v6e-N (N chips), or v4:AxBxC")
    p.add_argument("--mesh", default="data,fsdp,tensor", help="comma-separated, of data, fsdp, tensor")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--predictions", type=int, default=0)
    p.add_argument("--batch_per_chip", type=int, default=32, help="halved until it fits")
    p.add_argument("--max_batch_per_chip", type=int, default=512, help="0: do not search")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--remat", default="none", choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--attention", default="einsum", choices=["einsum", "dot_product"],
                   help="model.attention_impl; dot_product is Pallas splash attention on TPU")
    p.add_argument("--no_scan", action="store_true", help="unrolled layers (slower to compile)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def load_configs(args: argparse.Namespace):
    """`(ConfigDict, BertConfig)` of `--config` with the command line's model options applied."""
    from bert_jax.config_overrides import load_config as load_config_file
    from bert_jax.model.model_config import BertConfig
    config = load_config_file(args.config, module_name="cfg")  # a file, or a config's name from any folder
    if config.get("model_family", "bert") != "bert":
        raise SystemExit(f"--config={args.config}: config.model_family={config.model_family!r}; aot_check's "
                         "options (--remat, --attention, --no_scan) are BERT's: plan it with python -m bert_jax.plan")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise SystemExit("libtpu is not installed: pip install 'libtpu==0.0.42.*' (no TPU needed)") from None
    config.model.dtype = args.dtype
    config.model.scan_layers = not args.no_scan
    config.model.remat_policy = args.remat
    config.model.attention_impl = args.attention
    if args.attention == "dot_product":  # the kernel has no attention-probability dropout
        config.model.attention_probs_dropout_prob = 0.0
    config.max_seq_length = args.seq_len
    return config, BertConfig.from_dict(config.model.to_dict())


def main(argv=None) -> list:
    aot.quiet_libtpu_env()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args = parse_args(argv)
    config, bert_config = load_configs(args)
    predictions = args.predictions or max(1, round(args.seq_len * 20 / 128))
    results = []
    for slice_name in args.topology.split(","):
        try:
            chips.parse_slice(slice_name)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        for mesh_kind in args.mesh.split(","):
            r = check(config, bert_config, slice_name, mesh_kind, args.seq_len, predictions, args.batch_per_chip,
                      args.max_batch_per_chip)
            r.update(config=args.config, seq_len=args.seq_len, dtype=args.dtype, remat=args.remat,
                     attention=args.attention, scan=not args.no_scan, date=time.strftime("%Y-%m-%d"))
            results.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{slice_name:7s} {mesh_kind:6s} mesh={r['mesh']} batch/chip={r['batch_per_chip']} "
                      f"HBM {r['hbm_gib']:.2f}/{r['hbm_capacity_gib']} GiB  XLA/analytic FLOPs "
                      f"{r['xla_over_analytic']:.2f}  MFU<= {r['mfu_upper_bound']:.0%}  "
                      f"max batch/chip {r['max_batch_per_chip']}  collectives {r['collectives']}  "
                      f"collective matmuls {r['collective_matmul_loops']}  Pallas kernels {r['pallas_kernels']}  "
                      f"(compile {r['compile_s']:.0f} s)", flush=True)
            if r["flop_count_loops"]:
                print(f"  warning: {r['flop_count_loops']} loops in the FLOP-counting compiles: XLA counts each "
                      "body once, so the FLOPs above are too low", file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    main()
