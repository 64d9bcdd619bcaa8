"""Ahead-of-time compilation of the sharded pretraining step for Cloud TPU pod slices, on a CPU machine.

    pip install 'libtpu==0.0.42.*'    # the TPU compiler, matching jax 0.10.2; no TPU needed
    python benchmarks/aot_tpu.py --config=configs/large.py \\
        [--topology=v4-32,v5p-64,v5e-16] [--mesh=data,fsdp,tensor] [--seq_len=128] \\
        [--batch_per_chip=32] [--max_batch_per_chip=1024] [--attention=einsum] [--json]

For each slice and mesh it lowers and compiles `bert_jax.steps.train_step` (the pretraining step:
AdamW, clipping, dropout, donated state, bf16 compute with float32 parameters) against the
slice's real devices (`jax.experimental.topologies.get_topology_desc`), as MaxText checks its
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
import functools
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v4-8")  # quiets libtpu's host detection
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name -> (topology, chip config, chips, HBM GiB, peak bf16 TFLOP/s, HBM GB/s) per chip, public specs
SLICES = {
    "v4-32": ("v4:2x2x4", "megacore", 16, 32, 275, 1228),
    "v5p-64": ("v5p:2x4x4", "megacore", 32, 95, 459, 2765),
    "v5e-16": ("v5e:4x4", "default", 16, 16, 197, 819),
    "v5e-4": ("v5e:2x2", "default", 4, 16, 197, 819),  # small: the unit test's
}
MESHES = ("data", "fsdp", "tensor")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def slice_devices(name: str):
    from jax.experimental import topologies

    topology, chip_config, chips = SLICES[name][:3]
    devices = topologies.get_topology_desc(
        topology_name=topology, platform="tpu", chip_config_name=chip_config,
        chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
    if len(devices) != chips:
        raise RuntimeError(f"{name}: expected {chips} chips, the topology has {len(devices)} devices")
    return devices


def mesh_axes(kind: str, chips: int) -> dict:
    if kind == "data":
        return {"data": chips, "fsdp": 1, "tensor": 1}
    if kind == "fsdp":
        return {"data": 1, "fsdp": chips, "tensor": 1}
    if kind == "tensor":
        return {"data": chips // 4, "fsdp": 1, "tensor": 4}
    raise ValueError(f"--mesh: unknown mesh {kind!r} (use {', '.join(MESHES)})")


def compile_step(config, bert_config, devices, mesh_kind: str, batch_per_chip: int, seq_len: int,
                 predictions: int, compiler_options: dict | None = None):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from bert_jax import pretrain, sharding, steps

    mesh = sharding.create_mesh(mesh_axes(mesh_kind, len(devices)), devices=devices)
    model, tx, schedule, init_state = pretrain.build(config, bert_config, mesh)
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    state_shardings = sharding.logical_to_sharding(abstract, mesh)
    abstract_state = sharding.abstract_with_shardings(nn.meta.unbox(abstract), state_shardings)
    # Global batch: per-chip batch x chips that hold distinct rows (data x fsdp).
    rows = batch_per_chip * sharding.axis_size(mesh, sharding.BATCH_AXES)
    bs = sharding.batch_sharding(mesh)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=bs)
    batch = {k: spec((rows, seq_len), jnp.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    batch.update(masked_lm_positions=spec((rows, predictions), jnp.int32),
                 masked_lm_ids=spec((rows, predictions), jnp.int32),
                 masked_lm_weights=spec((rows, predictions), jnp.float32),
                 next_sentence_labels=spec((rows, 1), jnp.int32))
    step = functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule, mesh=mesh)
    jitted = jax.jit(step, in_shardings=(state_shardings, bs), out_shardings=(state_shardings, None),
                     donate_argnums=0)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        t0 = time.perf_counter()
        compiled = jitted.lower(abstract_state, batch).compile(compiler_options=compiler_options)
    return compiled, time.perf_counter() - t0, rows


def analyze(compiled, hbm_gib: float) -> dict:
    mem = compiled.memory_analysis()
    fixed = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    used = fixed + mem.temp_size_in_bytes
    hlo = compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    # Collective matmuls: loops whose body is XLA's windowed dot (a scanned layer's appear once).
    windowed = len(re.findall(r"\swhile\(.*body=%[\w.]*windowed_dot_general", hlo))
    return {"hbm_gib": used / 2**30, "hbm_capacity_gib": hbm_gib, "fits": used <= hbm_gib * 2**30,
            "hbm_fixed_gib": fixed / 2**30, "hbm_temp_gib": mem.temp_size_in_bytes / 2**30,
            "collectives": {k: v for k, v in counts.items() if v}, "collective_matmul_loops": windowed,
            # Pallas kernels lower to Mosaic custom calls (the scanned layer's body appears once).
            "pallas_kernels": hlo.count('custom_call_target="tpu_custom_call"')}


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


# The TPU compiler turns a matmul with a gathered (FSDP) or reduce-scattered operand into a loop
# ("windowed einsum", collective matmul) that overlaps each chunk's transfer with its share of the
# matmul. Turned off, the program does the same arithmetic without the loop.
NO_COLLECTIVE_MATMUL_LOOPS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                              "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def counted_flops(config, bert_config, devices, mesh_kind: str, batch_per_chip: int, seq_len: int,
                  predictions: int) -> tuple[float, int]:
    """XLA's FLOPs per chip of the full-depth step, and the loops left in the programs it counted.

    XLA's cost analysis counts a loop's body once: the scanned encoder's, and each collective
    matmul's (FSDP's gathered weights: without this it counts 21-25% fewer FLOPs than the model
    needs). So the count comes from two unrolled compiles of 1 and 2 layers (same widths, mesh
    and batch) without collective-matmul loops, extrapolated linearly in depth. Their last layer
    is computed as in the real program (at the masked positions only when it is unrolled with
    `sparse_last_layer`; a scanned encoder computes it everywhere).
    """
    from bert_jax import modeling

    sparse = modeling.last_layer_queries(bert_config, seq_len, predictions) is not None
    counts, loops, options = [], 0, NO_COLLECTIVE_MATMUL_LOOPS
    for layers in (1, 2):
        small = bert_config.replace(num_hidden_layers=layers, scan_layers=False, sparse_last_layer=sparse)
        try:
            compiled, _, _ = compile_step(config, small, devices, mesh_kind, batch_per_chip, seq_len, predictions,
                                          compiler_options=options)
        except Exception as e:  # noqa: BLE001 - a libtpu without these options: count with the loops
            if options is None or "No such compile option" not in str(e):
                raise
            options = None
            compiled, _, _ = compile_step(config, small, devices, mesh_kind, batch_per_chip, seq_len, predictions)
        counts.append(xla_flops(compiled))
        loops += len(re.findall(r"\swhile\(", compiled.as_text()))
    per_layer = counts[1] - counts[0]
    return counts[0] + (bert_config.num_hidden_layers - 1) * per_layer, loops


def run_one(args, config, bert_config, slice_name: str, mesh_kind: str) -> dict:
    from bert_jax import steps

    topology, _, chips, hbm, peak_tflops, _ = SLICES[slice_name]
    devices = slice_devices(slice_name)
    predictions = args.predictions or max(1, round(args.seq_len * 20 / 128))
    tried: dict = {}

    def attempt(b: int) -> dict:
        """Compiles the full model at per-chip batch b; the TPU compiler refuses a program that
        does not fit (RESOURCE_EXHAUSTED), which counts as "does not fit"."""
        if b not in tried:
            try:
                compiled, seconds, rows = compile_step(config, bert_config, devices, mesh_kind, b, args.seq_len,
                                                       predictions)
                tried[b] = dict(analyze(compiled, hbm), compile_s=seconds, global_batch=rows)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is expected here
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                tried[b] = {"fits": False, "error": str(e).splitlines()[0][:300]}
        return tried[b]

    # The reported batch: --batch_per_chip, halved until the program fits.
    b = args.batch_per_chip
    while not attempt(b)["fits"] and b > 1:
        b //= 2
    if not attempt(b)["fits"]:
        raise RuntimeError(f"{slice_name} {mesh_kind}: even a per-chip batch of 1 does not fit: {tried[b]}")
    result = {"slice": slice_name, "topology": topology, "chips": chips, "mesh": mesh_axes(mesh_kind, chips),
              "batch_per_chip": b, **tried[b]}
    rows = result["global_batch"]
    flops, loops = counted_flops(config, bert_config, devices, mesh_kind, b, args.seq_len, predictions)
    result["xla_flops"] = flops  # per chip
    # Loops left in the counting compiles (expected none): their bodies are counted once.
    result["flop_count_loops"] = loops
    analytic = steps.train_flops_per_sequence(bert_config, args.seq_len, predictions) * rows / chips
    result["analytic_flops_per_chip"] = analytic
    result["xla_over_analytic"] = result["xla_flops"] / analytic
    # Compute ceiling: the share of the chip's work that is model FLOPs (recomputation, duplicated
    # work across tensor-parallel chips and non-matmul ops lower it); memory traffic and
    # communication are not in this bound.
    result["mfu_upper_bound"] = analytic / result["xla_flops"]
    result["compute_bound_step_ms"] = result["xla_flops"] / (peak_tflops * 1e12) * 1e3
    result["compute_bound_sequences_per_s"] = rows / (result["compute_bound_step_ms"] / 1e3)
    # Largest per-chip batch: the state (arguments) is fixed; temporaries grow with the batch.
    per_row = result["hbm_temp_gib"] / b
    result["hbm_gib_per_row"] = per_row
    estimate = int((hbm - result["hbm_fixed_gib"]) / per_row) if per_row > 0 else args.max_batch_per_chip
    result["max_batch_per_chip"] = max(b, min(args.max_batch_per_chip or estimate, estimate))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/large.py")
    p.add_argument("--topology", default="v4-32,v5p-64,v5e-16", help=f"comma-separated, of {', '.join(SLICES)}")
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
    import importlib.util
    from bert_jax.modeling import BertConfig
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise SystemExit("libtpu is not installed: pip install 'libtpu==0.0.42.*' (no TPU needed)") from None
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, args.config))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.model.dtype = args.dtype
    config.model.scan_layers = not args.no_scan
    config.model.remat_policy = args.remat
    config.model.attention_impl = args.attention
    if args.attention == "dot_product":  # the kernel has no attention-probability dropout
        config.model.attention_probs_dropout_prob = 0.0
    config.max_seq_length = args.seq_len
    return config, BertConfig.from_dict(config.model.to_dict())


def main(argv=None):
    args = parse_args(argv)
    config, bert_config = load_configs(args)
    results = []
    for slice_name in args.topology.split(","):
        if slice_name not in SLICES:
            raise SystemExit(f"--topology: unknown slice {slice_name!r} (use {', '.join(SLICES)})")
        for mesh_kind in args.mesh.split(","):
            r = run_one(args, config, bert_config, slice_name, mesh_kind)
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
