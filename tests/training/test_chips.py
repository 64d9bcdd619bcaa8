"""bert_jax.training.chips: one peak FLOP/s per chip, read by the pod planner and the loops' MFU alike."""

from unittest import mock

from bert_jax.training import chips, run_setup


def test_device_kinds_read_the_chip_table():
    assert chips.peak_flops("TPU v4") == chips.CHIPS["v4"].peak_flops == 275e12
    assert chips.peak_flops("TPU v5 lite") == chips.peak_flops("TPU v5e") == chips.CHIPS["v5e"].peak_flops
    assert chips.peak_flops("TPU v5p") == chips.CHIPS["v5p"].peak_flops
    assert chips.peak_flops("TPU v6 lite") == chips.CHIPS["v6e"].peak_flops
    assert chips.peak_flops("NVIDIA H100 80GB HBM3") == chips.peak_flops("NVIDIA H200") == chips.H100["peak_flops"]
    assert chips.peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert chips.peak_flops("cpu") is None


def test_run_setup_takes_the_devices_peak_from_the_chip_table():
    device = mock.Mock(device_kind="TPU v5p")
    with mock.patch.object(run_setup.jax, "devices", return_value=[device]):
        assert run_setup.peak_flops_per_device() == chips.CHIPS["v5p"].peak_flops
    device.device_kind = "cpu"
    with mock.patch.object(run_setup.jax, "devices", return_value=[device]):
        assert run_setup.peak_flops_per_device() is None
