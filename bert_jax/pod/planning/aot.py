"""Ahead-of-time compilation of the sharded pretraining step for a TPU slice, on any machine.

libtpu (the TPU compiler, `pip install 'libtpu==0.0.42.*'`) compiles for a slice's real device
topology (`jax.experimental.topologies`) without a TPU, as MaxText checks its configs. What a plan
reads from the compiled program:

* per-chip HBM (arguments + outputs - donated aliases + temporaries, `memory_analysis()`);
* XLA's FLOPs and bytes accessed per chip (`cost_analysis()`), from 1- and 2-layer unrolled
  compiles (ModernBERT's alternating layers: 1, 2 and n + 1) without collective-matmul loops,
  extrapolated in depth (`counted_costs`): XLA's cost
  analysis counts a loop's body once, both the scanned encoder's and the loops the TPU compiler
  makes of FSDP's gathered-weight matmuls (the bytes are kept for comparison only: on TPU they
  also count on-chip accesses);
* the collectives of the real (scanned) program with their bytes, groups and executions, and its
  HBM traffic by memory space (`pod.planning.traffic`), and the Pallas kernels in it.
"""

from __future__ import annotations

import functools
import os
import re
import time

from bert_jax.pod.planning import hlo as hlo_lib
from bert_jax.training import chips as chips_lib

MESHES = ("data", "fsdp", "tensor")
COLLECTIVES = hlo_lib.KINDS


def quiet_libtpu_env() -> None:
    """Compiling only: no TPU host detection, and libtpu's one-process lock does not stop a
    compile beside another process that loaded libtpu (any jax process does when it is installed)."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v4-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def slice_devices(name: str):
    """The devices of slice `name` (e.g. "v4-128", "v5e-16"), with their physical `coords`."""
    from jax.experimental import topologies

    s = chips_lib.parse_slice(name)
    devices = topologies.get_topology_desc(
        topology_name=s.topology_name, platform="tpu", chip_config_name=s.chip.chip_config,
        chips_per_host_bounds=s.chip.chips_per_host_bounds, num_slices=1).devices
    if len(devices) != s.chips:
        raise RuntimeError(f"{name}: expected {s.chips} chips, the topology has {len(devices)} devices")
    return devices


def mesh_axes(kind: str, chips: int, tensor: int = 4) -> dict:
    if kind == "data":
        return {"data": chips, "fsdp": 1, "tensor": 1}
    if kind == "fsdp":
        return {"data": 1, "fsdp": chips, "tensor": 1}
    if kind == "tensor":
        if chips % tensor:
            raise ValueError(f"tensor mesh: {chips} chips do not divide by tensor={tensor}")
        return {"data": chips // tensor, "fsdp": 1, "tensor": tensor}
    raise ValueError(f"--mesh: unknown mesh {kind!r} (use {', '.join(MESHES)})")


def compile_step(config, bert_config, devices, mesh_kind: str, batch_per_chip: int, seq_len: int,
                 predictions: int, compiler_options: dict | None = None):
    """`(compiled, seconds, global rows, mesh)` of `steps.train_step` on `devices`."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from bert_jax.pretrain import loop as pretrain, steps
    from bert_jax.training import sharding

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
    return compiled, time.perf_counter() - t0, rows, mesh


