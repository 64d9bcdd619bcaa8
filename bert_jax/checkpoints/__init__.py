"""Checkpoints: orbax saves and restores of the train state with the input's position, their layout
on disk, reading, integrity manifests, preemption and the save deadline (docs/architecture.md,
docs/reliability.md). Nothing here imports the training loops.

  checkpointing         `Checkpointer`: async saves, keep-K, auto-resume, the multi-host agreement
  checkpoint_steps      a step's layout on disk, its errors, verifying it, moving a damaged one aside
  checkpoint_reading    pytree keys, restore targets, read-only access to a step
  checkpoint_integrity  the manifest of what a step wrote, and whether it is still that
  preemption            when a loop should save and stop (SIGTERM, the cloud's notice)
  save_deadline         a deadline on every save: a stalled store ends the run loudly
"""
