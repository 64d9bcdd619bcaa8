"""Storage on Cloud Storage: the one gs:// client (gcsfs), shared with orbax, and its time limits.

The backend, and why: fsspec's `gcsfs`, the `[gcs]` extra. It is the client orbax's path library
(`etils.epath`) uses for gs:// once `EPATH_USE_TF=false`, which this module sets unless the user
set it: so our files and orbax's checkpoints go through one client, one credential chain (Google's
application-default credentials: the TPU VM's service account) and one endpoint override
(`STORAGE_EMULATOR_HOST`, which the tests point at a local fake-gcs-server). `tf.io.gfile` was the
other candidate: its GCS client has no endpoint override, so nothing written through it could be
tested off Google's cloud, and the model side of the project must run without TensorFlow.
(orbax's array data goes through tensorstore's own GCS driver; its endpoint override is
`TENSORSTORE_GCS_HTTP_URL`.)

Time: every Cloud Storage request through gcsfs (ours, and orbax's metadata through etils.epath)
ends within `gcs_timeout()` (`$BERT_JAX_GCS_TIMEOUT`, 60 s; gcsfs's own default is none) or
raises `TimeoutError`, which gcsfs does not retry; the errors it retries get six tries, so a call
ends within 6 x the timeout + 36 s. Writes that only feed logs do not wait even that long on the
training step: `data_pipeline.storage.log_writer` does them in the background.

Importing this module (`data_pipeline.storage` does) is what points orbax at gcsfs: import it
before orbax resolves its first gs:// path. gcsfs itself is imported only when a gs:// path is used.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from data_pipeline.storage.paths import StorageError, check, scheme

GCS_TIMEOUT_ENV = "BERT_JAX_GCS_TIMEOUT"
GCS_TIMEOUT_S = 60.0  # gcsfs moves at most 50 MiB per request (bigger uploads go in chunks): >= 0.8 MiB/s


def gcs_timeout() -> Optional[float]:
    """Seconds one Cloud Storage request may take, all of it (`$BERT_JAX_GCS_TIMEOUT`, default 60;
    0 for none, gcsfs's own default).

    gcsfs's default is no limit: one stalled connection then blocks its caller forever (on a pod,
    host 0 in a log write while the others wait for it in the next collective, with no error). A
    request past the limit raises `TimeoutError` (fsspec's `FSTimeoutError`), which gcsfs does not
    retry; the errors it does retry (HTTP 408/429/5xx, dropped connections) get its fixed six tries
    with 1-16 s backoff, so one call ends within 6 x the timeout + 36 s. `storage.read_bytes`
    fetches a whole object in one request: raise the limit to read a large one over a slow link.
    """
    value = os.environ.get(GCS_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(value) if value else GCS_TIMEOUT_S
    except ValueError:
        raise ValueError(f"${GCS_TIMEOUT_ENV}={value!r}: not a number of seconds") from None
    return seconds if seconds > 0 else None


# orbax (etils.epath) then reaches gs:// through gcsfs, as this module does (see the docstring).
# Set before epath first resolves a gs:// backend; a value the user set wins.
os.environ.setdefault("EPATH_USE_TF", "false")
try:  # without a listings cache (tensorstore, other hosts and this module write beside it), and
    # with our request time limit for orbax's gcsfs too (its checkpoint metadata, `filesystem` here)
    import fsspec.config as _fsspec_config
    for _protocol in ("gs", "gcs"):
        _fsspec_config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)
        _fsspec_config.conf[_protocol].setdefault("requests_timeout", gcs_timeout())
except ImportError:  # pragma: no cover - fsspec comes with orbax
    pass


_FS_LOCK = threading.Lock()
_FS: dict = {}


def filesystem(path):
    """The fsspec file system of a remote path (one per process and scheme; listings never cached:
    other processes and orbax's threads write under the same prefixes; each request limited to
    `gcs_timeout()`). It takes `storage_paths.object_key` forms of paths."""
    s = scheme(path)
    key = (s, os.getpid())  # gcsfs holds an event loop thread: never reuse one across a fork
    with _FS_LOCK:
        if key not in _FS:
            check(os.fspath(path))
            if s == "gs":
                import gcsfs
                _FS[key] = gcsfs.GCSFileSystem(use_listings_cache=False, requests_timeout=gcs_timeout())
            else:  # pragma: no cover - check() refuses every other scheme
                raise StorageError(f"no backend for {path}")
        return _FS[key]
