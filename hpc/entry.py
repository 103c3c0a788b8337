"""A spec's entries (``model.entry``, ``data.entry``): ``"package.module:function"``, imported and called.

An entry is imported from the job's working directory or an installed package, and called with
its spec table (``[model.args]``, ``[data.args]``) as keyword arguments. Whatever goes wrong in
the user's module (it does not import, it has no such function, the arguments do not fit, it
calls ``sys.exit``) is one ``ConfigError`` line naming the spec key.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hpc.errors import ConfigError


def load_entry(entry: str, key: str) -> Callable[..., Any]:
    """The function ``entry`` ("package.module:function") names, or a ConfigError naming ``key``."""
    module_name, sep, function_name = entry.partition(":")
    if not sep or not module_name or not function_name.isidentifier():
        raise ConfigError(f"{key} must be 'package.module:function', got {entry!r}")
    if os.getcwd() not in sys.path:  # the job's working directory, as `python -m` would see it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}={entry!r}: cannot import {module_name!r} ({exc})") from None
    except Exception as exc:  # the user's module failed while importing: one line
        raise ConfigError(f"{key}={entry!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except SystemExit as exc:  # sys.exit() in the module: it would end hpc with that code and no word
        raise ConfigError(f"{key}={entry!r}: importing {module_name!r} exited {_exit_code(exc)}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"{key}={entry!r}: {module_name!r} has no function {function_name!r}")
    return function


def call_entry(function: Callable[..., Any], args: Mapping[str, Any], entry: str, key: str) -> Any:
    """``function(**args)``; arguments it does not take are one error line naming ``<key>.args``."""
    table = key.rsplit(".", 1)[0] + ".args"
    try:
        inspect.signature(function).bind(**args)
    except TypeError as exc:
        raise ConfigError(f"{table} do not fit {entry}: {exc}") from None
    except ValueError:  # no signature to inspect (a builtin): let the call say
        pass
    try:
        return function(**args)
    except SystemExit as exc:  # sys.exit() in the entry: it would end hpc (or the rank) with that code and no word
        raise ConfigError(f"{key}={entry!r} exited {_exit_code(exc)} instead of returning") from None


def _exit_code(exc: SystemExit) -> str:
    """How ``SystemExit`` says it: ``with code 3``, or its message (``sys.exit("why")``)."""
    code = 0 if exc.code is None else exc.code
    return f"with code {code}" if isinstance(code, int) else f"with the message {str(code)[:200]!r}"
