"""Which reductions and dots two compiles of one step give different shapes, by source line.

Two engines whose steps should compute a row alike (batch-invariant mode: 8 slots and 32,
one token bucket) compile the same program except where a shape follows the engine. A float
reduction or dot whose operand shape differs between the two at the same source line is
where XLA may sum a row in another order; everything else is the same per row.

    python bench/hlo_diff.py slots8/module.after_optimizations.txt \\
        slots32/module.after_optimizations.txt

(the optimized HLO text: `compiled.as_text()`, or an XLA dump's after_optimizations file;
`bench/invariance_probe.py slots-test` writes both engines').

With --fusions it lists instead the fused kernels whose arithmetic (the ops by source line,
shapes dropped) one compile groups otherwise than the other: the same ops in other kernels
may round otherwise (a multiply and an add contracted into one FMA within a kernel, not
across two). Session 56's 8- and 32-slot steps on the H200 differed there, in the
compressors' closed rows, and nowhere in their reductions.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.hlo_sources import computations, source_chain, stack_frames  # noqa: E402

_OP = re.compile(r"=\s+(\S+)\s+(reduce|dot)\(%?([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")


def reductions(hlo_text: str, depth: int = 5) -> collections.Counter:
    """(op, operand shape -> result shape, source chain) of every float reduce and dot, counted."""
    frames, bodies = stack_frames(hlo_text), computations(hlo_text)
    found = collections.Counter()
    for body in bodies.values():
        shapes = {}
        for line in body:
            name = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s", line)
            if name:
                shapes[name.group(1)] = _LAYOUT.sub("", name.group(2))
        for line in body:
            op = _OP.search(line)
            if not op or not re.match(r"\(?(f32|bf16|f16|f64)", op.group(1)):
                continue
            operand = shapes.get(op.group(3), "?")
            found[(op.group(2), f"{operand} -> {_LAYOUT.sub('', op.group(1))}",
                   source_chain(line, frames, depth))] += 1
    return found


def differing(a: str, b: str) -> list[tuple[str, str, int, int]]:
    """(op and shapes, source, count in a, count in b) where the two compiles differ."""
    ra, rb = reductions(a), reductions(b)
    return [(f"{op} {shapes}", source, ra[key], rb[key])
            for key in sorted(set(ra) | set(rb), key=lambda k: k[2])
            for op, shapes, source in [key] if ra[key] != rb[key]]


# The ops a fused kernel's rounding depends on; data movement (slices, broadcasts, converts)
# and selects leave no rounding to regroup.
_ARITHMETIC = {"add", "subtract", "multiply", "divide", "exponential", "rsqrt", "sqrt", "log",
               "power", "tanh", "logistic", "reduce", "dot"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+|\([^=]*?\))\s+([\w\-]+)\(")


def fusion_signatures(hlo_text: str) -> collections.Counter:
    """Each fused computation's float arithmetic as a sorted tuple of "op@file:line", counted."""
    frames, bodies = stack_frames(hlo_text), computations(hlo_text)
    found = collections.Counter()
    for name, body in bodies.items():
        if "fused" not in name and not name.startswith(("fusion", "wrapped")):
            continue
        ops = tuple(sorted(f"{op.group(2)}@{source_chain(line, frames, 1)}" for line in body
                           for op in [_INSTRUCTION.match(line)]
                           if op and op.group(2) in _ARITHMETIC
                           and re.match(r"\(?(f32|bf16|f16|f64)", op.group(1))))
        if ops:
            found[ops] += 1
    return found


def differing_fusions(a: str, b: str) -> list[tuple[tuple[str, ...], int, int]]:
    """(signature, count in a, count in b) for the fused kernels the two compiles group
    differently."""
    fa, fb = fusion_signatures(a), fusion_signatures(b)
    return [(key, fa[key], fb[key]) for key in sorted(set(fa) | set(fb)) if fa[key] != fb[key]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--fusions", action="store_true",
                        help="the fused kernels whose arithmetic the two compiles group differently")
    args = parser.parse_args(argv)
    if args.fusions:
        kernels = differing_fusions(args.a.read_text(), args.b.read_text())
        for ops, in_a, in_b in kernels:
            print(f"{in_a:3d} {in_b:3d}  {' '.join(dict.fromkeys(ops))}")
        print(f"{len(kernels)} differing fused-kernel signatures")
        return 0
    rows = differing(args.a.read_text(), args.b.read_text())
    for what, source, in_a, in_b in rows:
        print(f"{in_a:3d} {in_b:3d}  {what}  at {source}")
    print(f"{len(rows)} differing (op, shapes, source) rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
