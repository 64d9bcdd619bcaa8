"""Command-line config overrides checked against the config file before any work: an unknown
`--config.key` is named with the nearest valid keys (ml_collections raises a bare AttributeError
from inside flag parsing, as a traceback)."""

from __future__ import annotations

import difflib
import importlib.util
from typing import Optional, Sequence


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
    file_path, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("_bert_jax_config_for_check", file_path)
    if spec is None or spec.loader is None:
        return []
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config(arg) if arg else module.get_config()
    except Exception:  # noqa: BLE001 - the real parse reports a broken config file itself
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
# value is only a default that the checkpoint's own config replaces (`pretrain.bert_config_from`).
_GIVEN: set = set()


def record_command_line(argv: Sequence[str]) -> None:
    _GIVEN.clear()
    _GIVEN.update("config." + a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config."))


def given_on_command_line() -> frozenset:
    """The dotted keys (`config.model.hidden_size`, ...) set with `--config.key=value` in this process."""
    return frozenset(_GIVEN)
