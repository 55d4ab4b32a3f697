"""Shared helpers for benchmark scripts: environment stamp and result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import jax

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "device": f"{device.platform}: {getattr(device, 'device_kind', '')}".strip(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def write_results(name: str, payload: dict, table: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    env = payload["environment"]
    header = (f"# {name}\n\n{env['date']} · {env['device']} · {env['cpu_count']} CPUs · "
              f"Python {env['python']} · jax {env['jax']}\n\n")
    (RESULTS / f"{name}.md").write_text(header + table + "\n")
