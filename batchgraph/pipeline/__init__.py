"""Pipeline-parallel training: schedules as data, a validator, a simulator and runtimes."""

from __future__ import annotations

__all__: list[str] = []
