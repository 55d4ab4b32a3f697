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


def encode_splits(tok, max_files: int = 0):
    """(train stream, held-out stream, manifest) of the running interpreter's stdlib."""
    import sys

    from tiny_tokenizer import token_stream

    root = stdlib_root()
    train_files, held_files = corpus_files(root)
    if max_files:
        train_files, held_files = train_files[:max_files], held_files[: max_files // 4 + 1]
    train = token_stream(tok, [read_text(root, p) for p in train_files])
    held = token_stream(tok, [read_text(root, p) for p in held_files])
    info = {"python": sys.version.split()[0], "stdlib": str(root),
            "held_out_modules": list(HELD_OUT),
            "tokens": {"train": int(len(train)), "held_out": int(len(held))},
            "train_files": manifest(root, train_files), "held_out_files": manifest(root, held_files)}
    return train, held, info


def prepare(out: Path, vocab_size: int, specials: list[str], max_files: int = 0) -> dict:
    """Train the tokenizer on the train files and write the token streams:
    out/{tokenizer.json, train.npy, held_out.npy, manifest.json}."""
    import json

    import numpy as np
    from tiny_tokenizer import train_tokenizer

    root = stdlib_root()
    train_files, _ = corpus_files(root)
    if max_files:
        train_files = train_files[:max_files]
    tok = train_tokenizer([read_text(root, p) for p in train_files], vocab_size, specials)
    train, held, info = encode_splits(tok, max_files)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    np.save(out / "train.npy", train)
    np.save(out / "held_out.npy", held)
    (out / "manifest.json").write_text(json.dumps(info, indent=1))
    return info
