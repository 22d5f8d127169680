"""The Triton build digest covers every file the K1/K2 builds compile from (CPU, no Triton).

A build key's digest is what says two builds are the same code, so a file of jitted device code
left out of it would let an edited kernel keep an old digest.
"""

from pathlib import Path

from mono_ext.models.qwen3_next.triton.backend import device_sources
from mono_ext.runtime.build_cache import source_digest

SRC = Path(__file__).resolve().parents[4] / "src" / "mono_ext"


def jitted_files() -> set[Path]:
    folders = (SRC / "models" / "qwen3_next" / "triton", SRC / "kernels" / "triton")
    return {p.resolve() for d in folders for p in d.glob("*.py") if "@triton.jit" in p.read_text()}


def test_every_jitted_file_and_host_launcher_is_a_source():
    sources = set(device_sources())
    assert all(p.is_file() for p in sources), [str(p) for p in sources if not p.is_file()]
    jitted = jitted_files()
    assert len(jitted) >= 5, "the scan found too few jitted files to mean anything"
    missing = sorted(str(p) for p in jitted - sources)
    assert not missing, f"jitted files the build digest does not hash: {missing}"
    model = SRC / "models" / "qwen3_next" / "triton"
    assert {model / "k1.py", model / "k2.py"} <= sources  # they choose the constexprs


def test_digest_changes_with_any_source(tmp_path):
    copies = []
    for i, src in enumerate(device_sources()):
        dst = tmp_path / f"{i}_{src.name}"
        dst.write_bytes(src.read_bytes())
        copies.append(dst)
    before = source_digest(copies)
    for dst in copies:
        text = dst.read_bytes()
        dst.write_bytes(text + b"\n# edited\n")
        assert source_digest(copies) != before, f"{dst.name} does not move the digest"
        dst.write_bytes(text)
    assert source_digest(copies) == before
