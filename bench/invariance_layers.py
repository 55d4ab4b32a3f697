"""Where prompt 22 of test_batch_invariance first parts between its run alone (32 slots) and
among others on 8 slots (the H200/H100 failure of test_sync_loop_on_fewer_slots): every
layer's sublayer values for the prompt's tokens, in both engines, compared bit for bit.

`invariance_topk.py` found (H200, session 54) the first CSA layer's indexer scores equal
for all of the prompt's tokens and the second's differing from position 76 on, with the
reference indexer's heads summed either way: the hidden state parts between them. This
probe names the first (layer, value, position) that differs. JSON lines on stdout:

  python bench/invariance_layers.py     # per layer and value: how many of the prompt's
                                        # positions differ, the first, the largest |diff|
  python bench/invariance_layers.py gpu # the same in the GPU formulation on any device
                                        # (on the CPU: a check of the probe's own alignment,
                                        # whose per-token segments run in row tiles there)
  python bench/invariance_layers.py tiled-rows
                                        # with the compressors' closed rows pooled and
                                        # finished in fixed row tiles (`per_sequence`), not
                                        # over all of a step's T // rate + N row slots, whose
                                        # count follows the slot count: a candidate fix

Each engine runs in a process of its own (`engine SLOTS OUT.npz FORMULATION ROWS`, then
`compare ALONE.npz AMONG.npz`): the engine's compiled-step memo would otherwise share steps
across them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.invariance_topk import moved_prompt_run  # noqa: E402

# in the order a layer computes them
VALUES = ("q", "kv", "window_keys", "rows", "window_visible", "rows_visible", "attention",
          "after_attention", "experts", "after_ffn")
VISIBILITY = {"window_keys": "window_visible", "rows": "rows_visible"}


def layers_engine(slots: int, out: str, formulation: str = "default",
                  rows: str = "whole") -> None:
    """Prompt TOPK_PROMPT alone on 32 slots or among the first 30 on 8 (the synchronous
    loop), every layer's VALUES for each of its tokens saved to out (npz, keyed
    "layer/value/position"). formulation: "default" (the device's) or "gpu"; rows "tiled":
    the closed rows in `per_sequence` row tiles."""
    import deepinfer_jax.model.attention as attention
    import deepinfer_jax.model.paged_forward as paged_forward
    from deepinfer_jax.config.hf import read_model_config
    from deepinfer_jax.model.invariant import per_sequence

    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    records, now = [], {"layer": 0, "ctx": None}

    def record(layer, name, slot, start, end, positions, valid, value):
        records.append((layer, name, slot, start, end, positions, valid, value))

    def spy(name, value):
        ctx = now["ctx"]
        jax.debug.callback(lambda *a, layer=now["layer"]: record(layer, name, *a), ctx.slot,
                           ctx.start, ctx.end, ctx.positions, ctx.valid, value)

    layer_step, attention_outputs = paged_forward.layer_step, paged_forward.attention_outputs
    ffn_outputs, sink_attention_parts = paged_forward.ffn_outputs, attention.sink_attention_parts
    seen = {"calls": 0}

    def spied_layer_step(p, streams, token_ids, ctx, *args, **kwargs):
        # forward_step's calls, layer by layer (this engine runs no MTP draft blocks)
        now["layer"], now["ctx"] = seen["calls"] % cfg.num_layers, ctx
        now["compute"] = (kwargs.get("step_cfg") or args[4]).compute
        assert not now["compute"].tile_segments, \
            "per-token segments in row tiles: the spies' values would not line up with the tokens"
        seen["calls"] += 1
        return layer_step(p, streams, token_ids, ctx, *args, **kwargs)

    def spied_attention_outputs(p, kind, cfg_, compute, t, keys, visible, *args):
        spy("q", t.q)
        spy("kv", t.kv)
        for (key_name, visible_name), key, seen_ in zip(
                (("window_keys", "window_visible"), ("rows", "rows_visible")), keys, visible):
            spy(key_name, key)
            spy(visible_name, seen_)
        out = attention_outputs(p, kind, cfg_, compute, t, keys, visible, *args)
        spy("after_attention", out)
        return out

    def spied_sink_attention_parts(*args, **kwargs):
        out = sink_attention_parts(*args, **kwargs)
        spy("attention", out)
        return out

    def spied_ffn_outputs(*args, **kwargs):
        streams, experts = ffn_outputs(*args, **kwargs)
        spy("experts", experts)
        spy("after_ffn", streams)
        return streams, experts

    if rows == "tiled":
        close_rows = paged_forward.close_rows

        def tiled_close_rows(*args, rowwise, **kwargs):
            return close_rows(*args, rowwise=per_sequence(now["compute"]), **kwargs)
        paged_forward.close_rows = tiled_close_rows
    paged_forward.layer_step = spied_layer_step
    paged_forward.attention_outputs = spied_attention_outputs
    paged_forward.ffn_outputs = spied_ffn_outputs
    attention.sink_attention_parts = spied_sink_attention_parts

    options = {} if formulation == "default" else {"step_formulation": formulation}
    lp = moved_prompt_run(slots, **options).logprobs
    jax.effects_barrier()
    values = prompt_values(records, alone=slots == 32)
    np.savez(out, logprobs=np.array([x.logprob for x in lp]), **values)


def prompt_values(records: list, alone: bool) -> dict:
    """The prompt's tokens' values: {"layer/value/position": array}. Alone every real token
    is the prompt's. On 8 slots its slot is the one whose step holds its first chunk,
    positions 0-25 (no other of the first 30 prompts starts with 26 tokens: the schedule of
    `invariance_probe.py loops`), until another sequence starts in that slot. The loop is
    synchronous, so the steps' records come in step order (within a step in any order)."""
    out, slot, done = {}, None, False
    for layer, name, step_slot, start, end, positions, valid, value in records:
        step_slot, start, end = np.asarray(step_slot), np.asarray(start), np.asarray(end)
        for t in np.flatnonzero(np.asarray(valid)):
            if alone:
                mine = True
            else:
                if slot is None and start[t] == 0 and end[t] == 26:
                    slot = int(step_slot[t])
                if slot is not None and step_slot[t] == slot and start[t] == 0 and end[t] != 26:
                    done = True              # the slot's next occupant
                mine = slot is not None and not done and step_slot[t] == slot
            if mine:
                v = np.asarray(value[t])      # (npz keeps no bfloat16; float32 holds its bits)
                out[f"{layer}/{name}/{int(np.asarray(positions)[t])}"] = (
                    v.astype(np.float32) if v.dtype.name == "bfloat16" else v)
    return out


def layers_probe(options: list[str]) -> None:
    formulation = "gpu" if "gpu" in options else "default"
    rows = "tiled" if "tiled-rows" in options else "whole"
    print(json.dumps({"probe": "layers", "formulation": formulation, "closed_rows": rows}),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for slots in (32, 8):
            done = subprocess.run([sys.executable, __file__, "engine", str(slots),
                                   f"{tmp}/{slots}.npz", formulation, rows],
                                  capture_output=True, text=True, cwd=REPO, check=False)
            if done.returncode:
                raise SystemExit("\n".join(line for line in done.stderr.splitlines()
                                           if not line.lstrip().startswith("@"))[-3000:])
        compare(f"{tmp}/32.npz", f"{tmp}/8.npz")


def compare(alone_path: str, among_path: str) -> None:
    """The two engines' saved values, a JSON line per layer and value."""
    alone, among = dict(np.load(alone_path)), dict(np.load(among_path))
    diff = np.abs(alone.pop("logprobs") - among.pop("logprobs"))
    print(json.dumps({"probe": "layers", "logprobs_bitwise": bool((diff == 0).all()),
                      "max_diff": float(diff.max()), "keys": [len(alone), len(among)]}),
          flush=True)
    for runs_ in (alone, among):          # rows a token does not see are not its inputs
        for key in list(runs_):
            layer, name, position = key.split("/")
            if name in ("window_keys", "rows"):
                seen = runs_[f"{layer}/{VISIBILITY[name]}/{position}"]
                runs_[key] = np.where(seen[:, None], runs_[key], 0)
    for layer in range(4):
        for name in VALUES:
            keys = sorted((k for k in alone if k.startswith(f"{layer}/{name}/") and k in among),
                          key=lambda k: int(k.rsplit("/", 1)[1]))
            if not keys:
                continue
            differ = [k for k in keys if alone[k].tobytes() != among[k].tobytes()]
            worst = max((float(np.max(np.abs(alone[k].astype(np.float64)
                                              - among[k].astype(np.float64))))
                         for k in differ), default=0.0)
            print(json.dumps({"layer": layer, "value": name, "positions": len(keys),
                              "differ": len(differ),
                              "first": [int(k.rsplit("/", 1)[1]) for k in differ[:6]],
                              "max_abs_diff": worst}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        layers_engine(int(sys.argv[2]), sys.argv[3], *sys.argv[4:6])
    elif len(sys.argv) > 1 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        layers_probe(sys.argv[1:])
