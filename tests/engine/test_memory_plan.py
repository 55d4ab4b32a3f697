"""Memory as a planned quantity (config/memory.py, engine/memory_plan.py, `deepinfer plan`).

The references are independent of the code under test: the cache's bytes against the state
pytree `init_state` really allocates (jax.eval_shape), the pool against the rule written out
here over the loaded weights and that pytree, and V4-Flash's weights against a tally of its
released tensors (deepseek_v4_architecture.md's table) and the model card's 284.33B.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest

import deepinfer_jax.engine.compile as engine_compile
import deepinfer_jax.engine.core as core
import deepinfer_jax.engine.memory_plan as memory_plan
from deepinfer_jax import LLM, load
from deepinfer_jax.api.cli import main
from deepinfer_jax.config.engine import QUICKSTART_SHAPES, EngineConfig
from deepinfer_jax.config.errors import InsufficientMemoryError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory import MemoryLimits, cache_bytes
from deepinfer_jax.config.options import DeviceFacts
from deepinfer_jax.device.snapshots import init_pool
from deepinfer_jax.engine import step_cache
from deepinfer_jax.engine.devices import held_outside_free_block, local_device_facts
from deepinfer_jax.engine.step_weights import with_step_weights
from deepinfer_jax.model.state import init_state
from tests.conftest import REPO

TINY = REPO / "models" / "deepinfer-tiny-v4"
FLASH = REPO / "configs" / "deepseek-v4-flash.json"
GiB = 2**30
# one bucket keeps the probe and the real compile to one step each
SHAPES = {**QUICKSTART_SHAPES, "token_buckets": (32,), "show_progress": False}


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _abstract_state(cfg, step_cfg, dtype=jnp.bfloat16):
    return jax.eval_shape(lambda: init_state(cfg, step_cfg, dtype))


@pytest.mark.parametrize("model, options, dtype", [
    ("configs/tiny/tiny-mixed.json", {}, jnp.float32),
    ("configs/tiny/tiny-mixed.json",
     {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
      "enable_prefix_caching": True, "num_pages": 7}, jnp.bfloat16),
    ("configs/deepseek-v4-flash.json", {"max_num_seqs": 4, "max_model_len": 8192},
     jnp.bfloat16),
    # the snapshot pool, compact (device/snapshot_layout.py), exact and bounded
    ("configs/deepseek-v4-flash.json", {"max_num_seqs": 4, "max_model_len": 8192,
                                        "enable_prefix_caching": True}, jnp.bfloat16),
    ("configs/tiny/tiny-mixed.json", {"enable_prefix_caching": True, "prefix_replay": "bounded"},
     jnp.float32),
])
def test_cache_bytes_equal_the_state_pytree(model, options, dtype):
    cfg = read_model_config(REPO / model)
    step_cfg = EngineConfig(**options).resolve(cfg)
    state = _abstract_state(cfg, step_cfg, dtype)
    snapshots = jax.eval_shape(lambda s: init_pool(
        s, step_cfg.num_snapshots, not step_cfg.bounded_replay, spare=step_cfg.spec_tokens), state)
    expected = _nbytes(state) + (_nbytes(snapshots) if step_cfg.num_snapshots else 0)
    assert cache_bytes(cfg, step_cfg, jnp.dtype(dtype).itemsize) == expected


def _no_compile(*args, **kwargs):
    raise AssertionError("compiled although the model cannot fit")


def test_weights_over_the_budget_fail_before_any_compile(monkeypatch):
    monkeypatch.setattr(memory_plan, "compile_steps", _no_compile)
    monkeypatch.setattr(core, "compile_steps", _no_compile)
    for model in (TINY, load(TINY)):      # before loading (a path), after (a loaded Model)
        with pytest.raises(InsufficientMemoryError, match=r"weights.*GiB.*0\.9"):
            LLM(model, device_memory_gib=0.01, **SHAPES)


def _plan_inputs(model):
    """Weights as the engine holds them, the probe's measured activations, and the state's
    fixed and per-page bytes, from the pytree init_state allocates."""
    cfg = read_model_config(TINY)
    options = EngineConfig(**SHAPES)
    step_cfg = options.resolve(cfg, local_device_facts())    # as LLM resolves it (a GPU's kernels)
    dtype = model.params.embed.dtype
    params = with_step_weights(model.params)      # as the engine holds them
    weights = _nbytes(params)
    activations = memory_plan.measured_activations(params, cfg, step_cfg,
                                                   options.host_options(step_cfg))
    one, two = (_nbytes(_abstract_state(cfg, dataclasses.replace(step_cfg, num_pages=n), dtype))
                for n in (1, 2))
    return step_cfg, weights, activations, one - (two - one), two - one


def test_a_model_that_does_not_fit_fails_before_its_steps_compile(monkeypatch):
    model = load(TINY)
    step_cfg, weights, activations, fixed, page = _plan_inputs(model)
    monkeypatch.setattr(core, "compile_steps", _no_compile)     # the probe may compile
    device = (weights + activations // 2) / 0.9
    with pytest.raises(InsufficientMemoryError, match=r"activations .*GiB \(measured\).*"
                                                      r"max_num_seqs.*max_model_len"):
        LLM(model, device_memory_gib=device / GiB, **SHAPES)
    roomy = (weights + memory_plan.with_slack(activations) + fixed + 64 * page) / 0.9
    # 64 pages fit, 10**4 do not
    with pytest.raises(InsufficientMemoryError, match="num_pages=10000"):
        LLM(model, device_memory_gib=roomy / GiB, num_pages=10**4, **SHAPES)


def test_the_pool_is_sized_from_the_stated_memory():
    model = load(TINY)
    step_cfg, weights, measured, fixed, page = _plan_inputs(model)
    assert measured > 0
    activations = measured + max(2**20, math.ceil(0.02 * measured))    # the plan's margin
    device = int((weights + activations + fixed + 20.5 * page) / 0.9)
    llm = LLM(model, device_memory_gib=device / GiB, **SHAPES)
    expected = (int(device * 0.9) - weights - activations - fixed) // page
    assert 0 < expected < step_cfg.num_pages          # smaller than every slot's reach
    assert llm.step_config.num_pages == expected == llm.memory_plan.pages
    assert _nbytes(llm.engine.state) == fixed + expected * page
    assert llm.memory_plan.activations_measured and llm.memory_plan.fits
    assert llm.memory_plan.activations == activations
    # the probe's pool (every slot's reach) measured what the real pool's step needs, within
    # the margin (on the H200 the real, smaller pool's step took 4 KB more than the probe's)
    real = [memory_plan.step_peak(c.executable) for c in llm.engine.steps.by_key.values()]
    assert abs(max(real) - measured) <= activations - measured
    out = llm.generate([[0, 5, 7]], {"max_tokens": 3}, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_memory_the_allocator_holds_outside_its_largest_free_block_is_planned_unusable(
        monkeypatch):
    """On the H200 a V4.1 slice's prefill died in XLA: the plan's total was right, but holes
    between freed buffers (the random draw's temporaries) left no block for the step's 26 GiB
    of temporaries. Where the device's memory is the allocator's own limit, what it holds
    beyond the weights outside its largest free block comes off the pool, page for page."""
    model = load(TINY)
    step_cfg, weights, measured, fixed, page = _plan_inputs(model)
    options = EngineConfig(**SHAPES)
    host = options.host_options(step_cfg)
    device = int((weights + memory_plan.with_slack(measured) + fixed + 20.5 * page) / 0.9)
    holes = 7 * page + 123
    monkeypatch.setattr(memory_plan, "held_outside_free_block", lambda devices: weights + holes)
    params = with_step_weights(model.params)

    def plan(reported):
        limits = MemoryLimits(device, 0.9, reported=reported)
        return memory_plan.engine_plan(params, read_model_config(TINY), step_cfg, host,
                                       limits)[1]

    stated, reported = plan(False), plan(True)
    assert stated.unusable == 0 and reported.unusable == holes
    assert stated.pages == 20 < step_cfg.num_pages    # below every slot's reach: memory caps it
    assert reported.pages == 13                       # 20.5 - 7 pages - 123 bytes: 13 whole
    assert reported.total <= reported.budget
    assert "unusable" in reported.format() and "unusable" not in stated.format()
    too_small = MemoryLimits(int((weights + holes + memory_plan.with_slack(measured) + fixed)
                                 / 0.9), 0.9, reported=True)
    with pytest.raises(InsufficientMemoryError, match=r"unusable .*GiB \(held outside"):
        memory_plan.engine_plan(params, read_model_config(TINY), step_cfg, host, too_small)


def test_only_a_reported_device_memory_is_measured_against_the_allocator(monkeypatch):
    monkeypatch.delenv("DEEPINFER_DEVICE_MEMORY_GIB", raising=False)
    gpu = DeviceFacts(platform="gpu", memory_bytes=100 * GiB)
    assert EngineConfig().memory(gpu).reported
    assert not EngineConfig(device_memory_gib=80).memory(gpu).reported
    assert not EngineConfig().memory(gpu, {"DEEPINFER_DEVICE_MEMORY_GIB": "80"}).reported


class _Device:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        if isinstance(self._stats, Exception):
            raise self._stats
        return self._stats


def test_held_outside_the_free_block_is_the_most_over_the_devices():
    devices = [_Device({"bytes_limit": 100, "largest_free_block_bytes": 70}),
               _Device({"bytes_limit": 100, "largest_free_block_bytes": 55}),
               _Device({"bytes_limit": 100}),                  # no free-block figure
               _Device(None), _Device(RuntimeError("no statistics"))]
    assert held_outside_free_block(devices) == 45
    assert held_outside_free_block(devices[2:]) == 0


def test_a_pool_that_grows_counts_its_unreserved_bytes_as_free():
    """XLA_PYTHON_CLIENT_PREALLOCATE=false: the allocator has reserved 30 of its 100 bytes
    and its largest free block among them is 5; the 70 it has not reserved are one block."""
    grown = _Device({"bytes_limit": 100, "largest_free_block_bytes": 5, "pool_bytes": 30})
    assert held_outside_free_block([grown]) == 30
    preallocated = _Device({"bytes_limit": 100, "largest_free_block_bytes": 60,
                            "pool_bytes": 100})
    assert held_outside_free_block([preallocated]) == 40


def test_the_probed_step_is_the_engines_where_memory_does_not_cap_the_pool():
    """The probe compiles the largest bucket over every slot's reach; where memory leaves the
    pool there, the engine's compile finds that step done (it traces only the bucket's other
    variant, where a GPU has two: the greedy and the truncating sampler's); where memory caps
    the pool, the bucket is traced again for the smaller pool."""
    model = load(TINY)
    engine_compile._memo.clear()
    before = step_cache.stats.traced
    step_cfg, weights, activations, fixed, page = _plan_inputs(model)    # the probe
    assert step_cache.stats.traced - before == 1
    variants = 2 if step_cfg.compute.launch_bound else 1
    capped = (weights + memory_plan.with_slack(activations) + fixed + 20.5 * page) / 0.9
    for device, pages, traced in ((64 * GiB, step_cfg.num_pages, variants - 1),
                                  (capped, 20, variants)):
        before = step_cache.stats.traced
        llm = LLM(model, device_memory_gib=device / GiB, **SHAPES)
        assert llm.step_config.num_pages == pages
        assert step_cache.stats.traced - before == traced, device
        out = llm.generate([[0, 5, 7]], {"max_tokens": 3}, use_tqdm=False)   # the probe's step
        assert len(out[0].outputs[0].token_ids) == 3


def test_without_stated_memory_the_cpu_pool_keeps_its_size():
    assert EngineConfig().memory() is None
    cfg = read_model_config(TINY)
    assert EngineConfig(**SHAPES).resolve(cfg).num_pages == 4 * 8   # every slot's reach


# ---- deepinfer plan ---------------------------------------------------------------------

def _released_bytes(devices: int) -> int:
    """V4-Flash's big tensors as released, per device: FP8 dense projections (1 byte + an f32
    scale per 128 x 128 block), FP4 routed experts (half a byte + a scale byte per 32), bf16
    embedding and head. The plan counts the small tensors too (compressors, router gates,
    mHC mixing, norms: 0.87 GB, replicated on every device)."""
    raw = json.loads(FLASH.read_text())
    d, r, h, hd = raw["hidden_size"], raw["q_lora_rank"], raw["num_attention_heads"], raw["head_dim"]
    i, e, lo, g = (raw["moe_intermediate_size"], raw["n_routed_experts"], raw["o_lora_rank"],
                   raw["o_groups"])
    csa = raw["compress_ratios"][: raw["num_hidden_layers"]].count(4)
    layers = raw["num_hidden_layers"] + raw["num_nextn_predict_layers"]
    fp8 = layers * (d * r + r * h * hd + d * hd + h * hd * lo + g * lo * d + 3 * d * i)
    fp8 += csa * r * raw["index_n_heads"] * raw["index_head_dim"] + 2 * d * d   # MTP e/h_proj
    fp4 = layers * math.ceil(e / devices) * 3 * d * i
    return int(fp8 * (1 + 4 / 128**2) + fp4 * (0.5 + 1 / 32)) + 2 * raw["vocab_size"] * d * 2


def _plan(capsys, *args) -> tuple[int, dict[str, str]]:
    rc = main(["plan", *args])
    lines = capsys.readouterr().out.splitlines()
    return rc, {line[:17].strip(): line[17:] for line in lines if not line.startswith("note")}


@pytest.mark.parametrize("devices, fits", [(1, "no"), (8, "yes")])
def test_plan_of_v4_flash(capsys, devices, fits):
    rc, shown = _plan(capsys, "deepseek-v4-flash", "--devices", str(devices),
                      "--device-memory-gib", "131")
    weights = float(shown["weights"].split()[0]) * GiB
    reference = _released_bytes(devices)
    assert reference <= weights <= reference + 0.9e9
    assert shown["fits"] == fits and rc == (fits == "no")
    assert "estimate" in shown["activations"]
    if devices == 1:                        # about 160 GB as released, 148.6 GiB
        assert 148 * GiB < weights < 149 * GiB
    else:
        assert int(shown["cache"].split("(")[1].split()[0]) == 16 * 32    # every slot's reach


def test_plan_of_a_mesh_splits_the_experts_over_its_expert_ranks(capsys):
    """`--parallel dp=8`: the engine's layout, the experts over the 8 data-parallel ranks (the
    same figures as 8 devices); a mesh the model cannot take is refused by its sizes."""
    rc, shown = _plan(capsys, "deepseek-v4-flash", "--parallel", "dp=8", "--device-memory-gib",
                      "131")
    weights = float(shown["weights"].split()[0]) * GiB
    assert rc == 0 and "routed experts split 8 ways" in shown["parallel"]
    assert _released_bytes(8) <= weights <= _released_bytes(8) + 0.9e9
    assert main(["plan", "deepseek-v4-flash", "--parallel", "dp=3"]) != 0
    assert "dp x cp x ep = 3 x 1 x 1 does not divide" in capsys.readouterr().err


def test_plan_counts_the_model_cards_parameters():
    params = memory_plan.abstract_params(read_model_config(FLASH))
    count = sum(math.prod(leaf.shape) for name, leaf in memory_plan.named_leaves(params)
                if not name.startswith("mtp") and not name.endswith("tid2eid"))
    assert round(count / 1e9, 2) == 284.33        # the model card's 284B (llama.cpp: 284.33 B)
