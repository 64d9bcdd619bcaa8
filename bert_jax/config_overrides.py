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
        node, ok = config, True
        for part in key.split(".")[1:]:
            if hasattr(node, "keys") and part in node.keys():
                node = node[part]
            else:
                ok = False
                break
        if not ok:
            near = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            messages.append(f"--{key}: {file_path} has no key {key!r}{hint}")
    return messages
