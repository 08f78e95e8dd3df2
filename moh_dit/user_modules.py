"""Modules a user names on a command line or in a config (``--extractor-module experiments.fmnist_classifier``,
``repa.encoder_module``, ``log.eval_extractor_module``), imported the way ``python -m`` imports them.

``python -m moh_dit`` and ``python train.py`` put the working folder (or the script's) first on the import path; the
installed ``moh-dit`` console script puts its own ``bin`` folder there instead, so a module of the repository a user
runs from would not import. Every entry point looks in the working folder, as ``python -m`` does.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from moh_dit.errors import ConfigError

__all__ = ["import_user_module", "working_folder_on_path"]


def working_folder_on_path() -> None:
    """Put the working folder on the import path, as ``python -m`` does (a no-op where it is there already)."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def import_user_module(name: str, option: str) -> ModuleType:
    """Import module ``name`` that the user gave as ``option`` (a command-line flag or a config key, named in the
    error); the working folder is searched first, as ``python -m`` searches it."""
    working_folder_on_path()
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError(
            f"{option} {name}: cannot import it ({err}); a module of a folder imports when you run the command from "
            f"that folder (the working folder is {os.getcwd()})"
        ) from None
