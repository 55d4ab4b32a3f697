"""The admission the scheduler had before issue 31, kept for comparison only (benchmarks, and
tests that need the preemption path): a waiting request is admitted whenever its first
chunk's pages are free, however many pages the running requests will still need. Under cache
pressure that admits more than the cache holds, and decoding then preempts."""

from __future__ import annotations

from deepinfer_jax.host.request import Request
from deepinfer_jax.host.scheduler import Scheduler
from deepinfer_jax.host.spec_booking import SpecBooking


class FirstChunkAdmission(Scheduler):
    def _fits(self, req: Request, reserved: int) -> bool:
        return True


def admit_first_chunks(llm) -> None:
    """Give `llm`'s engine (no request added yet) the old admission."""
    engine = llm.engine
    if engine.scheduler.has_work():
        raise RuntimeError("the scheduler is replaced before any request is added")
    old = engine.scheduler
    engine.scheduler = FirstChunkAdmission(engine.step_cfg, engine.cfg.eos_token_ids)
    engine.scheduler.defers_masks = old.defers_masks
    if old.spec_booking is not None:         # speculation in the asynchronous loop
        engine.scheduler.spec_booking = SpecBooking()
