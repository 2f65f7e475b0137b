"""Glue shared by the tasks: common options, clean one-line errors, JSON or rich output.

tasks.py stays a list of thin task functions; what they have in common lives here.
"""
from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

from invoke.exceptions import Exit
from rich.console import Console

from harness.errors import HarnessError
from harness.inventory import Inventory, HostSpec, load_inventory, select_hosts

#: help strings of the options every host task takes
COMMON_HELP = {
    "inventory": "inventory file (default ./inventory.yaml, or $HARNESS_INVENTORY)",
    "hosts": "comma-separated host names (default: every host in the inventory)",
    "json": "print JSON only (for machines) instead of the table",
}

# soft_wrap: a message stays one line when output is not a terminal (rich wraps at 80 columns otherwise)
stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def clean_errors(fn: Callable) -> Callable:
    """Turn a HarnessError (and Ctrl-C) into a one-line message and a non-zero exit, no traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HarnessError as e:
            raise Exit(f"error: {e}", code=2)
        except KeyboardInterrupt:
            raise Exit("interrupted", code=130)
    return wrapper


def load(inventory: str | None, hosts: str | None) -> tuple[Inventory, list[HostSpec]]:
    inv = load_inventory(inventory)
    return inv, select_hosts(inv, hosts)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()
