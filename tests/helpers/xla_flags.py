"""XLA_FLAGS of every test process: the fake CPU devices it asks for, LLVM's optimization level 0,
and XLA's older fusion code generator.

The suite's models are tiny: compiling their programs costs more than running them, and at
`--xla_backend_optimization_level=0` XLA's CPU backend compiles several times faster (the
fine-tuning loop's `config.xla_backend_optimization_level=0` does the same per program). Measured
side by side on the 2-core machine (2026-11-26): tests/model/test_fp8.py 174 -> 126 s, test_training.py
with test_modeling.py 571 -> 403 s. Results agree with the default level to float32 rounding; runs
compared bit for bit (kill -9 and resume, one process against two) all use these flags.

`--xla_cpu_use_fusion_emitters=false` emits fused loops with XLA's elemental IR emitter instead of
the MLIR fusion emitters that are the CPU backend's default: compiling a 2-layer BERT's training
step (tests' sizes) then takes half the time (alternating, 3 runs each on the 2-core machine beside
a running test suite, 2026-11-27: 13.4 -> 6.2 s compile, 22.5 -> 13.2 CPU s for the whole process;
the suite on a clean clone, 2,028 -> 1,497 s with data_pipeline.tf_import's start). Both emitters
compute the same operations, and the parity tests against transformers and Google's graph hold
their bounds; two programs of the same update may round differently, by an ulp of a parameter
(tests/training/test_training.py's bench variant tests, bit for bit under the default emitter).
The TPU
compiles of test_aot_tpu.py and test_plan.py keep libtpu's defaults (their processes set no flag);
the pod rehearsal's workers (tests/pod/test_pod_rehearsal.py) get FAST_COMPILE alone (their devices
come from JAX_NUM_CPU_DEVICES).
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int = 0) -> str:
    """XLA_FLAGS with `devices` fake CPU devices (0: jax's default, or JAX_NUM_CPU_DEVICES)."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}" if devices else FAST_COMPILE
