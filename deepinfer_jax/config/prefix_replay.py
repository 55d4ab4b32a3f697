"""How a prefix-cache hit rebuilds the slot's sliding windows (EngineConfig.prefix_replay).

* "exact" (the default): each cached block end keeps a snapshot of the slot's window rings and
  compressor tails; a hit restores it and continues as a cold run would, bit for bit in
  batch-invariant mode.
* "bounded": snapshots keep only the compressor tails that the next compressed row still reads
  (V4's CSA and its indexer's overlap ring; nothing for V4.1, whose groups do not overlap);
  a hit restores those and replays the prefix's last `swa_replay_tokens` tokens (all of them
  if it is shorter) to rebuild the windows. The
  replayed tokens see the cached compressed rows and write only their window rows: the rows
  they would close exist already, in pages shared with the cache. Exact (bitwise in
  batch-invariant mode) for a replay of at least num_layers * (sliding_window - 1) tokens,
  the windows' reach through the layers; approximate below it (bench/prefix_replay.py
  measures by how much).
"""

from __future__ import annotations

from deepinfer_jax.config.errors import EngineConfigError

PREFIX_REPLAY_MODES = ("exact", "bounded")


def check_prefix_replay(options) -> None:
    """Validate an EngineConfig's prefix_replay and swa_replay_tokens."""
    mode, tokens = options.prefix_replay, options.swa_replay_tokens
    if mode not in PREFIX_REPLAY_MODES:
        raise EngineConfigError(f"prefix_replay must be one of {PREFIX_REPLAY_MODES}, "
                                f"got {mode!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise EngineConfigError(f"swa_replay_tokens must be an int >= 1, got {tokens!r}")


def bounded_replay_tokens(options) -> int:
    """StepConfig.bounded_replay: the tokens a hit replays, 0 in exact mode (or without prefix
    caching)."""
    bounded = options.enable_prefix_caching and options.prefix_replay == "bounded"
    return options.swa_replay_tokens if bounded else 0
