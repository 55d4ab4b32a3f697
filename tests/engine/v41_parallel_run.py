"""Run by test_v41_parallel.py in its own process with 8 CPU devices: a DeepSeek-V4.1 oracle
fixture served on one device and on each mesh asked, as JSON on stdout (parallel_run.py's
record of each run, plus the plan's weight count from the config alone).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/engine/v41_parallel_run.py \\
        FOLDER "2,2,2" "1,4,1,2:invariant" "2,1,1:prefix" ...

A mesh is "dp,ep,tp[,cp]"; ":invariant" serves in batch-invariant mode (each prompt again on
its own too); ":prefix" turns prefix caching on and serves the prompts twice; ":device" keeps
the Engram tables on the device (split by rows over the mesh; the step hashes, and the loop
runs asynchronously).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.config.memory_v41 import engram_product_bytes, v41_weight_bytes  # noqa: E402
from tests.engine.parallel_run import run  # noqa: E402


def main() -> None:
    folder, cases = Path(sys.argv[1]), sys.argv[2:]
    cfg = read_model_config(folder)
    ref = np.load(folder / "reference.npz")
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    results = {}
    for case in ["1,1,1", *cases]:
        shape, *flags = case.split(":")
        sizes = dict(zip(("dp", "ep", "tp", "cp"), map(int, shape.split(","))))
        # 16-token pages: the 33- and 70-token prompts leave whole cached blocks
        options = ({"passes": 2, "enable_prefix_caching": True, "page_size": 16} if "prefix" in flags
                   else {})
        device_tables = "device" in flags
        if device_tables:
            options["engram_tables"] = "device"
        record = run(folder, prompts, None if case == "1,1,1" else sizes, "invariant" in flags,
                     **options)
        experts_split = sizes.get("dp", 1) * sizes.get("ep", 1) * sizes.get("cp", 1)
        # the fixtures' float32 weights as loaded, the Engram tables in host memory (the
        # default) or split over the devices beside the step's hash products
        record["config_weight_bytes"] = (
            v41_weight_bytes(cfg, False, 4, engram_on_host=not device_tables,
                             devices=experts_split)
            + (engram_product_bytes(cfg) if device_tables else 0))
        results[case] = record
    print(json.dumps(results))


if __name__ == "__main__":
    main()
