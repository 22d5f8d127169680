"""The Triton backend's served widths come from committed results, and say so.

``models/qwen3_next/triton/measured.py`` lists, per engine and device, the widths served by default; here
each entry is recomputed from the result file it names: a width is served exactly when the
run measured it and its TPOT with mono_ext was below stock's at every layer count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mono_ext.core.backends import served_source, served_widths
from mono_ext.models.qwen3_next.triton.backend import TritonBuilder
from mono_ext.models.qwen3_next.triton.measured import FASTER, measured_faster

REPO = Path(__file__).resolve().parents[4]
SPEC = tuple(range(1, 17))


def _faster_in(result: Path) -> tuple[str, str, set[str], frozenset[int]]:
    data = json.loads(result.read_text())
    rows = {(r["arm"], r["batch"]): r for r in data["summary"]["tpot"]}
    layers = sorted(
        int(k.removeprefix("tpot_L").removesuffix("_ms"))
        for k in next(iter(rows.values()))
        if k.startswith("tpot_L") and k != "tpot_L48_ms"
    )
    assert len(layers) >= 2, layers
    faster = set()
    for arm, batch in rows:
        if arm != "on":
            continue
        on, off = rows["on", batch], rows["off", batch]
        if all(on[f"tpot_L{n}_ms"] < off[f"tpot_L{n}_ms"] for n in layers):
            faster.add(batch)
    # e2e_sglang runs unquantized dummy weights only, so its args have no formats
    formats = data["meta"]["args"].get("formats", "bf16")
    engines = {e for e in ("vllm", "sglang") if e in data["meta"]["versions"]}
    return data["meta"]["device"], formats, engines, frozenset(faster)


@pytest.mark.parametrize("entry", sorted(FASTER))
def test_each_entry_is_what_its_result_file_shows(entry):
    widths, source = FASTER[entry]
    path = REPO / source.split(" ")[0]
    device, formats, engines, faster = _faster_in(path)
    assert engines == {entry[0]}, f"{path}: a run of {sorted(engines)}, listed for {entry[0]}"
    assert device == entry[1]
    assert formats == entry[2], f"{path}: measured with {formats} planes, listed for {entry[2]}"
    assert widths == faster, f"{path}: faster at {sorted(faster)}, listed {sorted(widths)}"


def test_vllm_on_an_h200_serves_what_its_result_file_shows_and_says_why_not():
    widths, why = served_widths(
        SPEC, TritonBuilder(), "triton", False, engine="vllm", device="NVIDIA H200"
    )
    listed = FASTER["vllm", "NVIDIA H200", "bf16"][0]
    assert widths == tuple(w for w in SPEC if w in listed)
    if not widths:  # measured, none faster: stock runs, and the log says why
        assert "serves no width" in why and "NVIDIA H200" in why
    else:
        assert why is None


@pytest.mark.parametrize(
    "engine,device", [("sglang", "NVIDIA H200"), ("vllm", "NVIDIA A100-SXM4-80GB"), ("vllm", None)]
)
def test_an_unmeasured_engine_or_device_serves_nothing_and_says_where_to_look(engine, device):
    widths, why = served_widths(
        SPEC, TritonBuilder(), "triton", False, engine=engine, device=device
    )
    assert widths == ()
    assert "serves no width" in why and "MONO_EXT_SERVE_UNMEASURED=1" in why
    assert str(device or "this machine") in why
    assert served_widths(SPEC, TritonBuilder(), "triton", True, engine=engine, device=device) == (
        SPEC,
        None,
    )


@pytest.mark.parametrize(
    "engine,result", [("vllm", "e2e_vllm_h100.json"), ("sglang", "e2e_sglang_h100.json")]
)
def test_each_engine_on_an_h100_was_measured_and_serves_no_width(engine, result):
    """Each engine's H100 run measured no batch faster at both of its layer counts: stock
    runs there, the log names the engine and the device, and the source is that engine's H100
    result, not the H200 one or the other engine's."""
    device = "NVIDIA H100 80GB HBM3"
    widths, why = served_widths(SPEC, TritonBuilder(), "triton", False, engine=engine,
                                device=device)  # fmt: skip
    assert widths == () and "serves no width" in why and f"with {engine} on {device}" in why
    assert served_source(TritonBuilder(), engine, device).startswith(f"docs/results/{result}")


def test_an_fp8_checkpoint_serves_nothing_a_bf16_run_measured():
    """K2 on fp8 planes is slower than vLLM's own fp8 tail (docs/results/k2_vllm_fp8.csv): the
    bf16 entry must not route an fp8 deployment, and the reason names the weights."""
    widths, why = served_widths(SPEC, TritonBuilder(), "triton", False, engine="vllm",
                                device="NVIDIA H200", quantization="fp8")  # fmt: skip
    assert widths == () and "(fp8 weights)" in why and "serves no width" in why


def test_measured_faster_names_its_source():
    widths, source = measured_faster("vllm", "NVIDIA H200")
    assert widths == FASTER["vllm", "NVIDIA H200", "bf16"][0]
    assert source.startswith("docs/results/e2e_vllm.json")
    assert measured_faster("vllm", "NVIDIA A100-SXM4-80GB") == (frozenset(), None)
