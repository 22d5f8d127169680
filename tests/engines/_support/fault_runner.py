"""One vLLM engine whose device waits are made to give up mid-decode (FailStop, end to end).

Usage: python fault_runner.py SPEC.json OUT.json

SPEC: {"llm": {LLM keyword arguments}, "prompts": [[token ids], ...], "max_tokens": n,
"healthy_steps": k}. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

1. A reference pass: every prompt generated greedily to ``max_tokens`` with nothing injected.
2. The same prompts again, one engine step at a time (``LLMEngine.step``), every token each
   request has received recorded after each step. After ``healthy_steps`` steps the worker
   sets every mono_ext runtime's wait deadline (``CTRL_DEADLINE_NS`` in the device control
   block, on the step's stream) to 1 ns: from the next step the kernels run on, each wait that
   does not find its data at the first poll gives up and records itself in the health block,
   as a stalled wait does when its deadline passes. Stepping goes on until the engine raises.

OUT: the reference tokens, the tokens each request had received when stepping stopped (the
last successful step's cumulative outputs), the step count, the error's type and text, and
the seconds from the injection to the error; the worker report taken before the injection.
"""

from __future__ import annotations

import json
import sys
import time


def _shrink_deadlines(worker) -> int:
    """In the worker: every mono_ext runtime's deadline to 1 ns; returns how many."""
    import torch

    from mono_ext.engines.vllm.report import _unwrap
    from mono_ext.runtime.health import CTRL_DEADLINE_NS

    mono = _unwrap(worker.model_runner.model).mono
    runtimes = {id(x.runtime): x.runtime for x in mono.driver.launches.values()}
    with torch.inference_mode():  # the control block was made under vLLM's inference mode
        for rt in runtimes.values():
            rt.state.ctrl[CTRL_DEADLINE_NS : CTRL_DEADLINE_NS + 1].fill_(1)
    return len(runtimes)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mono_ext.engines.vllm.report import worker_report

    llm = LLM(**spec["llm"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def params() -> SamplingParams:  # fresh each time: LLM.generate sets its output kind
        return SamplingParams(
            temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False
        )

    reference = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params())]

    engine = llm.llm_engine
    ids = [f"fault-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params())
    got: dict[str, list[int]] = {}
    steps, injected_at, error, kind = 0, None, None, None
    report = None
    try:
        while engine.has_unfinished_requests():
            if steps == spec["healthy_steps"]:
                report = llm.collective_rpc(worker_report)[0]
                assert llm.collective_rpc(_shrink_deadlines)[0] >= 1
                injected_at = time.time()
            for o in engine.step():
                got[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
    except Exception as e:  # the engine stops: what it said, and when
        kind, error = type(e).__name__, str(e)
        cause = e.__cause__ or e.__context__
        while cause is not None:
            error += f"\ncaused by {type(cause).__name__}: {cause}"
            cause = cause.__cause__ or cause.__context__
    stopped = time.time()
    out = {
        "reference": reference,
        # vLLM may suffix the ids it was given: match each request by its own prefix
        "received": [
            next((v for k, v in got.items() if k == rid or k.startswith(rid + "-")), [])
            for rid in ids
        ],
        "request_ids": sorted(got),
        "steps": steps,
        "error_type": kind,
        "error": error,
        "seconds_to_stop": None if injected_at is None else stopped - injected_at,
        "report": report,
    }
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:3])