def analyze(compiled, hbm_gib: float) -> dict:
    """HBM per chip, the collectives by kind, collective-matmul loops and Pallas kernels."""
    mem = compiled.memory_analysis()
    fixed = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    used = fixed + mem.temp_size_in_bytes
    text = compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(?:-start)?\(", text)) for c in COLLECTIVES}
    # Collective matmuls: loops whose body is XLA's windowed dot (a scanned layer's appear once).
    windowed = len(re.findall(r"\swhile\(.*body=%[\w.]*windowed_dot_general", text))
    return {"hbm_gib": used / 2**30, "hbm_capacity_gib": hbm_gib, "fits": used <= hbm_gib * 2**30,
            "hbm_fixed_gib": fixed / 2**30, "hbm_temp_gib": mem.temp_size_in_bytes / 2**30,
            "collectives": {k: v for k, v in counts.items() if v}, "collective_matmul_loops": windowed,
            # Pallas kernels lower to Mosaic custom calls (the scanned layer's body appears once).
            "pallas_kernels": text.count('custom_call_target="tpu_custom_call"')}


def fitting_step(config, bert_config, devices, mesh_kind: str, batch_per_chip: int, seq_len: int,
                 predictions: int, hbm_gib: float, what: str):
    """`(compiled, analysis, batch per chip, mesh)` of the step at `batch_per_chip` rows per chip,
    halved until the program fits the chip's `hbm_gib` (the TPU compiler refuses one that does not,
    RESOURCE_EXHAUSTED, which counts as not fitting). `analysis` is `analyze`'s, with the compile's
    seconds (`compile_s`) and the global batch (`global_batch`). RuntimeError (naming `what`) when
    not even one row per chip fits."""
    b = batch_per_chip
    while True:
        try:
            compiled, seconds, rows, mesh = compile_step(config, bert_config, devices, mesh_kind, b, seq_len,
                                                         predictions)
            analysis = dict(analyze(compiled, hbm_gib), compile_s=seconds, global_batch=rows)
            if analysis["fits"]:
                return compiled, analysis, b, mesh
            why = f"{analysis['hbm_gib']:.2f} GiB of HBM per chip"
        except Exception as e:  # noqa: BLE001 - the TPU compiler refuses what does not fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            why = str(e).splitlines()[0][:300]
        if b == 1:
            raise RuntimeError(f"{what}: a per-chip batch of 1 does not fit at length {seq_len} ({why})")
        b //= 2


def xla_costs(compiled) -> dict:
    """`{"flops", "bytes"}` of XLA's cost analysis (per chip; a loop body counted once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def xla_flops(compiled) -> float:
    return xla_costs(compiled)["flops"]


# The TPU compiler turns a matmul with a gathered (FSDP) or reduce-scattered operand into a loop
# ("windowed einsum", collective matmul) that overlaps each chunk's transfer with its share of the
# matmul. Turned off, the program does the same arithmetic without the loop.
NO_COLLECTIVE_MATMUL_LOOPS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                              "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def counting_depths(model_config) -> tuple:
    """The depths of the unrolled programs `counted_costs` compiles. BERT's layers are alike: 1 and
    2. ModernBERT's alternate, a global layer every `n = global_attn_every_n_layers` (layer 0 one),
    the rest local: 1 (a global), 2 (+ a local) and n + 1 (+ n - 2 locals and a global), which
    give the cost of the rest of the step, a global and a local layer. A model no deeper than the
    deepest of those is counted from one compile at its own depth."""
    from bert_jax.pretrain import model_family

    n = model_config.global_attn_every_n_layers if model_family.is_modernbert(model_config) else 1
    depths = (1, 2) if n == 1 else (1, 2, n + 1)
    return depths if model_config.num_hidden_layers > depths[-1] else (model_config.num_hidden_layers,)


def _layer_counts(model_config, layers: int) -> tuple:
    """`(1, global layers, local layers)` of the first `layers` layers (BERT's are all global)."""
    from bert_jax.pretrain import model_family

    if not model_family.is_modernbert(model_config):
        return (1, layers, 0)
    glob = sum(model_config.is_global(i) for i in range(layers))
    return (1, glob, layers - glob)


def _at_depth(model_config, layers: int, sparse: bool):
    """`model_config` with `layers` unrolled layers (BERT's last computed where the real program does)."""
    import dataclasses

    from bert_jax.pretrain import model_family

    if model_family.is_modernbert(model_config):  # never scanned
        return dataclasses.replace(model_config, num_hidden_layers=layers)
    return model_config.replace(num_hidden_layers=layers, scan_layers=False, sparse_last_layer=sparse)


def extrapolate(counts: list, depths: tuple, model_config) -> dict:
    """The full-depth `{"flops", "bytes"}` from `counts` of the programs at `depths`: each count is
    the rest of the step + globals x a global layer + locals x a local layer (`_layer_counts`),
    solved for those costs (the columns that occur) and summed at the model's depth."""
    import numpy as np

    if len(counts) == 1:
        return dict(counts[0])
    rows = np.array([_layer_counts(model_config, d) for d in depths], dtype=np.float64)
    used = [j for j in range(rows.shape[1]) if rows[:, j].any()]
    full = np.array(_layer_counts(model_config, model_config.num_hidden_layers), dtype=np.float64)[used]
    return {k: float(full @ np.linalg.solve(rows[:, used], np.array([c[k] for c in counts], dtype=np.float64)))
            for k in counts[0]}


def counted_costs(config, bert_config, devices, mesh_kind: str, batch_per_chip: int, seq_len: int,
                  predictions: int) -> tuple[dict, int]:
    """XLA's FLOPs and bytes accessed per chip of the full-depth step, and the loops left in the
    programs it counted.

    XLA's cost analysis counts a loop's body once: the scanned encoder's, and each collective
    matmul's (FSDP's gathered weights: without this it counts 21-25% fewer FLOPs than the model
    needs). So the counts come from unrolled compiles of a few layers (same widths, mesh and
    batch; `counting_depths`: BERT's 1 and 2, ModernBERT's 1, 2 and n + 1) without
    collective-matmul loops, extrapolated in depth (`extrapolate`; a shallow model is counted from
    one compile at its own depth). BERT's last layer
    is computed as in the real program (at the masked positions only when it is unrolled with
    `sparse_last_layer`; a scanned encoder computes it everywhere).
    """
    from bert_jax.model import modeling
    from bert_jax.pretrain import model_family

    sparse = (not model_family.is_modernbert(bert_config)
              and modeling.last_layer_queries(bert_config, seq_len, predictions) is not None)
    counts, loops, options = [], 0, NO_COLLECTIVE_MATMUL_LOOPS
    depths = counting_depths(bert_config)
    for layers in depths:
        small = _at_depth(bert_config, layers, sparse)
        try:
            compiled = compile_step(config, small, devices, mesh_kind, batch_per_chip, seq_len, predictions,
                                    compiler_options=options)[0]
        except Exception as e:  # noqa: BLE001 - a libtpu without these options: count with the loops
            if options is None or "No such compile option" not in str(e):
                raise
            options = None
            compiled = compile_step(config, small, devices, mesh_kind, batch_per_chip, seq_len, predictions)[0]
        counts.append(xla_costs(compiled))
        loops += len(re.findall(r"\swhile\(", compiled.as_text()))
    return extrapolate(counts, depths, bert_config), loops


def counted_flops(config, bert_config, devices, mesh_kind: str, batch_per_chip: int, seq_len: int,
                  predictions: int) -> tuple[float, int]:
    costs, loops = counted_costs(config, bert_config, devices, mesh_kind, batch_per_chip, seq_len, predictions)
    return costs["flops"], loops
