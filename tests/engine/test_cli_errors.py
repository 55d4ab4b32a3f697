"""The `deepinfer` command on a broken model directory: one line on stderr naming the file, a
non-zero status, and a traceback only with --debug."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_pythonpath

SHIPPED = REPO / "models" / "deepinfer-tiny-v4"


def broken_model(directory, name: str, content: bytes):
    """The shipped model's files (linked) with `name` replaced by `content`."""
    directory.mkdir()
    for f in SHIPPED.iterdir():
        if f.name != name:
            os.symlink(f, directory / f.name)
    (directory / name).write_bytes(content)
    return directory


def run_cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": subprocess_pythonpath()}
    return subprocess.run([sys.executable, "-m", "deepinfer_jax.api.cli", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("name, content, named", [
    ("config.json", b'{"model_type": "deepseek_v4",\n "vocab_size": }', "config.json: not valid JSON "
                                                                          "at line 2"),
    ("model.safetensors", b"", "model.safetensors: 0 bytes, too short"),
    ("tokenizer.json", b'{"version": "1.0"', "tokenizer.json: not a tokenizer.json"),
])
def test_cli_error_is_one_line(tmp_path, name, content, named):
    model = broken_model(tmp_path / "model", name, content)
    result = run_cli("generate", "--model", str(model), "--prompt-ids", "1,2,3",
                     "--max-model-len", "256")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("deepinfer: error: ") and str(model / name) in lines[0]
    assert named in lines[0], lines[0]


def test_cli_debug_shows_the_traceback(tmp_path):
    model = broken_model(tmp_path / "model", "config.json", b"")
    result = run_cli("generate", "--model", str(model), "--prompt-ids", "1,2,3", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr
    assert "ConfigError" in result.stderr
