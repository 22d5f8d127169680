"""benchmarks/_e2e_runner.py's dummy-weight preparation: fp8 planes given codes and block
scales that dequantize like the bf16 dummy planes, the same in every engine, and the scaling
that follows touches the scales, never the codes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("_e2e_runner", _DIR / "_e2e_runner.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


class _Linear(torch.nn.Module):
    def __init__(self, n: int, k: int):
        super().__init__()
        codes = torch.full((n, k), 0.0).to(torch.float8_e4m3fn)  # what dummy loading leaves
        self.weight = torch.nn.Parameter(codes, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(
            torch.full((-(-n // 128), -(-k // 128)), -7e-4), requires_grad=False
        )
        self.norm = torch.nn.Parameter(torch.full((k,), 5e-4), requires_grad=False)


def _model():
    m = torch.nn.Module()
    m.a, m.b = _Linear(256, 384), _Linear(128, 128)
    return m


def test_codes_and_scales_dequantize_like_a_dummy_plane():
    m = _model()
    assert runner.fill_fp8_dummy(m, chunk=1000) == 2  # chunks smaller than a plane
    w = m.a.weight.float()
    assert w.abs().max() <= 1.0 and (w != 0).float().mean() > 0.95
    assert w.mean().abs() < 0.05 and w.std() > 0.5  # uniform in [-1, 1]
    assert torch.all(m.a.weight_scale_inv == runner.FP8_DUMMY_RANGE)
    assert torch.all(m.a.norm == 5e-4)  # not an fp8 plane: left to dummy loading


def test_the_same_names_get_the_same_codes():
    m1, m2 = _model(), _model()
    runner.fill_fp8_dummy(m1)
    runner.fill_fp8_dummy(m2)
    assert torch.equal(m1.a.weight.view(torch.uint8), m2.a.weight.view(torch.uint8))
    assert not torch.equal(m1.a.weight[:128, :128].float(), m1.b.weight.float())


def test_scaling_scales_everything_but_the_codes():
    m = _model()
    runner.fill_fp8_dummy(m)
    codes = m.a.weight.view(torch.uint8).clone()
    assert runner.scale_floating(m, 16.0) == 4  # two scales, two norms
    assert torch.equal(m.a.weight.view(torch.uint8), codes)
    assert torch.allclose(m.a.weight_scale_inv, torch.tensor(16 * runner.FP8_DUMMY_RANGE))


def test_the_word_tokenizer_round_trips_every_id(tmp_path):
    """What vllm bench serve does with it: ids -> text -> the same ids, specials apart."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    import random

    path = runner.write_word_tokenizer(tmp_path / "tok", 151936)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == 151936 and tok.eos_token_id == 1 and tok.unk_token_id == 0
    rng = random.Random(0)
    ids = [rng.randrange(2, 151936) for _ in range(200)] + [2, 151935, 10, 100, 1000]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
