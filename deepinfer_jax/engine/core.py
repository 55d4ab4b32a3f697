"""The engine core: the only module that joins the host (scheduler, plans) and the device
(compiled steps, params, state).

Asynchronous loop (default): launch step N+1, then read step N's tokens. The tokens step N
sampled stay on the device and feed step N+1 (placeholders resolved inside the jitted step);
step N's output comes back through an asynchronous device-to-host copy started at launch and
is consumed one step late. Nothing in the loop waits for the device except that read, which
happens while the next step already runs. The launch itself (XLA issuing the step's kernels,
milliseconds on a GPU) runs on the launcher's thread (launch.py), so it overlaps the read
and the next plan. The synchronous loop (launch, read, repeat) is kept for comparison and
debugging; both drive the scheduler through its two verbs: `schedule()` (the step's decision,
booked as launched, so every decision is launched at once) and `postprocess(decision, output)`
when the step's output has been read.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.host import HostOptions
from deepinfer_jax.config.memory import MemoryLimits, MemoryPlan
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.contract import BatchPlan, SpecStepOutput, StepOutput
from deepinfer_jax.engine.compile import compile_steps, enable_persistent_cache
from deepinfer_jax.engine.deferred_masks import Deferred, DeferredMasks, needs_deferring
from deepinfer_jax.engine.draft_vocab import draft_vocab_setup
from deepinfer_jax.engine.engram_rows import engram_setup, host_table_bytes
from deepinfer_jax.engine.launch import Launcher
from deepinfer_jax.engine.memory_plan import check_compiled, engine_plan
from deepinfer_jax.engine.request_checks import request_problems
from deepinfer_jax.engine.snapshot_copies import SnapshotCopies
from deepinfer_jax.engine.step_weights import with_step_weights
from deepinfer_jax.engine.tier_copies import Spilled, TierCopies
from deepinfer_jax.engine.transfer import start_host_copy
from deepinfer_jax.host.buckets import token_bucket
from deepinfer_jax.host.decision import ScheduleDecision
from deepinfer_jax.host.grammar import GrammarError, StructuredOutputs, grammar_spec
from deepinfer_jax.host.plan_builder import build_plan, suppress_stops
from deepinfer_jax.host.ranks import RankedDecision, RankedScheduler
from deepinfer_jax.host.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
)
from deepinfer_jax.host.scheduler import Scheduler
from deepinfer_jax.host.spec_booking import SpecBooking
from deepinfer_jax.host.stop_strings import StopStrings
from deepinfer_jax.host.tokenizer import TextTokenizer
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.model.v41.params import V41ModelParams
from deepinfer_jax.parallel.eplb import ExpertBalancer, compile_transfer, with_placement
from deepinfer_jax.parallel.mesh import (
    abstract_state,
    make_mesh,
    mesh_context,
    place_params,
    placed_state,
)


@dataclasses.dataclass
class LoopStats:
    """Where the loop's time goes: host work (planning, dispatch, bookkeeping) vs waiting for
    the device's tokens."""

    steps: int = 0
    tokens: int = 0             # tokens fed (drafts included)
    host_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    decision: ScheduleDecision
    output: Future[jax.Array]               # the step's output on the wire (compile.py)
    read: Callable[[jax.Array], StepOutput | SpecStepOutput]
    spilled: Spilled = dataclasses.field(default_factory=list)   # for the KV tiers, once read
    deferred: Deferred | None = None    # `output`: the kept logits until masked (deferred_masks.py)


