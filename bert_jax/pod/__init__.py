"""A pod's operations: planning a run before renting the slice (`python -m bert_jax.plan`), and
running it unattended (the supervisor of `launch/tpu_pod.sh --watch`).

    planning/   the planner of `python -m bert_jax.plan` and its parts: the step compiled ahead of
                time, what it moves, the step-time model (its `__init__.py` lists them)

    supervisor  the loop: watches the slice and the run, ends, relaunches, recreates, gives up
    slice_recovery  the supervisor's slice when not READY: queued, lost, stopped, stuck; maintenance
    slice       the Cloud TPU slice through gcloud: describe, recreate, start; structured errors
    progress    hang detection: the run's log and checkpoints as progress signals; the step resumed
    attempts    attempts.jsonl (never lost, never twice) and the lease (one supervisor per workdir)
    pins        the project snapshot every attempt ships, and the versions a reinstall is pinned to
    calls       every gcloud and storage call bounded in time and retried
    settings    the supervisor's settings, each from its environment variable (POLL_SECONDS, ...)

The supervisor's modules import neither jax nor TensorFlow: Python, gcloud, and
`data_pipeline.storage` (gcsfs for a gs:// workdir) are all it needs; docs/pretraining.md ("Running
on a pod") says what it does. The planner's compile with jax and libtpu (the chips' figures are
`bert_jax.training.chips`); docs/pod_planning.md states its model.
"""
