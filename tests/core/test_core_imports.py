"""The core must import on a CPU-only box with no torch, triton or engine at all."""

import subprocess
import sys
import textwrap


def test_core_imports_with_torch_and_triton_unimportable():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'triton', 'vllm', 'sglang', 'flydsl'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import mono_ext.core as core
        import mono_ext.models.qwen3_next.spec as spec
        from mono_ext.models.qwen3_next.configs import get_preset
        reg = core.get_registry()
        assert 'qwen3_next' in reg.specs, reg.specs
        ok, why = reg.backends['reference'].probe()
        assert not ok and 'torch' in why, why
        cfg = core.ConfigView(get_preset('qwen3-next-80b-a3b'), tp_size=4)
        assert not spec.Qwen3NextSpec().refuse_config(cfg)
        print('OK', sorted(m for m in sys.modules if m.startswith(('torch', 'triton'))))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK []"
