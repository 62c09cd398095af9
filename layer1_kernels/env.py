"""On/off switches read from the environment (the kernels' measured options).

Strict on purpose: "1" on, "0" off, unset the default, anything else an error that names the
variable -- a typo ("true", "on") must not silently leave a kernel path on or off.
"""
from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """The switch `name`: "1" True, "0" False, unset `default`; ValueError otherwise."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
