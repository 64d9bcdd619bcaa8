"""Checkpoints: orbax saves and restores of the train state with the input's position, their layout
on disk, reading, integrity manifests, preemption and the save deadline (docs/architecture.md,
docs/reliability.md). Nothing here imports the training loops.

  checkpointer          `Checkpointer`: async saves, keep-K, auto-resume, moving diverged steps aside
  orbax_manager         the orbax `CheckpointManager` as configured: options, handlers, its save timeout
  restorer              one restore of a step: verified, read within its deadline, one outcome on all hosts
  step_dirs             a step's layout on disk, its errors, verifying it, moving a damaged one aside
  saved_state           pytree keys, restore targets, one host's read of a step, read-only access
  integrity             the manifest of what a step wrote, and whether it is still that
  input_state           each host's input-pipeline state beside a step: write, check, prune
  host_agreement        the hosts' exchanges: one verdict on a step, one outcome of a restore
  intact_steps          which steps every host takes for intact, and the newest one to resume
  preemption            when a loop should save and stop (SIGTERM, the cloud's notice)
  save_deadline         a deadline on every save and restore: a stalled store ends the run loudly
"""
