"""Running on a pod, unattended: the supervisor of `launch/tpu_pod.sh --watch` and its parts.

    supervisor  the loop: watches the slice and the run, ends, relaunches, recreates, gives up
    slice       the Cloud TPU slice through gcloud: describe, recreate, start; structured errors
    progress    hang detection: the run's log and checkpoints as progress signals
    records     attempts.jsonl (never lost, never twice) and the lease (one supervisor per workdir)
    pins        the project snapshot every attempt ships, and the versions a reinstall is pinned to
    calls       every gcloud and storage call bounded in time and retried

It imports neither jax nor TensorFlow: Python, gcloud, and `data_pipeline.storage` (gcsfs for a
gs:// workdir) are all it needs. docs/pretraining.md ("Running on a pod") says what it does.
"""
