"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TensorFlow must not grab both cores' worth of threads or print its banner in tests.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