class EngineCore:
    def __init__(self, cfg: ModelConfig | V41Config, params: ModelParams | V41ModelParams,
                 step_cfg: StepConfig, host: HostOptions, tokenizer: TextTokenizer | None = None,
                 memory: MemoryLimits | None = None, engram_token_map: np.ndarray | None = None):
        """cfg, params: a DeepSeek-V4 or V4.1 model (model/family.py dispatches on the config).
        memory: the device memory to plan the page pool against (engine/memory_plan.py);
        the step's shapes then take the planned pool (`self.step_cfg`), and a model that does
        not fit raises InsufficientMemoryError before its steps compile. None: the pool as
        `step_cfg` has it.
        engram_token_map: i64[V] the tokenizer-derived ids the Engram hash reads (V4.1 with
        Engram; engine/engram_rows.py)."""
        # with host tables (the default) the params keep none: the plan carries the rows
        params, step_cfg, self.engram_rows = engram_setup(cfg, params, step_cfg, host,
                                                          engram_token_map)
        if step_cfg.batch_invariant:
            require_batch_invariant_support()
        if step_cfg.spec_tokens and not params.mtp:
            raise EngineConfigError("speculative decoding needs the checkpoint's MTP weights "
                                    "(mtp.* tensors); this checkpoint has none")
        params = with_step_weights(draft_vocab_setup(params, step_cfg, cfg.vocab_size))
        self.cfg = cfg
        # before the probe's and the state's first computations: their programs load from
        # jax's cache
        enable_persistent_cache(host.compilation_cache_dir)
        # Over several devices: the parameters placed on the mesh (parallel/mesh.py), the state
        # replicated, and every program traced with the mesh as its context (the routed
        # experts' shard_map names its axis).
        self.mesh = make_mesh(step_cfg.compute.parallel)
        parallel = step_cfg.compute.parallel
        if parallel.eplb is not None:      # the expert stacks in their physical slots
            params, assignments = with_placement(
                params, cfg.n_routed_experts,
                cfg.n_routed_experts + parallel.eplb.num_redundant_experts, parallel.expert_ranks)
        with mesh_context(self.mesh):
            if self.mesh is not None:
                params = place_params(params, self.mesh)
            self.balancer = None if parallel.eplb is None else ExpertBalancer(
                cfg.n_routed_experts, parallel.expert_ranks, assignments,
                compile_transfer(params.layers[0].moe.experts),
                np.zeros((cfg.num_layers, cfg.n_routed_experts), np.int64))
            self._start(cfg, params, step_cfg, host, tokenizer, memory)

    def _start(self, cfg: ModelConfig, params: ModelParams, step_cfg: StepConfig,
               host: HostOptions, tokenizer: TextTokenizer | None,
               memory: MemoryLimits | None) -> None:
        self.memory_plan: MemoryPlan | None = None
        if memory is not None:
            step_cfg, self.memory_plan = engine_plan(params, cfg, step_cfg, host, memory,
                                                     self.mesh, host_table_bytes(self.engram_rows))
        self.params, self.step_cfg, self.host = params, step_cfg, host
        self.tokenizer = tokenizer
        # grammars need an end-of-sequence token to accept at (llguidance); a model that
        # names none (the V4.1 fixtures) refuses constrained requests instead (request_checks.py)
        self.structured = None if tokenizer is None or not cfg.eos_token_ids else StructuredOutputs(
            tokenizer.path, cfg.vocab_size, cfg.eos_token_ids, host.grammar_compile_timeout_s)
        # Compiled for the state's shapes (as the memory plan's probe was, whose step this
        # finds done where the plan kept the pool it probed), then the state is allocated.
        state = abstract_state(self.cfg, step_cfg, params.embed.dtype, self.mesh)
        self.steps = compile_steps(params, state, self.cfg, step_cfg, host)
        # With speculation, small batches run the speculative step and large ones (no room in
        # the verify budget) the plain one; the MTP window then lags, which only costs drafts.
        self.spec_steps = (compile_steps(params, state, self.cfg, step_cfg, host,
                                         speculative=True)
                           if step_cfg.spec_tokens else None)
        if self.memory_plan is not None:
            check_compiled(self.memory_plan, self.steps, self.spec_steps)
        self.state = placed_state(self.cfg, step_cfg, params.embed.dtype, self.mesh)
        # slot snapshots of the prefix cache, and the KV tiers below the device (None: off)
        self.snapshots = (SnapshotCopies(self.state, step_cfg) if step_cfg.enable_prefix_caching
                          else None)
        self.tiers = TierCopies.of(host.kv_tiers, cfg, self.state, self.snapshots, step_cfg)
        ranks = step_cfg.compute.parallel.dp
        worker = self.tiers and self.tiers.worker
        self.scheduler = (RankedScheduler(step_cfg, cfg.eos_token_ids, ranks, worker) if ranks > 1
                          else Scheduler(step_cfg, cfg.eos_token_ids, worker))
        # constrained rows every step, their masks applied late (deferred_masks.py): one rank
        self.deferred = (DeferredMasks(params, self.state, cfg, step_cfg, self.steps, self.structured,
                                       cfg.eos_token_ids)
                         if self.structured and host.async_scheduling and ranks == 1
                         and self.mesh is None and not step_cfg.spec_tokens else None)
        self.scheduler.defers_masks = self.deferred is not None
        if step_cfg.spec_tokens and host.async_scheduling:   # speculation in the async loop
            self.scheduler.spec_booking = SpecBooking()       # (one rank: config/engine.py)
        self._seeds = np.random.default_rng(host.seed)
        self._arrivals = itertools.count()
        self._in_flight: collections.deque[InFlight] = collections.deque()
        # requests whose grammar is compiling, by grammar (host/grammar.py)
        self._awaiting_grammar: dict[tuple[str, str], list[Request]] = {}
        # Device calls (state, snapshot pool) run on the launcher, in order; the loop only
        # reads their outputs. Threaded where the loop overlaps steps.
        self._launcher = Launcher(threaded=host.async_scheduling and host.launch_thread)
        self.stats = LoopStats()
        eplb = step_cfg.compute.parallel.eplb
        self._rebalance_interval = eplb.step_interval if eplb is not None else 0

    @property
    def num_steps(self) -> int:
        return self.stats.steps

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises InvalidRequestError (and queues nothing) if it cannot run."""
        problems = request_problems(self, prompt, params)
        if problems:
            raise InvalidRequestError("; ".join(problems))
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        spec = grammar_spec(params) if self.structured is not None else None
        matcher = self.structured.lookup(spec) if spec is not None else None
        stop_strings = StopStrings(self.tokenizer.decoder(params.skip_special_tokens),
                                   params.stop) if params.stop else None
        request = Request(request_id, list(prompt), params, next(self._arrivals), seed=seed,
                          stop_strings=stop_strings)
        if matcher is StructuredOutputs.PENDING:     # queued once its grammar compiles
            self._awaiting_grammar.setdefault(spec, []).append(request)
        else:
            request.matcher = matcher
            self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        for waiting in self._awaiting_grammar.values():
            for req in waiting:
                if req.request_id == request_id:
                    waiting.remove(req)
                    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
                    return req
        return self.scheduler.abort(request_id)

    def num_awaiting_grammar(self) -> int:
        """Requests queued until their grammar compiles (not yet in the scheduler)."""
        return sum(len(waiting) for waiting in self._awaiting_grammar.values())

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or bool(self._in_flight)
                or any(self._awaiting_grammar.values()))

    def _admit_compiled(self) -> list[Request]:
        """Requests whose grammar finished compiling join the scheduler; those whose grammar
        failed finish with its error (returned, as the step's other finished requests are).
        Waits a little for the compiler when there is nothing else to do."""
        if not any(self._awaiting_grammar.values()):
            return []
        idle = not self.scheduler.has_work() and not self._in_flight
        failed = []
        for spec, error in self.structured.poll(wait_s=0.05 if idle else 0.0):
            for req in self._awaiting_grammar.pop(spec, []):
                try:
                    req.matcher = self.structured.matcher(spec) if error is None else None
                except GrammarError as e:
                    error = e
                if error is None:
                    self.scheduler.add(req)
                else:
                    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
                    req.error = error
                    failed.append(req)
        return failed

    def set_launch_thread(self, enabled: bool) -> None:
        """Launch the next steps on the worker thread or from the loop's own (an A/B for
        benchmarks); waits until every launched step's device calls have been made."""
        for flight in self._in_flight:
            flight.output.result()
        self._launcher = Launcher(threaded=enabled and self.host.async_scheduling)

    def rebalance_experts(self) -> Future[None]:
        """Reassign the routed experts' physical slots from the load counted since the last
        rebalance (parallel/eplb.py), between steps in launch order: every step launched
        before ran on the old placement, every later one runs on the new. Done when the
        future is."""
        if self.balancer is None:
            raise EngineConfigError("rebalance_experts needs the expert load balancer: "
                                    "parallel={..., 'eplb': {...}}")

        def device_calls() -> None:     # on the launcher's thread
            self.params = self.balancer.rebalance(self.params, self.expert_load())
        return self._launcher.submit(device_calls)

    def expert_load(self) -> np.ndarray:
        """Routed pairs per layer and expert since start-up, i64[L, E] (the data-parallel
        ranks' counts summed), as of the last step launched (waits for it)."""
        load = np.asarray(self.state.expert_load, np.int64)
        return load.sum(axis=0) if load.ndim == 3 else load

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Advance the engine by one step. Returns the requests whose tokens reached the host
        in this call (a finished request is complete once `is_complete`)."""
        start = time.perf_counter()
        done = self._admit_compiled()
        # a speculative step planned before the last one is read needs the scheduler's booking
        # (host/spec_booking.py), and some steps need the last one read: planned synchronously
        booking = getattr(self.scheduler, "spec_booking", None)
        if self._in_flight and self.spec_steps is not None and (
                booking is None or booking.must_read_first(self.scheduler)):
            done += self._read(self._in_flight.popleft())
        decision = self.scheduler.schedule()
        if decision.seqs:
            self._in_flight.append(self._launch(decision))
            if self._rebalance_interval and self.stats.steps % self._rebalance_interval == 0:
                self.rebalance_experts()
        touched = []
        keep = 1 if self.host.async_scheduling and decision.seqs else 0
        if len(self._in_flight) > keep:
            touched = self._read(self._in_flight.popleft())
        if self._in_flight and self._in_flight[0].deferred:     # its matchers are up to date
            self._in_flight[0] = self._masked(self._in_flight[0])
        self.stats.host_seconds += time.perf_counter() - start
        return done + touched

    def _launch(self, decision: ScheduleDecision) -> InFlight:
        now = time.time()
        for seq in decision.seqs:
            metrics = seq.request.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        bucket = token_bucket(self.step_cfg.token_buckets, decision.num_tokens)
        defer = self.deferred is not None and needs_deferring(decision)
        plan = ([self._plan(d, bucket) for d in decision.ranks]
                if isinstance(decision, RankedDecision) else self._plan(decision, bucket, defer))
        steps = self.spec_steps if decision.speculative else self.steps
        compiled = steps.select(bucket, decision.truncating_sampler)
        call, key = (self.deferred.first_half(bucket, decision.truncating_sampler) if defer
                     else (compiled, None))
        restores, saves = decision.restores, decision.saves
        tier_ops, spilled = getattr(decision, "tier_ops", ()), []

        def device_calls() -> jax.Array:     # on the launcher's thread
            if tier_ops:     # first: a spilled page may be loaded into, a loaded one restored
                self.state = self.tiers.run(self.state, tier_ops, spilled)
            if restores:
                self.state = self.snapshots.restore(self.state, restores)
            self.state, output = call(self.params, self.state, plan)
            if not defer:       # a first half's logits stay on the device
                start_host_copy(output)
            if saves:
                self.snapshots.save(self.state, saves)
            return output

        output = self._launcher.submit(device_calls)
        self.stats.steps += 1
        self.stats.tokens += decision.num_tokens
        return InFlight(decision, output, compiled.read, spilled,
                        Deferred(plan, key) if defer else None)

    def _masked(self, flight: InFlight) -> InFlight:
        """A deferred step's second half launched with its masks (deferred_masks.py)."""
        output, read = self.deferred.second_half(self, self._launcher, flight.decision,
                                                 flight.deferred, flight.output)
        return dataclasses.replace(flight, output=output, read=read, deferred=None)

    def _plan(self, decision: ScheduleDecision, bucket: int, defer: bool = False) -> BatchPlan:
        plan = build_plan(decision, bucket, self.step_cfg)
        if self.engram_rows is not None:
            self.engram_rows.fill(plan, decision)
        if not defer:      # deferred: the masks go on a copy once the matchers catch up
            self._fill_masks(plan, decision)
        return plan

    def _fill_masks(self, plan, decision: ScheduleDecision) -> None:
        """Token bitmasks of the rows that sample: grammar (the matcher has seen every token
        so far, else the step is deferred), then min_tokens."""
        rows = [(seq.request.matcher, row) for row, seq in enumerate(decision.seqs)
                if seq.samples and seq.request.matcher is not None]
        if rows:
            self.structured.fill_masks(rows, plan.allowed)
        suppress_stops(plan, decision, self.cfg.eos_token_ids)

    def _read(self, flight: InFlight) -> list[Request]:
        flight = self._masked(flight) if flight.deferred else flight
        waited = time.perf_counter()
        out = flight.read(flight.output.result())
        waited = time.perf_counter() - waited
        self.stats.wait_seconds += waited
        self.stats.host_seconds -= waited      # step() adds the whole call
        if flight.spilled:       # filled by the launcher before the output's future is done
            self.tiers.put(flight.spilled)
        touched = self.scheduler.postprocess(flight.decision, out)
        now = time.time()
        for req in touched:
            req.metrics.first_token_time = req.metrics.first_token_time or now
            if req.is_complete:
                req.metrics.finished_time = now
        return touched


# Platforms whose step the engine can make batch-invariant: the jnp formulations of
# model/invariant.py hold on XLA's CPU and GPU backends (fixed shapes per tile). Others (the
# Ascend bridge has its own step) must say so instead of silently running without it.
BATCH_INVARIANT_PLATFORMS = ("cpu", "gpu", "cuda")


class UnsupportedModeError(RuntimeError):
    pass


def require_batch_invariant_support(platform: str | None = None) -> None:
    platform = platform or jax.devices()[0].platform
    if platform not in BATCH_INVARIANT_PLATFORMS:
        raise UnsupportedModeError(f"batch-invariant mode is not available on {platform!r}")
