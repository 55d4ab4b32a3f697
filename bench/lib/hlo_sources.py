"""Which source line a profiled kernel came from: XLA names its GPU kernels after fusions
(`input_scatter_fusion_11`), which say nothing about the model code they compute. The
optimised HLO text (`compiled.as_text()`) holds, for each fusion, the computation it calls,
whose ROOT instruction's metadata names the jax op and a stack frame: an index into the
module's tables of frames, file locations and file names (the frames' innermost lines).

    describe(hlo_text, ["input_scatter_fusion_11"])
    -> {"input_scatter_fusion_11": "scatter -> bf16[...] at ragged.py:77 < step_forward.py:149 (scatter)"}
"""

from __future__ import annotations

import re
from pathlib import Path

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    bodies, current = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = bodies.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return bodies


def stack_frames(hlo_text: str) -> dict[int, tuple[str, int]]:
    """Frame id -> ("file.py:line", parent frame id), from the module's FileNames,
    FileLocations and StackFrames tables. XLA writes a frame's parent as its id plus one (0:
    none), hence the - 1."""
    tables, current = {}, None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
            current = None
        elif current is not None:
            key, _, value = line.partition(" ")
            current[int(key)] = value
    files = {k: Path(v.strip('"')).name for k, v in tables.get("FileNames", {}).items()}
    places = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        places[k] = f"{files.get(int(fields.get('file_name_id', 0)), '?')}:{fields.get('line', '?')}"
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        frames[k] = (places.get(int(fields["file_location_id"]), "?"),
                     int(fields.get("parent_frame_id", 0)) - 1)
    return frames


def source_chain(line: str, frames: dict[int, tuple[str, int]], depth: int = 3) -> str:
    """An instruction's source lines, innermost first ("model.py:42 < step.py:61"), "?" where
    it has no stack frame."""
    frame = _FRAME.search(line)
    chain, fid = [], int(frame.group(1)) if frame else 0
    while fid in frames and len(chain) < depth:
        place, parent = frames[fid]
        chain.append(place)
        fid = parent if parent != fid else 0
    return " < ".join(chain) or "?"


def _where(line: str, frames: dict[int, tuple[str, int]], depth: int = 3) -> str:
    place, op = source_chain(line, frames, depth), _OP_NAME.search(line)
    return f"{place} ({op.group(1).rsplit('/', 1)[-1]})" if op else place


# The ops that shape a fusion's kernel, preferred when its root carries no source (a tuple,
# bitcast or convert of them).
_HEROES = ("dot", "gather", "scatter", "reduce", "concatenate", "sort", "convolution")


def _with_source(body: list[str]) -> str | None:
    """The fused computation's most telling instruction that has a stack frame: the last
    hero op, else the last instruction with a frame."""
    framed = [x for x in body if _FRAME.search(x) and _INSTRUCTION.match(x)]
    heroes = [x for x in framed if _INSTRUCTION.match(x).group(3) in _HEROES]
    return (heroes or framed or [None])[-1]


def describe(hlo_text: str, kernel_names: list[str]) -> dict[str, str]:
    """For each kernel named after an HLO instruction: its shape, the called computation's
    root op, and the source line of that root (or, when the root has none, e.g. a tuple or a
    bitcast, of the computation's last hero op that has one)."""
    bodies, frames = computations(hlo_text), stack_frames(hlo_text)
    callers = {}
    for lines in bodies.values():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:   # the kernel's name is the instruction's with '.' and '-' as '_'
                callers[re.sub(r"[.\-]", "_", m.group(1))] = line
    described = {}
    for name in kernel_names:
        line = callers.get(re.sub(r"[.\-]", "_", name))
        if line is None:
            continue
        shape = _INSTRUCTION.match(line).group(2)
        called = _CALLS.search(line)
        root = line
        if called and called.group(1) in bodies:
            body = bodies[called.group(1)]
            root = next((x for x in body if x.lstrip().startswith("ROOT")), body[-1] if body else line)
            if not _FRAME.search(root):
                root = _with_source(body) or root
        op = _INSTRUCTION.match(root).group(3) if _INSTRUCTION.match(root) else "?"
        described[name] = f"{op} -> {shape[:60]} at {_where(root, frames)}"
    return described
