"""The GCS emulator (fake-gcs-server, started by tests/conftest.py's `gcs_server` fixture and by
tests that need one of their own): what keeps it answering."""

import threading


def drain_stderr(server) -> None:
    """The wrapper pipes the server's stderr, where it logs every request, and never reads it:
    once the pipe's 64 KiB fill, the server blocks mid-request. A thread reads it away."""
    pipe = server._process.stderr  # pylint: disable=protected-access
    threading.Thread(target=lambda: all(iter(lambda: pipe.read(1 << 16), b"")), daemon=True).start()
