"""The LLM that `deepinfer generate`, `serve` and `bench` build from their parsed options, and
where a model named on the command line lives. Module-level functions: `serve` hands
`make_llm` (pickled by name) to its engine process."""

from __future__ import annotations


def make_llm(args, **options):
    from deepinfer_jax.api.llm import LLM

    speculative = (None if not args.speculative_tokens else
                   {"method": "mtp", "num_speculative_tokens": args.speculative_tokens,
                    "draft_token_map": args.speculative_token_map})
    if args.speculative_token_map and not args.speculative_tokens:
        raise ValueError("--speculative-token-map goes with --speculative-tokens")
    distributed = (None if args.coordinator_address is None else
                   {"coordinator_address": args.coordinator_address,
                    "num_processes": args.num_processes, "process_id": args.process_id})
    model = args.model
    if args.load_format == "dummy" and model is not None:
        model = model_config_path(model)
    elif args.dummy_layers is not None:
        raise ValueError("--dummy-layers goes with --load-format dummy")
    if args.token_buckets:
        options["token_buckets"] = tuple(args.token_buckets)
    return LLM(model, dtype=args.dtype, weights=args.weights, parallel=args.parallel,
               distributed=distributed, load_format=args.load_format,
               dummy_layers=args.dummy_layers,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages,
               gpu_memory_utilization=args.gpu_memory_utilization,
               device_memory_gib=args.device_memory_gib,
               enable_prefix_caching=args.enable_prefix_caching,
               batch_invariant=args.batch_invariant, speculative_config=speculative,
               **options)


def model_config_path(name: str):
    """A model directory or config.json, else one of the project's configs (configs/NAME.json,
    as `deepseek-v4-flash` or `tiny/tiny-mixed`) or models (models/NAME)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for path in (Path(name), repo / "configs" / f"{name}.json", repo / "configs" / name,
                 repo / "models" / name):
        if path.is_file() or (path / "config.json").is_file():
            return path
    raise FileNotFoundError(f"no model directory, config.json or project config named {name!r} "
                            f"(configs/: {sorted(p.stem for p in (repo / 'configs').glob('*.json'))})")


def model_directory(path):
    """Where a model's other files (tokenizer.json, chat template) lie: the directory itself,
    or the one holding a config file. (Here, not beside the dummy weights: the server imports it
    on the Ascend backend, where there is no jax.)"""
    from pathlib import Path

    path = Path(path)
    return path if path.is_dir() else path.parent
