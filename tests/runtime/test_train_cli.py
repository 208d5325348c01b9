"""`leto train` argument handling (the training itself is exercised by the Lightning tests)."""

from leto_lightning.cli import main
from leto_lightning.faults import hof_faults


def test_unknown_override_is_named(capsys):
    assert main(["train", "olmoe", "trainer.max_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.max_stepz" in err and "max_steps" in err


def test_full_size_refused_on_cpu_with_a_pointer(capsys, tmp_path):
    assert main(["train", "kimi_moe", "size=full", "--run-dir", str(tmp_path)]) == 2  # a ConfigurationError
    err = capsys.readouterr().err
    assert "tp=4" in err and "size=tiny" in err


def test_hof_schedule_alternates_ranks_and_waits_for_shadows():
    faults = hof_faults(10, "update", 100, 2, seed=0)
    assert [f["iteration"] for f in faults] == list(range(10, 100, 10))
    assert [f["rank"] for f in faults[:4]] == [0, 1, 0, 1]
    assert all(f["wait_shadows"] and f["point"].startswith("chunk.") for f in faults)
    assert hof_faults(0, "compute", 100, 2, seed=0) == []
