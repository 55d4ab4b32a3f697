"""lm-evaluation-harness on the engine (`deepinfer eval`), and the run manifest's replay.

One run of three local tasks (multiple choice, generation, rolling loglikelihood; task YAML and
data written here, nothing downloaded) in batch-invariant mode; its scores are checked against
log-softmaxes of the cache-free reference forward computed here, and its manifest is replayed
with another concurrency (bitwise equal) and against a copy of the model with one tensor
changed (the file and the requests reported).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import numpy as np
import pytest
from tokenizers import Tokenizer

from deepinfer_jax.api import cli, eval_cli, manifest
from deepinfer_jax.api.eval_options import parse_model_args
from deepinfer_jax.api.llm import DEFAULT_MODEL
from deepinfer_jax.api.model import load

MC = [  # Python continuations for the model trained on the standard library; some it gets wrong
    {"question": "import os\nimport", "choices": [" sys", " banana", " )"], "answer": 0},
    {"question": "def __init__(self", "choices": [", name):", " ++ 3", "!!"], "answer": 0},
    {"question": "for i in", "choices": [" range(10):", " class", " return"], "answer": 0},
    {"question": "class Foo(", "choices": ["object):", "in in", "pass"], "answer": 1},
    {"question": "    return", "choices": [" None", " def", " import"], "answer": 2},
    {"question": "if x is", "choices": [" None:", " def", " +="], "answer": 1},
]
GEN = [{"prompt": p} for p in ("def main():\n", "import", "class A:\n    def", "# Copyright",
                               "if __name__ ==")]
ROLL = [{"text": "import sys\n\ndef main(argv):\n    return 0\n"},
        {"text": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"}]
TASKS = {
    "tiny_mc": ("multiple_choice", MC, {"doc_to_text": "{{question}}", "doc_to_choice":
                "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}),
    "tiny_gen": ("generate_until", GEN, {"doc_to_text": "{{prompt}}", "doc_to_target": "",
                 "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False},
                 "metric_list": [{"metric": "exact_match"}]}),
    "tiny_roll": ("loglikelihood_rolling", ROLL, {"doc_to_text": "", "doc_to_target": "{{text}}",
                  "metric_list": [{"metric": "word_perplexity"}]}),
}


def write_tasks(folder):
    for name, (output_type, docs, fields) in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": name, "dataset_path": "json", "test_split": "test",
                "dataset_kwargs": {"data_files": {"test": str(data)},
                                   "cache_dir": str(folder / "hf")},
                "output_type": output_type, "target_delimiter": "", **fields}
        (folder / f"{name}.yaml").write_text(json.dumps(task))   # JSON is YAML


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    write_tasks(folder)
    out = folder / "out"
    rc = cli.main(["eval", "--tasks", ",".join(TASKS), "--include-path", str(folder),
                   "--model-args", "batch_invariant=true,max_num_seqs=4", "--output-dir",
                   str(out)])
    assert rc == 0
    return {name: json.loads((out / f"{name}.json").read_text())
            for name in ("results", "samples", "manifest")} | {"dir": out}


def reference_loglikelihood(model, tokenizer, context: str, continuation: str):
    """The continuation's summed logprob and whether each of its tokens is the argmax, from
    the cache-free forward's logits, log-softmaxed here in float64."""
    ctx = tokenizer.encode(context).ids
    whole = tokenizer.encode(context + continuation).ids
    assert whole[: len(ctx)] == ctx and len(whole) > len(ctx)     # the data's boundaries are clean
    logits = model.logits(whole)[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    rows = np.arange(len(ctx) - 1, len(whole) - 1)
    targets = np.asarray(whole[len(ctx):])
    return logprobs[rows, targets].sum(), bool((logits[rows].argmax(-1) == targets).all())


def test_lm_eval_scores_equal_the_reference_forwards(run):
    model = load(DEFAULT_MODEL)
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    correct = []
    for doc, sample in zip(MC, sorted(run["samples"]["tiny_mc"], key=lambda s: s["doc_id"]),
                           strict=True):
        ours = [reference_loglikelihood(model, tokenizer, doc["question"], c)
                for c in doc["choices"]]
        theirs = [r[0] for r in sample["resps"]]
        np.testing.assert_allclose([o[0] for o in ours], [t[0] for t in theirs], rtol=1e-6)
        assert [o[1] for o in ours] == [t[1] for t in theirs]
        correct.append(int(np.argmax([o[0] for o in ours])) == doc["answer"])
    acc = run["results"]["results"]["tiny_mc"]["acc,none"]
    assert acc == pytest.approx(np.mean(correct))
    assert 0 < acc < 1            # the data tells right from wrong answers both ways


def test_manifest_records_the_run(run):
    m = run["manifest"]
    sha256 = hashlib.sha256((DEFAULT_MODEL / "model.safetensors").read_bytes()).hexdigest()
    assert m["model"]["files"]["model.safetensors"] == sha256
    assert m["model"]["config"] == json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert m["engine_options"]["batch_invariant"] is True and m["seeds"]["batch_invariant"]
    assert m["packages"]["jax"] and m["packages"]["lm_eval"] and m["device"]["platform"] == "cpu"
    kinds = [r["kind"] for r in m["requests"]]
    assert kinds.count("loglikelihood") == sum(len(d["choices"]) for d in MC)
    assert kinds.count("generate_until") == len(GEN) and kinds.count("loglikelihood_rolling") == 2
    gens = [r["output"] for r in m["requests"] if r["kind"] == "generate_until"]
    assert all(len(g["logprobs"]) == len(g["token_ids"]) > 0 for g in gens)


def test_replay_on_another_concurrency_is_bitwise_equal(run):
    report = eval_cli.replay_report(run["dir"] / "manifest.json", {"max_num_seqs": 2})
    assert report["ok"], report["differences"] + report["changed_files"]
    assert report["requests"] == len(run["manifest"]["requests"])
    # every number compared, generated tokens' logprobs included
    assert report["replayed"] == run["manifest"]["requests"]


@pytest.mark.slow
def test_a_speculative_run_replays_bitwise_on_another_concurrency(tmp_path):
    """With MTP speculation too (a combination: the slow tier). Until 70f3a61 (the CPU sampler
    in fixed row tiles) 3 of 5 generations' logprobs moved by up to 1.2e-7 here."""
    write_tasks(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["eval", "--tasks", "tiny_gen", "--include-path", str(tmp_path),
                     "--model-args", "batch_invariant=true,max_num_seqs=4,speculative_tokens=2",
                     "--output-dir", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine_options"]["speculative_config"]["num_speculative_tokens"] == 2
    report = eval_cli.replay_report(out / "manifest.json", {"max_num_seqs": 2})
    assert report["ok"], report["differences"] + report["changed_files"]
    assert report["replayed"] == manifest["requests"] and len(manifest["requests"]) == len(GEN)


def flip_sign(safetensors_path, name: str) -> None:
    """Negate one tensor in place (the sign bit of each element, any float dtype)."""
    raw = bytearray(safetensors_path.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8: 8 + size])[name]["data_offsets"]
    width = {"BF16": 2, "F16": 2, "F32": 4}[json.loads(raw[8: 8 + size])[name]["dtype"]]
    for i in range(8 + size + start + width - 1, 8 + size + end, width):
        raw[i] ^= 0x80
    safetensors_path.write_bytes(bytes(raw))


def test_replay_reports_a_changed_weight_file(run, tmp_path, capsys):
    copy = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, copy)
    flip_sign(copy / "model.safetensors", "head.weight")
    rc = cli.main(["eval", "--replay", str(run["dir"] / "manifest.json"),
                   "--model-args", f"pretrained={copy}"])
    out = capsys.readouterr().out
    assert rc == 1
    changed = [line for line in out.splitlines() if line.startswith("model file changed: ")]
    assert len(changed) == 1 and "model.safetensors" in changed[0]
    differs = [line for line in out.splitlines() if line.startswith("differs: request ")]
    # a negated output head changes every loglikelihood and generation
    assert len(differs) == len(run["manifest"]["requests"])


def test_model_args_are_parsed_with_types():
    a = parse_model_args({"pretrained": "/m", "max_num_seqs": "8", "batch_invariant": "True",
                          "enable_prefix_caching": 1, "speculative_tokens": "3",
                          "gpu_memory_utilization": "0.5", "generation_seed": "7"})
    assert a.pretrained == "/m" and a.generation_seed == 7
    assert a.engine["max_num_seqs"] == 8 and a.engine["batch_invariant"] is True
    assert a.engine["enable_prefix_caching"] is True and a.engine["gpu_memory_utilization"] == 0.5
    assert a.engine["speculative_config"] == {"num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_model_args({"max_num_seqs": "eight"})
    with pytest.raises(ValueError, match="unknown model arg 'max_seqs'"):
        parse_model_args({"max_seqs": 2})


def test_manifest_comparisons_name_what_changed(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"a")
    (tmp_path / "b.bin").write_bytes(b"b")
    recorded = manifest.file_hashes(tmp_path)
    assert manifest.changed_files(recorded, tmp_path) == []
    (tmp_path / "a.bin").write_bytes(b"A")
    (tmp_path / "b.bin").unlink()
    (tmp_path / "c.bin").write_bytes(b"c")
    changed = manifest.changed_files(recorded, tmp_path)
    assert [line.split(":")[0] for line in changed] == ["a.bin", "b.bin", "c.bin"]

    def gen(tokens, logprobs):
        return {"call": 0, "kind": "generate_until", "request": {"context": "x"},
                "output": {"text": "", "token_ids": tokens, "logprobs": logprobs}}
    old = [gen([1, 2], [-1.0, -2.0]), gen([3], [-0.5]), gen([4], [-0.25])]
    new = [gen([1, 2], [-1.0, -2.0 - 2**-40]), gen([3, 5], [-0.5, -1.0]), gen([4], [-0.25])]
    assert manifest.differences(old, new) == [
        "request 0 (generate_until): same tokens; logprobs differ at 1 of 2, by up to 9.09e-13",
        "request 1 (generate_until): tokens [3] -> [3, 5]"]
