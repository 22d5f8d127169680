"""The CI sweep: every flydsl launch compiles for gfx950 and passes the limits; one that does
not compile is reported as a failure, not dropped."""

from mono_ext.models.qwen3_next.flydsl import sweep


def test_every_launch_compiles_and_passes(capsys):
    # every build key: K2 (both layer kinds), K1 (both fronts) at every width 1..16
    assert sweep.main(["--jobs", "2", "--all"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "grid" in r]
    assert len(rows) == len(sweep.targets(all_widths=True)) == 5 + 4 * 16
    assert all(r.endswith("| ok |") for r in rows)


def test_a_launch_that_does_not_compile_fails_the_sweep():
    label, rows, reasons, error = sweep.compile_target(("build_allreduce", {"world": 3}))
    assert rows == [] and "world must be 1, 2, 4 or 8" in error
    assert "does not compile" in sweep.table([(label, rows, reasons, error)])
