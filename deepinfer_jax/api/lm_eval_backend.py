"""The engine as an lm-evaluation-harness backend: `--model deepinfer-jax`.

    deepinfer eval --tasks hellaswag --model-args pretrained=PATH,batch_invariant=true
    python -m deepinfer_jax.api.lm_eval_backend --model deepinfer-jax --model_args ... --tasks ...

lm-eval 0.4 finds third-party models only once their module is imported (it has no entry
point group), so both commands import this module before the harness runs.

Each of lm-eval's calls runs as one `LLM.generate` over all its requests, so the engine
batches them (max_num_seqs, its token budget). A loglikelihood is the sum of the continuation
tokens' `prompt_logprobs` (the engine's, from the reference forward); greedy means every
continuation token ranks first. Every request and its exact output is recorded; with
`manifest=PATH` the record is written as a run manifest (api/manifest.py) after each call.
"""

from __future__ import annotations

import dataclasses
import sys

from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from deepinfer_jax.api import manifest as run_manifest
from deepinfer_jax.api.eval_options import parse_model_args
from deepinfer_jax.api.llm import DEFAULT_MODEL, LLM
from deepinfer_jax.host.request import SamplingParams

# lm-eval passes these to every model; the engine batches by its own options and runs where
# jax does
IGNORED_ARGS = ("batch_size", "max_batch_size", "device")


