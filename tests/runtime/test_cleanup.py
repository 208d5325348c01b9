"""``leto cleanup``: refuses memory a process still maps, frees it once nobody does."""

from __future__ import annotations


from leto_lightning import cli
from leto_lightning.faults.scenario import CoreScenario
from leto_lightning.retained.shm import list_segments
from leto_lightning.runtime.cleanup import retained_jobs


def test_cleanup_refuses_mapped_memory_and_frees_it_once_unmapped(capsys) -> None:
    job = CoreScenario(n_ranks=1).create_job()  # this process maps the store
    try:
        info = retained_jobs()[job.job_id]
        assert info.segments and info.nbytes > 0 and info.users
        assert cli.main(["cleanup", "--job", job.job_id]) == 1
        assert "in use by pid" in capsys.readouterr().out
        assert list_segments(f"leto-{job.job_id}-")
        assert cli.main(["cleanup", "--job", job.job_id, "--dry-run", "--force"]) == 0
        assert list_segments(f"leto-{job.job_id}-")  # a dry run frees nothing
        for store in job.stores:
            store.close()
        assert cli.main(["cleanup", "--job", job.job_id]) == 0
        assert "freed" in capsys.readouterr().out
        assert list_segments(f"leto-{job.job_id}-") == []
    finally:
        job.close()


def test_cleanup_needs_a_target(tmp_path, capsys) -> None:
    assert cli.main(["cleanup"]) == 2
    assert cli.main(["cleanup", str(tmp_path)]) == 2  # no events.jsonl there
    assert "no job id" in capsys.readouterr().err
