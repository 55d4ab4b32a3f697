"""`deepinfer serve`: the OpenAI API over HTTP (api/server/), its engine in a process of its
own (api/server/engine_process.py) or, with --engine-in-process, on a thread of the server's."""

from __future__ import annotations

import argparse
import functools
import sys


def add_parser(sub, engine_args) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, models, "
                                     "health, metrics) over HTTP")
    s.add_argument("model_path", nargs="?", metavar="MODEL",
                   help="checkpoint directory (the same as --model)")
    engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", help="the model's name in the API (default: the "
                                               "model directory's name)")
    s.add_argument("--max-logprobs", type=int, default=20,
                   help="the most top logprobs a request may ask for")
    s.add_argument("--grammar-compile-timeout-s", type=float, default=10.0,
                   help="a structured-output grammar that takes longer fails its request")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server's process (for debugging: "
                        "it shares the GIL with the HTTP side) instead of a process of its own")
    s.add_argument("--engine-start-timeout-s", type=float,
                   help="give up on an engine process not ready after this long (default: "
                        "wait while it lives)")
    s.add_argument("--gil-switch-interval-ms", type=float, default=0.5,
                   help="how long a thread may hold the GIL while another waits (Python's "
                        "default 5 ms)")
    s.set_defaults(func=serve)


def serve(args) -> int:
    """Load the model, then serve the OpenAI API until interrupted."""
    from pathlib import Path

    import uvicorn

    from deepinfer_jax.api.cli_llm import make_llm, model_config_path, model_directory
    from deepinfer_jax.api.llm import DEFAULT_MODEL
    from deepinfer_jax.api.server.app import build_app
    from deepinfer_jax.api.server.engine_process import EngineProcess

    if args.coordinator_address is not None and args.num_processes > 1:
        # every process would serve HTTP and step its engine apart from the others'
        print("serve runs the engine in one process; an engine over several processes "
              "(--coordinator-address) cannot be served yet", file=sys.stderr)
        return 2
    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            print("give the model once: MODEL or --model", file=sys.stderr)
            return 2
        args.model = args.model_path
    model_dir = Path(args.model) if args.model is not None else DEFAULT_MODEL
    if args.load_format == "dummy" and args.model is not None:
        model_dir = model_config_path(args.model)     # a directory or a config file
    name = args.served_model_name or (model_dir.stem if model_dir.is_file() else model_dir.name)
    model_dir = model_directory(model_dir)
    # (the parsed options without `func`: this module's function, pickled by name)
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    build_llm = functools.partial(make_llm, options,
                                  grammar_compile_timeout_s=args.grammar_compile_timeout_s,
                                  max_logprobs=args.max_logprobs, show_progress=True)
    engine = (build_llm() if args.engine_in_process
              else EngineProcess(build_llm, args.engine_start_timeout_s))
    try:
        app = build_app(engine, name, model_dir)
        print(f"serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
        # With --engine-in-process the engine thread and the event loop share the GIL: when a
        # step's device work ends, the engine thread waits for the GIL while the event loop
        # formats and writes clients' chunks, up to the switch interval, and Python's 5 ms
        # would exceed a whole decode step on a GPU (a few ms). A process of our own: the
        # setting is ours to make.
        sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if isinstance(engine, EngineProcess):      # (stopped already, unless uvicorn failed)
            engine.stop()
    return 0
