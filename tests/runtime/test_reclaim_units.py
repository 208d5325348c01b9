"""The memory probe on real processes and real shared memory, and the reclaim state machine."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from leto_lightning import new_job_id
from leto_lightning.errors import ConfigurationError
from leto_lightning.retained.shm import (
    SharedSegment,
    segment_name,
    unlink_segments,
)
from leto_lightning.runtime import reclaim
from leto_lightning.runtime.memory import (
    MemoryBudget,
    MemoryProbe,
    MemorySample,
    NvmlDevices,
    meminfo,
    parse_size,
    private_bytes,
    segment_bytes,
)
from leto_lightning.runtime.reclaim import (
    LevelChange,
    ReclaimConfig,
    ReclaimPolicy,
    ShadowLevel,
)

MIB = 1 << 20


def test_sizes_and_their_errors() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512 MiB") == 512 * MIB and parse_size("1.5GB") == 1.5e9
    assert parse_size("4096") == 4096
    for bad in ("", "two GiB", "2GiBs", "-1GiB", "0"):
        with pytest.raises(ConfigurationError, match="--memory-budget"):
            parse_size(bad)
    assert reclaim.watermark("10%", "--reclaim-low") == pytest.approx(0.10)
    with pytest.raises(ConfigurationError, match="between 0% and 100%"):
        reclaim.watermark("150%", "--reclaim-low")
    with pytest.raises(ConfigurationError, match="low watermark"):
        ReclaimConfig(low=0.3, high=0.2)
    with pytest.raises(ConfigurationError, match="dwell_s"):
        ReclaimConfig(dwell_s=-1)
    with pytest.raises(ConfigurationError, match="node_bytes"):
        MemoryBudget(node_bytes=0)


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    reclaim.add_arguments(p)
    return p.parse_args([a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", v)])


def test_options_turn_the_policy_on_only_with_a_budget_or_on_request() -> None:
    assert reclaim.config_from_args(_args()) is None
    assert reclaim.config_from_args(_args(memory_reclaim="off")) is None
    on = reclaim.config_from_args(_args(memory_budget="2GiB", reclaim_low="256MiB"))
    assert on.enabled and on.budget.node_bytes == 2 << 30 and on.low == 256 * MIB and on.high == pytest.approx(0.25)
    off = reclaim.config_from_args(_args(memory_budget="2GiB", memory_reclaim="off"))
    assert not off.enabled and off.budget.node_bytes == 2 << 30
    assert reclaim.config_from_args(_args(memory_reclaim="on")).budget == MemoryBudget()
    with pytest.raises(ConfigurationError, match="--device-memory-budget 'lots'"):
        reclaim.config_from_args(_args(device_memory_budget="lots"))


def test_private_memory_of_a_real_process_and_shared_memory_counted_once() -> None:
    job = new_job_id()
    seg = SharedSegment.create(segment_name(job, "r0", "data"), 32 * MIB)
    (r, w), (r2, w2) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # child: 64 MiB private, every page written; then it maps and writes the shared segment
        try:
            block = bytearray(64 * MIB)
            block[::4096] = b"\1" * (64 * MIB // 4096)
            os.write(w, b"a")
            os.read(r2, 1)
            peer = SharedSegment.attach(seg.name)
            peer.tensor.fill_(7)
            os.write(w, b"b")
            signal.pause()
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"a"
        before = private_bytes(pid)
        assert before >= 64 * MIB, before  # RssAnon: the private block (and what the fork shares with us)
        os.write(w2, b"g")
        assert os.read(r, 1) == b"b"
        after = private_bytes(pid)
        assert after - before < 8 * MIB, (before, after)  # the 32 MiB it wrote in shared memory: not private
        assert segment_bytes(seg.name) == 32 * MIB  # written pages of the segment, once, where it lives
        probe = MemoryProbe(MemoryBudget(node_bytes=1 << 30), lambda: [pid], lambda: [job], gpus=False)
        s = probe.sample()
        assert s.source == "budget" and s.retained == 32 * MIB and abs(s.processes[pid] - after) < 4 * MIB
        assert s.used == s.processes[pid] + 32 * MIB and s.free == (1 << 30) - s.used
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (r, w, r2, w2):
            os.close(fd)
        seg.close()
        unlink_segments(job)
    assert private_bytes(pid) == 0  # gone: nothing to count


def test_host_figures_without_a_budget_and_no_nvml_is_not_an_error() -> None:
    total, available = meminfo()
    assert 0 < available <= total
    s = MemoryProbe(MemoryBudget(), lambda: [os.getpid()], list, gpus=True).sample()
    assert s.source in ("cgroup", "meminfo") and 0 < s.used < s.limit
    nvml = NvmlDevices()
    if not nvml.available:  # this machine: no pynvml or no NVIDIA device -- no GPU figures
        assert nvml.read(None, set()) == ()
    nvml.close()


def _sample(free_mib: int, limit_mib: int = 1000) -> MemorySample:
    return MemorySample("budget", limit_mib * MIB, (limit_mib - free_mib) * MIB, {}, 0)


def test_policy_demotes_step_by_step_with_dwell_and_does_not_flap_in_the_band() -> None:
    cfg = ReclaimConfig(low=0.10, high=0.25, dwell_s=2.0, promote_after_s=10.0)
    p = ReclaimPolicy(cfg, ShadowLevel.L3, now=0.0)
    assert p.decide(_sample(50), 1.0) is None  # within the dwell after start
    change = p.decide(_sample(50), 2.5)
    assert change == LevelChange(ShadowLevel.L3, ShadowLevel.L2, change.reason) and "low watermark" in change.reason
    assert p.decide(_sample(50), 3.0) is None  # dwell again
    assert p.decide(_sample(50), 4.6).new == ShadowLevel.L1
    assert p.decide(_sample(50), 7.0).new == ShadowLevel.NONE  # even L1 does not fit: no shadow
    assert p.decide(_sample(50), 10.0) is None  # nothing lower
    for t in range(11, 60):  # between the watermarks: stays
        assert p.decide(_sample(150 + t % 2 * 80), float(t)) is None
    assert p.level == ShadowLevel.NONE


def test_policy_promotes_after_free_long_enough_up_to_the_launch_level_if_it_fits() -> None:
    cfg = ReclaimConfig(low=0.10, high=0.25, dwell_s=1.0, promote_after_s=5.0)
    p = ReclaimPolicy(cfg, ShadowLevel.L2, now=0.0)
    assert p.decide(_sample(50), 2.0).new == ShadowLevel.L1
    p.observe_shadow(ShadowLevel.L1, 100 * MIB)
    assert p.decide(_sample(400), 3.0) is None  # free, but not for long enough
    assert p.decide(_sample(200), 5.0) is None  # dipped into the band: the clock restarts
    assert p.decide(_sample(400), 6.0) is None
    assert p.decide(_sample(400), 10.9) is None
    assert p.decide(_sample(400), 11.1).new == ShadowLevel.L2
    p.observe_shadow(ShadowLevel.L2, 100 * MIB)
    assert all(p.decide(_sample(900), t) is None for t in (20.0, 40.0))  # never above --shadow-level
    q = ReclaimPolicy(cfg, ShadowLevel.L3, now=0.0)
    q.observe_shadow(ShadowLevel.L3, 500 * MIB)
    assert q.decide(_sample(50), 2.0).new == ShadowLevel.L2
    q.observe_shadow(ShadowLevel.L2, 100 * MIB)
    assert all(q.decide(_sample(600), t) is None for t in (3.0, 10.0, 30.0))  # L3 again: 600-400 < high
    assert q.decide(_sample(700), 31.0).new == ShadowLevel.L3  # free above high all along: fits now


def test_multi_node_jobs_refuse_a_memory_budget_before_anything_starts(tmp_path) -> None:
    from leto_lightning.runtime.agent import Agent, LaunchSpec

    spec = LaunchSpec(script=__file__, args=[], nnodes=2, node_rank=0, master_port=29999,
                      run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigurationError, match="only single-node"):
        Agent(spec, reclaim=ReclaimConfig())
    assert not (tmp_path / "run").exists()  # refused before the run dir was claimed
