"""The Ascend backend's test environment: .venv-ascend (Python 3.11, CPU torch 2.13.0, numpy;
no jax, as on an Ascend machine), built by `make ascend-env`. Tests in the engine's
environment (jax) drive it in a subprocess; without it they skip, saying so."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-ascend" / "bin" / "python"

needs_ascend_env = pytest.mark.skipif(
    not PYTHON.exists(), reason=f"no Ascend test environment at {PYTHON.parent.parent}: "
                                "`make ascend-env` builds it (`make test` does)")


def run_in_ascend_env(*args: str, timeout: float = 600, **environ: str) -> str:
    """Run `python args...` in .venv-ascend from the repository root (`environ`: variables
    to set) -> its stdout; a failure fails the calling test with the subprocess's output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **environ)
    done = subprocess.run([str(PYTHON), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed in .venv-ascend (exit {done.returncode}):\n"
                    f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done.stdout


@contextlib.contextmanager
def ascend_server(*args: str, start_timeout: float = 300, **environ: str):
    """`deepinfer serve args...` in .venv-ascend on a free local port, for the block: yields
    its base URL once /health answers; stopped (SIGTERM, then SIGKILL) after it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **environ)
    server = subprocess.Popen([str(PYTHON), "-m", "deepinfer_jax.api.cli", "serve", "--port",
                               str(port), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited ({server.returncode}):\n{server.stdout.read()[-6000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /health in {start_timeout} s")
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

