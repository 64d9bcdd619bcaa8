"""A run's exit code says why it ended, and whether running it again can help.

`bert_jax.pod.supervisor` relaunches a run that failed in a way another attempt may well get past
(a crash, a lost peer, a store that stalled past a deadline) and stops at once, with the cause,
when the same command would fail the same way again: burning hours of backoff on a bad config is
a weekend lost. The codes (sysexits.h's where one fits):

    0    finished, or stopped after saving on SIGTERM
    1    CRASH      an uncaught error not classed below                                  retried
    65   DATA       the data failed its checks: a corrupt, missing or unlisted record     not retried
                    file, a manifest mismatch, a token id past the vocabulary
    78   CONFIG     refused before training: the config, a flag, a path, the mesh, a      not retried
                    checkpoint that does not fit the model
    79   VERSION    a resume refused under other jax/flax/orbax/libtpu versions           not retried
    80   NONFINITE  a non-finite loss under nonfinite="stop", or too many in a row         not retried
    81   DIVERGED   a loss spike under on_divergence="stop", or the rollback budget spent  not retried
    124  DEADLINE   a checkpoint save or restore past its deadline (a stalled store)      retried
    128+N           killed by signal N (137: SIGKILL, an OOM kill)                        retried

Classing an error: a few types are classed by what they are (`of`); the checks a loop runs
before it trains are classed by where they are raised, inside `refusals()`, since the same
`ValueError` raised by a training step is a bug worth a retry, not a bad config.

This module imports nothing of bert_jax, jax or TensorFlow: the supervisor reads it too.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, NoReturn

CRASH = 1
DATA = 65
CONFIG = 78
VERSION = 79
NONFINITE = 80
DIVERGED = 81
DEADLINE = 124

# Exit codes that another attempt of the same command cannot get past, and what each means.
NOT_RETRIED = {
    DATA: "data error",
    CONFIG: "refused config",
    VERSION: "library versions refused",
    NONFINITE: "non-finite loss",
    DIVERGED: "diverged",
}

_ATTRIBUTE = "bert_jax_exit_code"


def mark(error: BaseException, code: int) -> BaseException:
    """Classes `error` as `code` (unless it is classed already); returns it."""
    if getattr(error, _ATTRIBUTE, None) is None:
        setattr(error, _ATTRIBUTE, code)
    return error


@contextlib.contextmanager
def refusals(code: int = CONFIG, types: tuple = (ValueError, TypeError, KeyError)) -> Iterator[None]:
    """Errors of `types` raised in the block are refusals (`code`): wrap a loop's checks before training.

    A `SystemExit` with a message (a check that exits, such as the hosts' config comparison) is one too.
    An error that `of` classes by its type keeps that class: a `VersionMismatchError` or a data
    manifest's mismatch is a `ValueError` too, and stays 79 or 65 when raised in the block.
    """
    try:
        yield
    except types as e:
        if of(e) == CRASH:
            mark(e, code)
        raise
    except SystemExit as e:
        if isinstance(e.code, str):
            mark(e, code)
        raise


def _loaded(module: str, *names: str) -> tuple:
    """The classes `names` of `module` if it is imported (an error of a module never imported cannot
    be of its types): no import here pulls in TensorFlow at exit."""
    loaded = sys.modules.get(module)
    return tuple(getattr(loaded, name) for name in names if hasattr(loaded, name)) if loaded else ()


def of(error: BaseException) -> int:
    """The exit code a run that ends with `error` should end with."""
    marked = getattr(error, _ATTRIBUTE, None)
    if marked is not None:
        return marked
    classes = (
        (_loaded("bert_jax.versions", "VersionMismatchError"), VERSION),
        (_loaded("bert_jax.pretrain.divergence", "DivergenceError"), DIVERGED),
        (_loaded("bert_jax.pretrain.loop", "NonFiniteLossError"), NONFINITE),
        (_loaded("data_pipeline.records.reader", "CorruptDataError")
         + _loaded("data_pipeline.records.manifests", "ManifestMismatchError", "UnreadableManifest")
         + _loaded("data_pipeline.tasks", "DataError"), DATA),
    )
    for types, code in classes:
        if types and isinstance(error, types):
            return code
    if isinstance(error, SystemExit) and isinstance(error.code, str):
        return CONFIG  # `raise SystemExit("FATAL: ...")`: a refusal with its message
    return CRASH


def describe(code: int) -> str:
    """A few words on `code` ("refused config", "crash", "killed by SIGKILL", ...)."""
    if code in NOT_RETRIED:
        return NOT_RETRIED[code]
    if code == DEADLINE:
        return "a checkpoint save or restore past its deadline"
    if code > 128:
        import signal
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return "crash" if code else "finished"


def retried(code: int) -> bool:
    """Whether another attempt of the same command may get past a run that exited with `code`."""
    return code not in NOT_RETRIED


def exit_for(error: BaseException) -> NoReturn:
    """Ends the process with `error`'s code, after its traceback (and a line naming the class) on stderr."""
    import traceback
    code = of(error)
    if isinstance(error, SystemExit):
        print(error.code, file=sys.stderr)
    else:
        traceback.print_exception(error)
    print(f"bert_jax: exit code {code} ({describe(code)}"
          f"{'' if retried(code) else ': running the same command again would fail the same way'})",
          file=sys.stderr, flush=True)
    raise SystemExit(code)
