"""`deepinfer eval`: lm-evaluation-harness tasks on the engine, with a run manifest beside the
results; `deepinfer eval --replay MANIFEST` runs a manifest's requests again and reports every
request whose output is not bitwise equal, and every model file whose sha256 changed.

    deepinfer eval --tasks arc_easy --model-args pretrained=PATH,batch_invariant=true \\
        --output-dir runs/arc                      # runs/arc/results.json, runs/arc/manifest.json
    deepinfer eval --replay runs/arc/manifest.json --model-args max_num_seqs=2
"""

from __future__ import annotations

import json
from pathlib import Path

# lm-eval's defaults, passed explicitly so that the manifest states them
LM_EVAL_SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234,
                 "fewshot_random_seed": 1234}


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="lm-evaluation-harness tasks on the engine, with a "
                                    "replayable run manifest (or --replay one)")
    e.add_argument("--tasks", help="comma-separated lm-eval task names")
    e.add_argument("--model-args", default="", metavar="K=V,...",
                   help="pretrained=PATH and the engine's options (api/eval_options.py); with "
                        "--replay, overrides of the manifest's (e.g. max_num_seqs=2)")
    e.add_argument("--include-path", help="a folder of task YAML files of your own")
    e.add_argument("--limit", type=float, help="documents per task (a fraction if < 1)")
    e.add_argument("--num-fewshot", type=int)
    e.add_argument("--output-dir", default="eval-results",
                   help="where results.json and manifest.json go (eval-results)")
    e.add_argument("--replay", metavar="MANIFEST", help="rerun a manifest's requests and "
                   "compare; exits 1 when an output or a model file differs")


def run(args) -> int:
    try:
        from lm_eval.utils import simple_parse_args_string
    except ImportError:
        raise SystemExit("deepinfer eval needs lm-evaluation-harness: pip install "
                         "'deepinfer-jax[eval]' (or lm-eval)") from None

    overrides = simple_parse_args_string(args.model_args)
    if args.replay:
        return replay(args.replay, overrides)
    if not args.tasks:
        raise SystemExit("deepinfer eval: --tasks is required (or --replay MANIFEST)")
    return evaluate(args.tasks.split(","), overrides, Path(args.output_dir), args.include_path,
                    args.limit, args.num_fewshot)


def evaluate(tasks: list[str], model_args: dict, output_dir: Path, include_path=None,
             limit=None, num_fewshot=None) -> int:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from deepinfer_jax.api import manifest as run_manifest
    from deepinfer_jax.api.lm_eval_backend import DeepInferLM

    output_dir.mkdir(parents=True, exist_ok=True)
    lm = DeepInferLM(**model_args)
    lm.eval_info = {"tasks": tasks, "include_path": include_path, "limit": limit,
                    "num_fewshot": num_fewshot, "lm_eval_seeds": LM_EVAL_SEEDS}
    results = simple_evaluate(model=lm, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                              task_manager=TaskManager(include_path=include_path),
                              log_samples=True, **LM_EVAL_SEEDS)
    samples = results.pop("samples", {})
    (output_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (output_dir / "samples.json").write_text(json.dumps(samples, indent=1, default=str) + "\n")
    run_manifest.write(output_dir / "manifest.json", lm.manifest())
    for task, metrics in results["results"].items():
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        print(f"{task}: {json.dumps(shown)}")
    print(f"results, samples and manifest written to {output_dir}")
    return 0


def replay(path: str | Path, overrides: dict | None = None) -> int:
    """Rerun a manifest's requests with its model args (and `overrides`); print one line per
    changed model file and per differing request; 0 when all match, else 1."""
    report = replay_report(path, overrides)
    for line in report["notes"]:
        print("note: " + line)
    for line in report["changed_files"]:
        print("model file changed: " + line)
    for line in report["differences"]:
        print("differs: " + line)
    matched = report["requests"] - len(report["differences"])
    print(f"{matched}/{report['requests']} requests bitwise equal; "
          f"{len(report['changed_files'])} model file(s) changed")
    return 0 if report["ok"] else 1


def replay_report(path: str | Path, overrides: dict | None = None) -> dict:
    from deepinfer_jax.api import manifest as run_manifest
    from deepinfer_jax.api.lm_eval_backend import DeepInferLM

    recorded = run_manifest.read(path)
    model_args = {**recorded["model_args"], **(overrides or {})}
    model_args.pop("manifest", None)               # a replay writes no manifest of its own
    model_args.setdefault("pretrained", recorded["model"]["path"])
    lm = DeepInferLM(**model_args)
    changed = run_manifest.changed_files(recorded["model"]["files"], lm.model_dir)
    new = lm.replay(recorded["requests"])
    diffs = run_manifest.differences(recorded["requests"], new)
    now = run_manifest.environment()
    notes = [f"{key} was {recorded.get(key)}, is {now[key]}" for key in ("packages", "git",
             "device") if recorded.get(key) != now[key]]
    if overrides:
        notes.append(f"model args overridden: {overrides}")
    return {"ok": not changed and not diffs, "changed_files": changed, "differences": diffs,
            "requests": len(recorded["requests"]), "notes": notes, "replayed": new}
