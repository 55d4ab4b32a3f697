"""The step cache: each bucket's compiled step on disk, so that a new process skips tracing,
lowering and compiling (seconds instead of minutes).

An entry is one file, `<compilation_cache_dir>/steps/<sha256 of its key>.step`: a header with
the SHA-256 of the body, then a pickle of the key's text, jax's serialized executable
(`jax.experimental.serialize_executable`: the XLA executable and its argument infos, donation
included), the call's in/out pytree definitions and the plan's and output's wire layouts. The
key names everything the program depends on: the trace key (model and step configs, argument
shapes, dtypes, shardings and tree structure, speculative or not, backend), the bucket and
sampler variant, the compiler options, the jax and jaxlib versions, the device kind and
platform version, XLA_FLAGS, the host CPU, and a digest of the source of every package the
step is traced from; an edited model or kernel makes a new key and the old entry is never read.
An entry whose digest, format, key, tree or plan layout does not match is skipped (the step
is built again and the entry rewritten), never an error. Entries are written to a temporary
file and renamed into place, so a reader sees a whole entry or none.

Like jax's own persistent cache, the directory is trusted: an entry is a pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import platform
import tempfile
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from deepinfer_jax.config import options
from deepinfer_jax.engine.transfer import Wire

log = logging.getLogger(__name__)

FORMAT = 1
_MAGIC = b"deepinfer-step\n"
_PACKAGE = Path(__file__).resolve().parents[1]          # deepinfer_jax/
# The packages a step is traced from. host/ (which never imports jax: only the plan's layout
# reaches the step, and a loaded entry's layout is checked against build_plan's) and api/ are
# left out, so that editing the scheduler or the CLI does not cost a recompile.
_TRACED_SOURCES = (_PACKAGE, _PACKAGE.parent / "pallas_kernels")
_UNTRACED = ("host", "api")


@dataclasses.dataclass
class StartupStats:
    """What this process's engine start-ups did, summed over buckets (read by tests and
    bench/startup.py)."""

    traced: int = 0        # steps traced, lowered and compiled
    loaded: int = 0        # steps loaded from the step cache
    written: int = 0       # entries written
    rejected: int = 0      # entries found but unusable (corrupt, mismatched): rebuilt


stats = StartupStats()


@functools.cache
def source_digest() -> str:
    """SHA-256 over the path and contents of every .py file a step is traced from."""
    digest = hashlib.sha256()
    for root in _TRACED_SOURCES:
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root.parent)
            if root == _PACKAGE and relative.parts[1] in _UNTRACED:
                continue
            digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _host_cpu() -> str:
    """The CPU the executables were compiled for (XLA's CPU code uses the host's features)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def entry_key(trace_key: tuple, bucket: int, truncation: bool | None,
              compiler_options: dict | None) -> str:
    """The text an entry is filed under (its SHA-256 names the file) and checked against."""
    device = jax.devices()[0]
    parts = {
        "format": FORMAT,
        "trace": repr(trace_key),
        "bucket": bucket,
        "truncation": truncation,
        "compiler_options": sorted((compiler_options or {}).items()),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "device": f"{device.platform} {device.device_kind} x{jax.device_count()} "
                  f"{device.client.platform_version}",
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "xla_flags": options.xla_flags(),
        "cpu": _host_cpu(),
        "source": source_digest(),
    }
    return "\n".join(f"{k}: {v}" for k, v in parts.items())


def entry_path(directory: str, key: str) -> Path:
    return Path(directory) / "steps" / f"{hashlib.sha256(key.encode()).hexdigest()}.step"


def load(path: Path, key: str, args: tuple, plan_wire: Wire
         ) -> tuple[jax.stages.Compiled, Wire] | None:
    """The entry's executable and output layout, or None when it is missing or unusable
    (corrupt, written for another key, another call structure or plan layout)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return _reject(path, f"unreadable ({e})")
    header, _, body = data.partition(b"\n\n")
    if not header.startswith(_MAGIC) or header[len(_MAGIC):] != \
            hashlib.sha256(body).hexdigest().encode():
        return _reject(path, "corrupt (its digest does not match)")
    try:
        entry = pickle.loads(body)
        if entry["format"] != FORMAT or entry["key"] != key:
            return _reject(path, "written for another key")
        if entry["in_tree"] != jax.tree.structure((args, {})) or entry["plan_wire"] != plan_wire:
            return _reject(path, "written for another call structure or plan layout")
        executable = serialize_executable.deserialize_and_load(
            entry["executable"], entry["in_tree"], entry["out_tree"])
    except Exception as e:          # noqa: BLE001 -- any unusable entry is rebuilt, not fatal
        return _reject(path, f"unusable ({type(e).__name__}: {e})")
    stats.loaded += 1
    return executable, entry["output_wire"]


def store(path: Path, key: str, executable: jax.stages.Compiled, plan_wire: Wire,
          output_wire: Wire) -> None:
    """Write an entry (atomically). `executable` must be freshly compiled: XLA's CPU client
    serializes an executable it deserialized (from jax's cache, or this one) without all its
    functions (jax 0.11.2), and must not have run yet (the CPU's serialization then fails)."""
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(executable)
        body = pickle.dumps({"format": FORMAT, "key": key, "executable": blob,
                             "in_tree": in_tree, "out_tree": out_tree, "plan_wire": plan_wire,
                             "output_wire": output_wire}, protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = _MAGIC + hashlib.sha256(body).hexdigest().encode()
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".step")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header + b"\n\n" + body)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except Exception as e:          # noqa: BLE001 -- a cache that cannot be written is no error
        log.warning("step cache: could not write %s (%s: %s)", path, type(e).__name__, e)
        return
    stats.written += 1


def _reject(path: Path, why: str) -> None:
    log.warning("step cache: ignoring %s, %s; building the step again", path, why)
    stats.rejected += 1
    return None
