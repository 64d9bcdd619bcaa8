"""Ahead-of-time compilation of the sharded pretraining step for Cloud TPU pod slices, on a CPU machine.

    pip install 'libtpu==0.0.42.*'    # the TPU compiler, matching jax 0.10.2; no TPU needed
    python -m benchmarks.step.aot_tpu --config=configs/large.py \\
        [--topology=v4-32,v5p-64,v5e-16] [--mesh=data,fsdp,tensor] [--seq_len=128] \\
        [--batch_per_chip=32] [--max_batch_per_chip=1024] [--attention=einsum] [--json]

The check is the pod's, `bert_jax.pod.planning.aot_check` (`python -m bert_jax.pod.planning.aot_check`, the same
flags): per slice and mesh, the per-chip batch that fits, HBM, XLA's FLOPs against the model's,
the compute-only MFU ceiling, the largest batch, the collectives and Pallas kernels of the program.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bert_jax.pod.planning import aot_check  # noqa: E402  (after JAX_PLATFORMS)

if __name__ == "__main__":
    aot_check.main()
