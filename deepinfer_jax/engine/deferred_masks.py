"""Grammar-constrained rows at full rate in the asynchronous loop: their masks applied one
step late, on the step's kept logits.

In the asynchronous loop step N+1 is launched before step N's tokens reach the host, but a
constrained row's token bitmask depends on its last token (its matcher must have seen it).
Rather than hold such a row back every other step, a batch with a constrained row whose
matcher is behind is launched as the step's first half only (device/step.py
`forward_logits`: placeholders, bookkeeping, forward, the sampled rows' logits f32[N, V],
kept on the device, nothing sampled). Once step N's tokens are read and the matchers have
consumed them, the host fills step N+1's masks (on a copy of its plan: the submitted plan is
never written again) and launches the step's second half (`sample_rows`, compiled alone per
bucket) on the kept logits: it writes the sampled slots' `last_tokens` and produces the
output the host reads for step N+1. Device order, one launcher thread in submission order:
first half N+1, second half N+1, step N+2, so step N+2's placeholders resolve to the masked
tokens. Every row of such a batch is sampled by the second half with the same logits,
controls, seeds and penalty counts as the fused step would use (the counts are untouched in
between), so its unconstrained rows draw what they would have.

Only single-rank engines without a mesh or speculation take this path (core.py decides);
the first halves compile on first use (a batch that needs one), the second halves at start.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import BatchPlan, StepOutput
from deepinfer_jax.device.step import forward_logits, sample_rows
from deepinfer_jax.engine.compile import (
    BATCH_INVARIANT_COMPILER_OPTIONS,
    CompiledStep,
    CompiledSteps,
    _trace_key,
)
from deepinfer_jax.engine.launch import Launcher
from deepinfer_jax.engine.transfer import Wire, start_host_copy
from deepinfer_jax.host.decision import ScheduleDecision
from deepinfer_jax.host.grammar import StructuredOutputs
from deepinfer_jax.host.plan_builder import suppress_stops


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A launched first half waiting for its masks: its plan (never written after launch)
    and which bucket's second half samples it."""

    plan: BatchPlan
    key: tuple[int, bool | None]


def needs_deferring(decision: ScheduleDecision) -> bool:
    """Whether a sampled constrained row's matcher has not seen every token before the one
    this step samples (a token still in flight)."""
    return any(seq.samples and seq.request.matcher is not None
               and seq.request.num_checked < seq.token_index for seq in decision.seqs)


def _run(executable: jax.stages.Compiled, explicit: bool, *args):
    """Call with the host buffer last, transferred as CompiledStep does (compile.py)."""
    *arrays, buffer = args
    if explicit:
        return executable(*arrays, jax.device_put(buffer))
    with jax.transfer_guard_host_to_device("allow"):
        return executable(*arrays, buffer)


# The first halves by the engine's trace key (compile.py's memo's reason: engines of equal
# shapes in one process share them). Bounded, oldest out first.
_first_halves: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()


