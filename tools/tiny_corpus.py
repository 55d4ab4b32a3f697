"""The training corpus of deepinfer-tiny-v4: the Python standard library of the running
interpreter, split into train and a fixed held-out list of modules present in 3.11 and 3.12."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Held out from training: modules that exist (with these paths) in CPython 3.11 and 3.12.
HELD_OUT = ("json", "email", "http", "logging", "argparse.py", "textwrap.py", "csv.py",
            "statistics.py", "fractions.py", "heapq.py", "bisect.py", "dataclasses.py",
            "string.py", "shlex.py", "calendar.py", "difflib.py")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files), sorted, relative to the stdlib root."""
    root = root or stdlib_root()
    files = sorted(p.relative_to(root) for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and p.is_file())
    held = [p for p in files if p.parts[0] in HELD_OUT]
    train = [p for p in files if p.parts[0] not in HELD_OUT]
    return train, held


def read_text(root: Path, rel: Path) -> str:
    return (root / rel).read_bytes().decode("utf-8", errors="replace")


def manifest(root: Path, files: list[Path]) -> list[dict]:
    return [{"path": str(p), "sha256": hashlib.sha256((root / p).read_bytes()).hexdigest()[:16]}
            for p in files]
