"""Run one vLLM ``LLM`` engine as the e2e tests describe it, in its own process tree.

Usage: python engine_runner.py SPEC.json OUT.json

SPEC: {"llm": {LLM keyword arguments}, "kwarg_flag": backend or null (passed as
``LLM(monokernel_backend=...)`` after loading vLLM's plugins), "batches": [{"prompts":
[[token ids], ...], "max_tokens": [n, ...]}, ...], "logprobs": k (top-k per step, default 2)}. Each engine gets fresh engine-core and
worker processes, so engines never share a model registry or plugin state.

OUT: greedy token ids and top-2 logprobs per batch, the worker reports
(``mono_ext.engines.vllm.report.worker_report``), and front-process facts (pid, plugin loads,
the VllmConfig hash, additional_config, model_class_overrides).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(spec["llm"])
    if spec.get("kwarg_flag"):
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # LLM(monokernel_backend=...) needs the plugin's EngineArgs
        kwargs["monokernel_backend"] = spec["kwarg_flag"]
    llm = LLM(**kwargs)
    t1 = time.time()
    batches = []
    for batch in spec["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                ignore_eos=True,
                detokenize=False,
                logprobs=spec.get("logprobs", 2),
            )
            for n in batch["max_tokens"]
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        batches.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [
                    [
                        {str(t): lp.logprob for t, lp in step.items()}
                        for step in o.outputs[0].logprobs
                    ]
                    for o in outs
                ],
            }
        )
    t2 = time.time()
    from mono_ext.engines.vllm.plugin import loads
    from mono_ext.engines.vllm.report import worker_report

    cfg = llm.llm_engine.vllm_config
    out = {
        "batches": batches,
        "reports": llm.collective_rpc(worker_report),
        "front": {
            "pid": os.getpid(),
            "plugin_loads": loads(),
            "config_hash": cfg.compute_hash(),
            "additional_config": cfg.additional_config,
            "model_class_overrides": dict(cfg.model_config.model_class_overrides or {}),
        },
        "seconds": {"init": t1 - t0, "generate": t2 - t1},
    }
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:3])
