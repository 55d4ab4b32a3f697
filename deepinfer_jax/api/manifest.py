"""Run manifests: what a run needs to be replayed, and the comparison of a replay with it.

A manifest is one JSON file written beside a run's results: the model files' sha256, the
model's config.json, the engine options and model args, the seeds, the package versions, the
project's commit, the device, and every request the run sent with its output. Outputs hold the
exact numbers (Python floats round-trip through JSON), so a replay compares them bitwise.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import subprocess
from pathlib import Path

import jax

MANIFEST_VERSION = 1
PACKAGES = ("deepinfer-jax", "jax", "jaxlib", "numpy", "ml_dtypes", "flax", "tokenizers", "lm_eval",
            "datasets")
_REPO = Path(__file__).resolve().parents[2]


def file_hashes(model_dir: str | Path) -> dict[str, str]:
    """sha256 of every file under the model directory, by path relative to it."""
    root = Path(model_dir)
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit() -> dict | None:
    """The project's commit and whether the work tree differs from it; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "dirty": bool(status.strip())}


def device_facts() -> dict:
    devices = jax.devices()
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "count": len(devices), "process_count": jax.process_count()}


def model_facts(model_dir: str | Path) -> dict:
    root = Path(model_dir)
    config = root / "config.json"
    return {"path": str(root.resolve()), "files": file_hashes(root),
            "config": json.loads(config.read_text()) if config.exists() else None}


def environment() -> dict:
    """The parts of a manifest that describe where a run ran (not what it ran)."""
    return {"created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "packages": package_versions(), "git": git_commit(), "device": device_facts()}


def write(path: str | Path, manifest: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)         # a reader never sees half a manifest
    return path


def read(path: str | Path) -> dict:
    manifest = json.loads(Path(path).read_text())
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: manifest_version {manifest.get('manifest_version')!r}, "
                         f"this version reads {MANIFEST_VERSION}")
    return manifest


def changed_files(recorded: dict[str, str], model_dir: str | Path) -> list[str]:
    """The model files whose sha256 differs from the recorded one, or that appeared or went
    missing, each as 'name: why'."""
    now = file_hashes(model_dir)
    problems = [f"{name}: sha256 {recorded[name][:12]}… is now {now[name][:12]}…"
                for name in sorted(recorded.keys() & now.keys()) if recorded[name] != now[name]]
    problems += [f"{name}: missing" for name in sorted(recorded.keys() - now.keys())]
    problems += [f"{name}: new file" for name in sorted(now.keys() - recorded.keys())]
    return problems


def differences(recorded: list[dict], replayed: list[dict]) -> list[str]:
    """One line per request whose replayed output is not bitwise equal to the recorded one."""
    if len(recorded) != len(replayed):
        return [f"{len(recorded)} requests recorded, {len(replayed)} replayed"]
    lines = []
    for i, (old, new) in enumerate(zip(recorded, replayed, strict=True)):
        if old["request"] != new["request"]:
            lines.append(f"request {i} ({old['kind']}): the request itself differs")
        elif old["output"] != new["output"]:
            lines.append(f"request {i} ({old['kind']}): {_describe(old['output'], new['output'])}")
    return lines


def _describe(old, new) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        if old.get("token_ids") != new.get("token_ids"):
            return f"tokens {old.get('token_ids')} -> {new.get('token_ids')}"
        a, b = old.get("logprobs") or [], new.get("logprobs") or []
        if a != b and len(a) == len(b):
            moved = [abs(x - y) for x, y in zip(a, b, strict=True) if x != y]
            return (f"same tokens; logprobs differ at {len(moved)} of {len(a)}, "
                    f"by up to {max(moved):.3g}")
        return "differs in " + ", ".join(k for k in old if old.get(k) != new.get(k))
    return f"{old!r} -> {new!r}"
