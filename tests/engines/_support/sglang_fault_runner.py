"""One SGLang 0.5.17 engine whose mono_ext device waits are made to give up mid-decode.

Usage: python sglang_fault_runner.py SPEC.json OUT.json

SPEC (:func:`sglang_fault.runner_spec`): Engine keyword arguments (with the
``sglang_fault_hook`` forward-hook factory), prompts, ``max_tokens``, and the paths of the
hook's arm file and record and of the stream log.

1. A reference pass: every prompt generated greedily to ``max_tokens``, nothing injected; the
   tokens go to OUT at once (the engine may take this process down later).
2. The arm file is created, then the same prompts are streamed, one ``Engine.generate(...,
   stream=True)`` per request, all submitted before the first chunk is read and then read
   round robin; after every chunk the tokens each request has received so far are rewritten
   to the stream log. The hook cuts the deadlines after its healthy steps; the scheduler then
   raises FailStopError and dies, and SGLang's SIGQUIT handler ends this process too (or the
   generators raise): either way the stream log holds what reached each request.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def _dump(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import sglang

    engine = sglang.Engine(**spec["engine"])
    n = spec["max_tokens"]

    def params():
        return dict(temperature=0.0, max_new_tokens=n, ignore_eos=True)

    outs = engine.generate(
        input_ids=spec["prompts"], sampling_params=[params()] * len(spec["prompts"])
    )
    out = {"reference": [list(o["output_ids"]) for o in outs], "stream_error": None}
    _dump(out_path, out)

    open(spec["arm"], "w").close()
    received = [[] for _ in spec["prompts"]]
    log = {"received": received, "chunks": 0, "t": time.time()}
    _dump(spec["stream_log"], log)
    gens = [
        engine.generate(input_ids=p, sampling_params=params(), stream=True) for p in spec["prompts"]
    ]
    live = list(range(len(gens)))
    try:
        while live:
            for i in list(live):
                try:
                    chunk = next(gens[i])
                except StopIteration:
                    live.remove(i)
                    continue
                ids = chunk.get("output_ids") or []
                # non-incremental streaming: each chunk carries the request's tokens so far
                received[i] = list(ids) if len(ids) >= len(received[i]) else received[i] + list(ids)
                log.update(chunks=log["chunks"] + 1, t=time.time())
                _dump(spec["stream_log"], log)
    except BaseException as e:  # the engine stopped: what the client saw
        out["stream_error"] = f"{type(e).__name__}: {e}"
    out["stream_finished_at"] = time.time()
    _dump(out_path, out)
    with contextlib.suppress(Exception):
        engine.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
