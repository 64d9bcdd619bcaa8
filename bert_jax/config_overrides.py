"""Command-line config overrides checked against the config file before any work: an unknown
`--config.key` is named with the nearest valid keys (ml_collections raises a bare AttributeError
from inside flag parsing, as a traceback). And the one place a `--config` value becomes a file:
`--config=configs/base.py` or `--config=base` from any folder (`resolve_config`)."""

from __future__ import annotations

import difflib
import importlib.util
import os
import pkgutil
from typing import Optional, Sequence

from data_pipeline import storage


def known_configs() -> list[str]:
    """The names of the installed `configs` package's modules (`base`, `glue`, ...); [] without it."""
    try:
        import configs
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(configs.__path__) if not m.name.startswith("_"))


def resolve_config(value: str, flag: str = "--config") -> str:
    """The config file a `--config` value names, with its `:kind` suffix kept (`own_data.py:tagging`).

    An existing file is used as is. Otherwise `configs/<name>.py`, `<name>.py` or `<name>`, where
    `<name>` is a module of the installed `configs` package, is that module's file, found by
    importlib (not in the current folder): the README's commands run from any folder and after a
    non-editable install. Anything else raises ValueError naming the flag, the value and the
    known config names.
    """
    path, colon, kind = value.partition(":")  # as ml_collections splits it
    if path and storage.isfile(path):
        return value
    name = os.path.normpath(path).replace(os.sep, "/") if path else ""
    name = name[len("configs/"):] if name.startswith("configs/") else name
    name = name[:-len(".py")] if name.endswith(".py") else name
    names = known_configs()
    if name in names:
        spec = importlib.util.find_spec(f"configs.{name}")
        if spec is not None and spec.origin and storage.isfile(spec.origin):
            return spec.origin + colon + kind
    known = ", ".join(names) if names else "none (the configs package is not installed)"
    raise ValueError(f"{flag}={value}: no such file, and {name or path!r} is not a config of the installed "
                     f"configs package; known configs: {known}")


def resolve_config_argv(argv: Sequence[str], flag: str = "config") -> list[str]:
    """`argv` with the value of its `--config=VALUE` (or `--config VALUE`) resolved (`resolve_config`)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith(f"--{flag}="):
            out[i] = f"--{flag}=" + resolve_config(arg.split("=", 1)[1], f"--{flag}")
        elif arg == f"--{flag}" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1], f"--{flag}")
    return out


def load_config(value: str, flag: str = "--config", module_name: str = "_bert_jax_config"):
    """The ConfigDict of a `--config` value (`resolve_config`): its file's `get_config()`, given the
    `:kind` suffix where there is one, as ml_collections calls it. For tools outside absl's flags
    (`bert_jax.plan`, the benchmarks)."""
    file_path, _, kind = resolve_config(value, flag).partition(":")
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(kind) if kind else module.get_config()


def _config_path(argv: Sequence[str]) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _flat_keys(d, prefix="config") -> list[str]:
    out = []
    for k in d.keys():
        value = d[k]
        out.append(f"{prefix}.{k}")
        if hasattr(value, "keys") and callable(value.keys):
            out.extend(_flat_keys(value, f"{prefix}.{k}"))
    return out


def _parent(config, dotted: str):
    """The ConfigDict holding `config.a.b`'s last key, or None where the config lacks the key."""
    node = config
    parts = dotted.split(".")[1:]
    for part in parts:
        if not (hasattr(node, "keys") and part in node.keys()):
            return None
        parent, node = node, node[part]
    return parent if parts else None


def _no_such_key(dotted: str, valid: list[str], path: str) -> str:
    near = difflib.get_close_matches(dotted, valid, n=3, cutoff=0.6)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    return f"--{dotted}: {path} has no key {dotted!r}{hint}"


def unknown_overrides(argv: Sequence[str]) -> list[str]:
    """One message per `--config.a.b=...` whose key the config file does not define."""
    path = _config_path(argv)
    if not path:
        return []
    file_path = path.partition(":")[0]
    try:
        config = load_config(path, module_name="_bert_jax_config_for_check")
    except Exception:  # noqa: BLE001 - the real parse reports a missing or broken config file itself
        return []
    valid = _flat_keys(config)
    messages = []
    for a in argv:
        if not a.startswith("--config."):
            continue
        key = "config." + a[len("--config."):].split("=", 1)[0]
        if _parent(config, key) is None:
            messages.append(_no_such_key(key, valid, file_path))
    return messages


def _parse_value(key: str, text: str, current):
    """`text` as the type of the field's current value (ml_collections' flags do the same)."""
    import ast

    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--{key}={text}: expected true or false")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--{key}={text}: expected an integer") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"--{key}={text}: expected a number") from None
    if isinstance(current, str):
        return text
    if isinstance(current, tuple):  # as ml_collections' flags: `1,2,3` or `(1, 2, 3)`; `3` -> (3,)
        from ml_collections.config_flags import tuple_parser
        try:
            return tuple_parser.TupleParser().parse(text)
        except ValueError as e:
            raise ValueError(f"--{key}={text}: {e}") from None
    try:  # None or a container: a Python literal, else the text itself
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(config, overrides: Sequence[str], path: str = "the config file") -> list[str]:
    """Sets each `--config.a.b=value` of `overrides` on `config` (a ConfigDict), the value parsed
    as the field's type, for command-line tools outside absl's flags (`bert_jax.plan`). A key the
    config does not define or a value of the wrong type raises ValueError naming the flag. Returns
    the keys set."""
    valid = _flat_keys(config)
    done = []
    for arg in overrides:
        if not arg.startswith("--config.") or "=" not in arg:
            raise ValueError(f"{arg}: expected --config.key=value")
        dotted, text = arg[len("--"):].split("=", 1)
        node = _parent(config, dotted)
        if node is None:
            raise ValueError(_no_such_key(dotted, valid, path))
        leaf = dotted.rsplit(".", 1)[1]
        node[leaf] = _parse_value(dotted, text, node[leaf])
        done.append(dotted)
    return done


# The `--config.*` keys the command line of this process set (`bert_jax.main` records them): with
# an init checkpoint, a `config.model` key given here is the user's choice, where the config file's
# value is only a default that the checkpoint's own config replaces (`run_setup.bert_config_from`).
_GIVEN: set = set()


def record_command_line(argv: Sequence[str]) -> None:
    _GIVEN.clear()
    _GIVEN.update("config." + a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config."))


def given_on_command_line() -> frozenset:
    """The dotted keys (`config.model.hidden_size`, ...) set with `--config.key=value` in this process."""
    return frozenset(_GIVEN)
