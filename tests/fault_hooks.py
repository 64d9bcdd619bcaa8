"""Fault hooks the storage tests install as a run's `sitecustomize` (source text, run at start-up)."""

# The bucket stops answering (the emulator, $BERT_JAX_TEST_EMULATOR_PID, SIGSTOPped) as this process
# starts saving step $FAULT_FREEZE_AT_SAVE.
FREEZE_AT_SAVE = r"""
import os
_freeze_step = os.environ.get("FAULT_FREEZE_AT_SAVE")
if _freeze_step:
    import signal
    import orbax.checkpoint as ocp
    _save_unfrozen = ocp.CheckpointManager.save

    def _frozen_save(self, step, *args, **kwargs):
        if step == int(_freeze_step):
            os.kill(int(os.environ["BERT_JAX_TEST_EMULATOR_PID"]), signal.SIGSTOP)
        return _save_unfrozen(self, step, *args, **kwargs)

    ocp.CheckpointManager.save = _frozen_save
"""
