"""Helpers for tests that start `deepinfer serve` as a subprocess: wait for a condition, and
connect the official client once the server lists its models."""

from __future__ import annotations

import subprocess
import time

import openai


def wait_until(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def connect_when_up(process: subprocess.Popen, port: int, *, timeout_s: float,
                    request_timeout_s: float) -> tuple[openai.OpenAI, list]:
    """The client and /v1/models' list once the server answers; the server's output if it
    exits first."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=request_timeout_s)

    def up():
        assert process.poll() is None, process.stdout.read()
        try:
            return client.models.list().data
        except openai.APIConnectionError:
            return None
    return client, wait_until(up, timeout_s=timeout_s)
