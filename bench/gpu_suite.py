"""The GPU suite: named runs of the GPU tests and benchmarks (bench/gpu_runs.py), each under
its own time limit, so that one that fails or hangs leaves the others' logs and results.

    python bench/gpu_suite.py --list
    python bench/gpu_suite.py e2e kernels-moe --out DIR     # DIR, else $OUT, else .cache/gpu-suite
    python bench/gpu_suite.py kernel-tests --pack           # DIR holds three files (below)

What a run leaves in the output directory: logs/NAME.log (the run's whole output),
results/*.{json,md} (the benchmarks' result files, stamped; copy the ones to keep into
bench/results/), gpu.txt (nvidia-smi: clocks, temperature, power at the start),
summary.md (each run's exit status and time) and autotune.tgz (XLA's autotuning cache,
.cache/autotune: unpack it there on a fresh machine and its compiles skip the timing runs).
--pack leaves summary.md, autotune.tgz and suite.tgz (logs, results, gpu.txt) only, for a
runner that brings back a few files; both are rewritten after every run.

Wheels the GPU machine lacks travel in .whl/ (bench/gpu-wheels.txt): installed, when there,
into .cache/gpu-site, which the runs find first on their path.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_runs import PY, RUNS, Run  # noqa: E402


def install_wheels() -> Path | None:
    """.whl/*.whl into .cache/gpu-site (again only when the set of wheels changed)."""
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if not wheels:
        return None
    site = REPO / ".cache" / "gpu-site"
    stamp, names = site / ".wheels", "\n".join(w.name for w in wheels)
    if not (stamp.exists() and stamp.read_text() == names):
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                       check=True)
        stamp.write_text(names)
    return site


def environment(results: Path, site: Path | None, allocator: str | None) -> dict[str, str]:
    """The runs' environment: this repository (and the wheels) first on the path, results
    to the output directory, XLA's autotuning kept in .cache/autotune between runs (without
    autotuning XLA picked a 10 TFLOP/s GEMM for 8192^3, so it stays on), and jax's GPU
    allocator where one is named (the result files record it with the environment)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_RESULTS_DIR=str(results))
    if allocator:
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = allocator
    env["PYTHONPATH"] = os.pathsep.join(
        [*([str(site)] if site else []), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    autotune = REPO / ".cache" / "autotune"
    autotune.mkdir(parents=True, exist_ok=True)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_gpu_per_fusion_autotune_cache_dir={autotune}").strip()
    return env


def gpu_snapshot(path: Path) -> None:
    query = "name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                             capture_output=True, text=True, timeout=30)
        path.write_text(out.stdout + out.stderr)
    except (OSError, subprocess.SubprocessError) as error:
        path.write_text(f"nvidia-smi: {error}\n")


def shown(command) -> str:
    return shlex.join(["python", *command[1:]] if command[0] == PY else command)


def run_one(name: str, run: Run, log: Path, env: dict, scratch: Path) -> tuple[int, float]:
    """The run's commands in turn (all of them: one failing test file says nothing of the
    next), until the run's time is up; its status is the first failure's. A command past the
    limit gets SIGTERM (step_profile.py prints its stacks then), 15 s later SIGKILL."""
    start, status = time.monotonic(), 0
    # each failing test's traceback as it happens (tests/conftest.py): a run stopped at its
    # limit never reaches pytest's summary
    failures = log.with_suffix(".failures.log")
    failures.unlink(missing_ok=True)          # (appended to by each test process)
    env = {**env, "DEEPINFER_FAILURES_LOG": str(failures)}
    with log.open("w") as out:
        for command in run.commands:
            command = [part.replace("{scratch}", str(scratch)) for part in command]
            left = run.limit_s - (time.monotonic() - start)
            out.write(f"$ {shown(command)}   # {left:.0f} s left\n")
            out.flush()
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=max(left, 1))
            except subprocess.TimeoutExpired:
                stop(proc)
                out.write(f"\n{name}: stopped at its limit of {run.limit_s} s\n")
                return 124, time.monotonic() - start
            except Stopped:
                stop(proc)
                out.write(f"\n{name}: stopped with the suite\n")
                raise
            status = status or code
    return status, time.monotonic() - start


class Stopped(Exception):
    """The suite itself was told to stop (SIGTERM, as `timeout` sends)."""


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (its own session: a stopped suite must not leave a
    benchmark running into the machine's next use), 15 s later SIGKILL."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, lines: int = 3) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def save(out: Path, work: Path, pack: bool) -> None:
    """autotune.tgz, and with --pack the work directory as suite.tgz."""
    with tarfile.open(out / "autotune.tgz", "w:gz") as tar:
        tar.add(REPO / ".cache" / "autotune", arcname="autotune")
    if pack:
        with tarfile.open(out / "suite.tgz", "w:gz") as tar:
            for part in ("logs", "results", "gpu.txt"):
                if (work / part).exists():
                    tar.add(work / part, arcname=part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"runs, or 'all': {', '.join(RUNS)}")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: $OUT, else .cache/gpu-suite)")
    ap.add_argument("--pack", action="store_true", help="leave three files in the output")
    ap.add_argument("--list", action="store_true", help="the runs, their limits and commands")
    ap.add_argument("--limit-s", type=int, default=None,
                    help="every named run's time limit (a run longer than one device call, "
                         "started detached: bench/README.md)")
    ap.add_argument("--allocator", default=None, choices=("bfc", "vmm", "cuda_async"),
                    help="jax's GPU allocator for every run (XLA_PYTHON_CLIENT_ALLOCATOR)")
    args = ap.parse_args()
    if args.list or not args.names:
        for name, run in RUNS.items():
            print(f"{name:18} {run.limit_s:4d} s  {run.what}")
            for command in run.commands:
                print(f"{'':25}{shown(command)}")
        return
    names = list(RUNS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; --list shows them")
    out = (args.out or Path(os.environ.get("OUT") or REPO / ".cache" / "gpu-suite")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-suite-")) if args.pack else out
    (work / "logs").mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_stopped)
    env = environment(work / "results", install_wheels(), args.allocator)
    gpu_snapshot(work / "gpu.txt")
    summary = ["| run | exit | seconds | last lines |", "|---|---:|---:|---|"]
    for name in names:
        log = work / "logs" / f"{name}.log"
        try:
            run = RUNS[name]
            if args.limit_s:
                run = dataclasses.replace(run, limit_s=args.limit_s)
            code, seconds = run_one(name, run, log, env, Path(tempfile.mkdtemp()))
        except Stopped:
            print(f"{name}: stopped with the suite\n" + "\n".join(summary), flush=True)
            raise SystemExit(124) from None
        print(f"{name}: exit {code} in {seconds:.0f} s\n{tail(log)}", flush=True)
        summary.append(f"| {name} | {code} | {seconds:.0f} | "
                       f"{tail(log, 1).replace('|', '/')[:200]} |")
        (out / "summary.md").write_text("\n".join(summary) + "\n")
        save(out, work, args.pack)      # after every run: a later one may outlast the caller
    print("\n".join(summary))


if __name__ == "__main__":
    main()
