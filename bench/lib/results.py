"""Result files: JSON (everything measured) plus a Markdown table, under bench/results/ (or
$BENCH_RESULTS_DIR, where a GPU suite collects a run's files apart from the tree's), each
stamped with what a reader needs to trust or repeat the figure: the date, the device, the
library versions, the commit and the exact command, its environment settings included (the
DEEPINFER_*, XLA_FLAGS and XLA_PYTHON_CLIENT_* variables change what runs)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or REPO / "bench" / "results")

# The distributions a figure can depend on; those not installed are left out.
LIBRARIES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "numpy", "ml_dtypes",
             "torch", "transformers", "tokamax", "llguidance")


def versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def commit() -> str | None:
    """The tree's commit, '+' where tracked files differ from it; None outside a git checkout
    (a GPU machine given a copy of the files)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command() -> str:
    """This process's command line, as one could type it again from the repository root."""
    settings = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                if k.startswith(("DEEPINFER_", "XLA_PYTHON_CLIENT_")) or k == "XLA_FLAGS"]
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return " ".join([*settings, "python", shlex.join([str(script), *sys.argv[1:]])])


def environment() -> dict:
    device = jax.devices()[0]
    found = versions()
    return {
        "date": datetime.date.today().isoformat(),
        "device": f"{device.platform}: {getattr(device, 'device_kind', '')}".strip(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": found.get("jax", jax.__version__),
        "versions": found,
        "commit": commit(),
    }


def stamp(env: dict, cmd: str) -> str:
    """The Markdown file's second line: where, when, with what, and how to run it again."""
    libraries = " · ".join(f"{k} {v}" for k, v in env.get("versions", {"jax": env["jax"]}).items())
    at = f" · commit {env['commit']}" if env.get("commit") else ""
    return (f"{env['date']} · {env['device']} · {env['cpu_count']} CPUs · "
            f"Python {env['python']} · {libraries}{at}\n\nCommand: `{cmd}`")


def write_results(name: str, payload: dict, table: str) -> Path:
    """bench/results/NAME.{json,md}; the payload gains "environment" and "command" where it
    has none. Returns the Markdown file's path."""
    payload.setdefault("environment", environment())
    payload.setdefault("command", command())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    markdown = RESULTS / f"{name}.md"
    markdown.write_text(f"# {name}\n\n{stamp(payload['environment'], payload['command'])}\n\n"
                        f"{table}\n")
    return markdown
