"""Planning a pod run before renting the slice (`python -m bert_jax.plan`, whose entry point is
`bert_jax/plan.py`): per slice and mesh, the batch that fits, the step time, how it scales. The
modules compile with jax and libtpu, no TPU needed (docs/pod_planning.md states the model).

    planner     the plan: per slice and mesh, the batch that fits, the step time, scaling, recipes
    aot         the pretraining step compiled ahead of time for a slice's real devices (libtpu)
    aot_check   does the step fit a slice: the batch that fits, the largest, the MFU ceiling
                (`python -m bert_jax.pod.planning.aot_check`; `python -m benchmarks.step.aot_tpu` runs it)
    hlo         a compiled program's HLO text read: its collectives (bytes, groups, executions)
    traffic     what one run of a program reads and writes, by memory space (its HBM traffic)
    cost        the stated model of a step's time on a slice, and time-to-train
"""
