import pytest

from mono_ext.cli import EXIT_USAGE, main


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "qwen3.5-moe-tiny-b"])
def test_demo_agrees_with_stock_layer_math(preset, capsys):
    assert main(["demo", "--preset", preset, "--steps", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "-> AGREE" in out and "greedy tokens 6/6 equal" in out


def test_demo_bad_arguments(capsys):
    assert main(["demo", "--batch", "17"]) == EXIT_USAGE
    assert "--batch must be 1..16" in capsys.readouterr().err
    assert main(["demo", "--preset", "llama"]) == EXIT_USAGE
    assert "unknown preset 'llama'" in capsys.readouterr().err
