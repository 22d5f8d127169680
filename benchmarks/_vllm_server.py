"""vLLM's OpenAI server as ``e2e_vllm.py``'s server entries run it: one
``vllm.entrypoints.openai.api_server`` subprocess per arm, a stdlib streaming client on
``/v1/completions`` with token-id prompts (TPOT per request from its chunk times), then vLLM's
own ``vllm bench serve`` against the same server (``_vllm_tools.bench_serve``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _e2e_runner as runner
from _vllm_tools import bench_serve


def tpot_from_chunks(times: list[float], counts: list[int]) -> float | None:
    """Client TPOT of one streamed request: (last chunk - first chunk) / tokens after the
    first chunk; None with fewer than two tokens."""
    if not times or sum(counts) - counts[0] <= 0:
        return None
    return (times[-1] - times[0]) / (sum(counts) - counts[0])


class _Server:
    """One api_server subprocess in its own process group (ended through that group)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, port: int) -> None:
        self.port, self.log = port, log
        self.fh = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            env=env,
            stdout=self.fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> None:
        import urllib.request

        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited rc {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1.0)
        raise TimeoutError(f"server not ready in {timeout}s: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.fh.flush()
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.fh.close()


def stream_request(port: int, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed /v1/completions request (stdlib); chunk arrival times and token counts."""
    import http.client

    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    times, counts = [], []
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        msg = json.loads(data)
        n = sum(len(c.get("token_ids") or []) for c in msg.get("choices", []))
        if n:
            times.append(time.perf_counter())
            counts.append(n)
    conn.close()
    return {
        "ttft_s": times[0] - t0 if times else None,
        "tpot_s": tpot_from_chunks(times, counts),
        "tokens": sum(counts),
    }


def client_run(
    port: int, model: str, prompts: list[list[int]], conc: int, rounds: int, tokens: int
) -> list[dict[str, Any]]:
    """``conc`` threads, each sending ``rounds`` requests one after another."""
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            for r in range(rounds):
                res = stream_request(port, model, prompts[(i + r * conc) % len(prompts)], tokens)
                with lock:
                    results.append(res)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def worker_server(spec: dict[str, Any]) -> dict[str, Any]:
    port = _free_port()
    args = spec["server_args"] + ["--port", str(port), "--host", "127.0.0.1"]
    env = {**os.environ, **spec["env"]}
    runner.announce_arm(spec, f"--monokernel-backend {spec['backend']}", "server arm")
    srv = _Server(args, env, Path(spec["log"]), port)
    t0 = time.time()
    try:
        srv.wait_ready(spec["ready_timeout_s"])
        up = runner.up_since(t0, spec, "server")
        model = spec["model"]
        out: dict[str, Any] = {"conc": {}, "seconds": {"up": up}}
        for c in spec["conc"]:
            client_run(port, model, spec["prompts"], c, 1, 8)  # warm-up at this concurrency
            res = client_run(port, model, spec["prompts"], c, spec["rounds"], spec["tokens"])
            tp = [r["tpot_s"] for r in res if r["tpot_s"] is not None]
            out["conc"][str(c)] = {
                "requests": len(res),
                "tpot_mean_s": statistics.mean(tp) if tp else None,
                "tpot_median_s": statistics.median(tp) if tp else None,
                "ttft_mean_s": statistics.mean(r["ttft_s"] for r in res if r["ttft_s"] is not None),
            }
            print(
                f"[e2e] {spec['id']} conc {c}: TPOT mean "
                f"{out['conc'][str(c)]['tpot_mean_s'] * 1e3:.3f} ms median "
                f"{out['conc'][str(c)]['tpot_median_s'] * 1e3:.3f} ms ({len(res)} requests)",
                flush=True,
            )
            if spec.get("bench_serve"):
                r = bench_serve(spec, port, c, env)
                out.setdefault("bench_serve", {})[str(c)] = r
                print(f"[e2e] {spec['id']} conc {c}: vllm bench serve TPOT mean "
                      f"{r['mean_tpot_ms']:.3f} ms median {r['median_tpot_ms']:.3f} ms",
                      flush=True)  # fmt: skip
        lines = [ln for ln in srv.tail(200000).splitlines() if "mono_ext" in ln]
        out["mono_ext_log"] = lines[-20:]
        out["seconds"]["all"] = time.time() - t0
        return out
    finally:
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