@register_model("deepinfer-jax")
class DeepInferLM(LM):
    def __init__(self, **model_args):
        super().__init__()
        given = {k: v for k, v in model_args.items() if v is not None}
        # kept apart in the manifest, so that a replay is not given them
        self.ignored_args = {k: given.pop(k) for k in IGNORED_ARGS if k in given}
        self.model_args = given
        self.args = parse_model_args(self.model_args)
        self.model_dir = self.args.pretrained or str(DEFAULT_MODEL)
        self.llm = LLM(self.model_dir, **self.args.llm_kwargs)
        if self.llm.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json; lm-eval sends text")
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = self.llm.step_config.max_model_len
        self.records: list[dict] = []
        self._calls = 0
        self._next_seed = self.args.generation_seed
        self.eval_info: dict = {}      # what `deepinfer eval` ran (tasks, limit, ...)

    # ---- lm-eval's interface ---------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args) for r in requests]
        return [tuple(o) for o in self._run("loglikelihood", [list(p) for p in pairs])]

    def loglikelihood_rolling(self, requests) -> list[float]:
        return self._run("loglikelihood_rolling", [r.args[0] for r in requests])

    def generate_until(self, requests) -> list[str]:
        batch = []
        for r in requests:
            context, gen_kwargs = r.args
            batch.append({"context": context, "gen_kwargs": dict(gen_kwargs or {}),
                          "seed": self._next_seed})
            self._next_seed += 1
        return [o["text"] for o in self._run("generate_until", batch)]

    @property
    def tokenizer_name(self) -> str:
        return "deepinfer-jax:" + self.model_dir

    # ---- recorded calls (a replay runs the same) -------------------------------------------
    def _run(self, kind: str, batch: list) -> list:
        outputs = RUNNERS[kind](self, batch) if batch else []
        self.records += [{"call": self._calls, "kind": kind, "request": req, "output": out}
                         for req, out in zip(batch, outputs, strict=True)]
        self._calls += 1
        if self.args.manifest:
            run_manifest.write(self.args.manifest, self.manifest())
        return outputs

    def replay(self, records: list[dict]) -> list[dict]:
        """Run recorded requests again, call by call as they were sent: the new records."""
        new: list[dict] = []
        calls: dict[int, list[dict]] = {}
        for rec in records:
            calls.setdefault(rec["call"], []).append(rec)
        for call, recs in sorted(calls.items()):
            kind = recs[0]["kind"]
            batch = [r["request"] for r in recs]
            outputs = RUNNERS[kind](self, batch)
            new += [{"call": call, "kind": kind, "request": req, "output": out}
                    for req, out in zip(batch, outputs, strict=True)]
        return new

    def manifest(self) -> dict:
        return {"manifest_version": run_manifest.MANIFEST_VERSION,
                "model": run_manifest.model_facts(self.model_dir),
                "model_args": self.model_args,
                "ignored_model_args": self.ignored_args,
                "engine_options": {k: _jsonable(v) for k, v in self.args.llm_kwargs.items()},
                "step_config": repr(self.llm.step_config),
                "seeds": {"engine_seed": self.args.engine.get("seed", 0),
                          "generation_seed": self.args.generation_seed,
                          "batch_invariant": self.llm.step_config.batch_invariant},
                "eval": self.eval_info,
                **run_manifest.environment(),
                "requests": self.records}

    # ---- the engine's work ------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's rule: trailing spaces of the context move to the continuation; the
        continuation's tokens are the whole text's past the context's; where a token of the
        whole text straddles the boundary, each side is tokenized on its own."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        context_ids = self.tokenizer.encode(context)
        if whole[: len(context_ids)] == context_ids and len(whole) > len(context_ids):
            return context_ids, whole[len(context_ids):]
        return context_ids, self.tokenizer.encode(continuation, add_special_tokens=False)

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[list]:
        """(context ids, continuation ids) -> [sum of the continuation's logprobs, greedy]."""
        limit = self.max_model_len - 1          # the prompt, and the one token generate makes
        prompts = []
        for context, continuation in pairs:
            if not 0 < len(continuation) <= limit - 1:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit "
                                 f"max_model_len={self.max_model_len}")
            prompts.append((context + continuation)[-limit:])
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)
        results = []
        for (_, continuation), out in zip(pairs, outs, strict=True):
            if out.error is not None:
                raise RuntimeError(f"the engine failed a request: {out.error}")
            entries = out.prompt_logprobs[-len(continuation):]
            picked = [e[t] for e, t in zip(entries, continuation, strict=True)]
            results.append([sum(p.logprob for p in picked), all(p.rank == 1 for p in picked)])
        return results

    def _loglikelihood(self, batch: list[list[str]]) -> list[list]:
        return self.score([self._encode_pair(context, cont) for context, cont in batch])

    def _rolling(self, texts: list[str]) -> list[float]:
        """Disjoint windows of max_model_len - 2 tokens, each scored on its own (lm-eval's
        get_rolling_token_windows), the first after the beginning-of-sequence token."""
        prefix = self.tokenizer.encode("")
        prefix = prefix[0] if prefix else self.llm.model.config.vocab_size - 1
        windows, owner = [], []
        for i, text in enumerate(texts):
            for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tokenizer.encode(text, add_special_tokens=False),
                    prefix_token=prefix, max_seq_len=self.max_model_len - 2, context_len=1):
                windows.append(lm_utils.make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(texts)
        for i, (logprob, _) in zip(owner, self.score([(list(c), list(p)) for c, p in windows]),
                                   strict=True):
            totals[i] += logprob
        return totals

    def _generate(self, batch: list[dict]) -> list[dict]:
        prompts, params = [], []
        for req in batch:
            p, prompt = self._sampling(req)
            prompts.append(prompt)
            params.append(p)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"the engine failed a request: {out.error}")
            c = out.outputs[0]
            results.append({"text": c.text, "token_ids": list(c.token_ids),
                            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                         strict=True)]})
        return results

    def _sampling(self, req: dict) -> tuple[SamplingParams, list[int]]:
        kw = dict(req["gen_kwargs"])
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_tokens = int(kw.pop("max_gen_toks", 256))
        do_sample = kw.pop("do_sample", None)
        temperature = kw.pop("temperature", None)      # lm-eval's vllm backend's rule:
        if do_sample is False or temperature is None:  # do_sample=False is greedy
            temperature = 1.0 if do_sample and temperature is None else 0.0
        prompt = self.tokenizer.encode(req["context"])
        max_tokens = max(1, min(max_tokens, self.max_model_len - 1))
        prompt = prompt[-(self.max_model_len - max_tokens):]
        params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                                top_p=float(kw.pop("top_p", 1.0)),
                                top_k=int(kw.pop("top_k", 0) or 0), stop=tuple(until),
                                seed=req["seed"], logprobs=0)
        return params, prompt


RUNNERS = {"loglikelihood": DeepInferLM._loglikelihood,
           "loglikelihood_rolling": DeepInferLM._rolling,
           "generate_until": DeepInferLM._generate}


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (str, int, float, bool, type(None), list, dict)):
        return value
    return str(value)


if __name__ == "__main__":      # lm-eval's own command line, with this backend registered
    from lm_eval.__main__ import cli_evaluate
    sys.exit(cli_evaluate())