class DeferredMasks:
    def __init__(self, params, state, cfg, step_cfg: StepConfig, steps: CompiledSteps,
                 structured: StructuredOutputs, eos_token_ids: tuple[int, ...]):
        spec = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding))
        self._params, self._state = spec(params), spec(state)    # shapes: state gets donated
        self._cfg, self._step_cfg, self._steps = cfg, step_cfg, steps
        self._trace_key = _trace_key(params, state, cfg, step_cfg, False)
        self._options = BATCH_INVARIANT_COMPILER_OPTIONS if step_cfg.batch_invariant else None
        self.structured, self.eos_token_ids = structured, eos_token_ids
        self._second: dict[tuple, tuple[jax.stages.Compiled, Wire]] = {
            key: self._compile_second(key, compiled) for key, compiled in steps.by_key.items()}

    # ---- compiling --------------------------------------------------------------------------
    def _compile_second(self, key, compiled: CompiledStep):
        plan_wire, state = compiled.plan_wire, self._state
        n = plan_wire.fields[[f[0] for f in plan_wire.fields].index("sample_index")][1][0]
        logits = jax.ShapeDtypeStruct((n, self._cfg.vocab_size), np.float32)
        wire = []

        def second(last_tokens, prompt_mask, output_counts, logits, buffer):
            last_tokens, out = sample_rows(last_tokens, prompt_mask, output_counts, logits,
                                           plan_wire.unpack_device(buffer),
                                           step_cfg=self._step_cfg, truncation=key[1])
            wire.append(Wire.of(out))
            return last_tokens, wire[-1].pack_device(out)

        executable = jax.jit(second, donate_argnums=(0,)).lower(
            state.last_tokens, state.prompt_mask, state.output_counts, logits,
            plan_wire.spec()).compile(compiler_options=self._options)
        return executable, wire[-1]

    def _first_half(self, bucket: int, compiled: CompiledStep) -> jax.stages.Compiled:
        memo = self._trace_key + (bucket,)
        if memo not in _first_halves:
            plan_wire, cfg, step_cfg = compiled.plan_wire, self._cfg, self._step_cfg

            def first(params, state, buffer):
                return forward_logits(params, state, plan_wire.unpack_device(buffer), cfg=cfg,
                                      step_cfg=step_cfg)

            _first_halves[memo] = jax.jit(first, donate_argnums=(1,)).lower(
                self._params, self._state, plan_wire.spec()).compile(
                compiler_options=self._options)
            if len(_first_halves) > 16:
                _first_halves.popitem(last=False)
        _first_halves.move_to_end(memo)
        return _first_halves[memo]

    # ---- the loop -----------------------------------------------------------------------------
    def first_half(self, bucket: int, truncating: bool) -> tuple[Callable, tuple]:
        """The first half for a bucket, called as a step is ((params, state, plan) -> (state,
        logits)), and the key of its second half."""
        key = (bucket, None) if (bucket, None) in self._steps.by_key else (bucket, truncating)
        compiled = self._steps.by_key[key]
        executable = self._first_half(bucket, compiled)
        return (lambda params, state, plan: _run(executable, compiled.explicit_transfer, params,
                                                 state, compiled.plan_wire.pack_host(plan))), key

    def masked_plan(self, decision: ScheduleDecision, plan: BatchPlan) -> BatchPlan:
        """A copy of `plan` with its constrained rows' masks, from matchers that have now seen
        every token before the one each row samples (then min_tokens' stop suppression, as
        core.py's `_fill_masks`). A row whose output has ended since (stop, grammar end,
        abort) keeps the all-allowed mask: its token is dropped."""
        plan = dataclasses.replace(plan, allowed=plan.allowed.copy())
        rows = []
        for row, seq in enumerate(decision.seqs):
            req = seq.request
            if not (seq.samples and req.matcher is not None) or seq.token_index >= len(req.generated):
                continue
            if req.num_checked != seq.token_index:
                raise RuntimeError(f"request {req.request_id}: its matcher has seen "
                                   f"{req.num_checked} tokens, the step samples token "
                                   f"{seq.token_index}: a deferred mask launched too early")
            rows.append((req.matcher, row))
        self.structured.fill_masks(rows, plan.allowed)
        suppress_stops(plan, decision, self.eos_token_ids)
        return plan

    def second_half(self, engine, launcher: Launcher, decision: ScheduleDecision,
                    deferred: Deferred, logits: Future[jax.Array]
                    ) -> tuple[Future[jax.Array], Callable]:
        """Launch the second half of a deferred step on the engine's launcher (after its first
        half, before any later step; it replaces `engine.state`'s `last_tokens` there): its
        output on the wire and the reader of it."""
        executable, wire = self._second[deferred.key]
        compiled = self._steps.by_key[deferred.key]
        buffer = compiled.plan_wire.pack_host(self.masked_plan(decision, deferred.plan))

        def device_calls() -> jax.Array:     # on the launcher's thread
            state = engine.state
            last_tokens, output = _run(executable, compiled.explicit_transfer, state.last_tokens,
                                       state.prompt_mask, state.output_counts, logits.result(),
                                       buffer)
            engine.state = dataclasses.replace(state, last_tokens=last_tokens)
            start_host_copy(output)
            return output

        return (launcher.submit(device_calls),
                lambda output: _read(wire, output))


def _read(wire: Wire, output: jax.Array) -> StepOutput:
    return wire.unpack_host(jax.device_get(output))     # explicit: a guard lets it by
