"""Failure classification and runtime configuration."""

import signal

import pytest

from leto_lightning.runtime.classify import DeviceHealth, Failure, classify, device_health, printed_exception
from leto_lightning.runtime.config import ClassificationRule, RuntimeConfig

OK = DeviceHealth(True, "test: operable")


@pytest.mark.parametrize("failure,hof,needle", [
    (Failure(0, 1, signal=signal.SIGKILL), True, "killed"),
    (Failure(0, 1, signal=signal.SIGSEGV), True, "crashed"),
    (Failure(0, 1, hang=True), True, "hang"),
    (Failure(0, 1, exit_code=1, exception="RuntimeError: CUDA error: an illegal memory access"), True, "contained"),
    (Failure(0, 1, exit_code=1, exception="RuntimeError: the GPU is lost"), False, "device lost"),
    (Failure(0, 1, exit_code=1, exception="ValueError: bad batch"), True, "exception"),
])
def test_default_table(failure, hof, needle):
    verdict = classify(failure, RuntimeConfig(), OK)
    assert verdict.hof is hof and needle in verdict.reason


def test_inoperable_device_is_never_a_hof():
    verdict = classify(Failure(0, 1, signal=signal.SIGKILL), RuntimeConfig(), DeviceHealth(False, "NVML: no answer"))
    assert not verdict.hof and "NVML" in verdict.reason


def test_extra_rules_come_first():
    cfg = RuntimeConfig(extra_rules=(ClassificationRule(False, "exit 43 means Xid 79", exit_code=43),))
    assert not classify(Failure(0, 1, exit_code=43), cfg, OK).hof
    assert classify(Failure(0, 1, exit_code=44), cfg, OK).hof  # unknown: unknown_is_hof


def test_no_nvml_means_cpu_job_not_an_error():
    health = device_health(0)
    assert health.operable  # this machine has no NVIDIA device


@pytest.mark.parametrize("kwargs,needle", [
    (dict(heartbeat_timeout=0), "heartbeat_timeout=0"),
    (dict(max_failures=0), "max_failures=0"),
    (dict(shadow_level=4), "shadow_level=4"),
])
def test_bad_runtime_settings(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RuntimeConfig(**kwargs)


def test_xids_decide_whether_the_device_is_operable():
    """Xid 79 (fell off the bus), 48 (double-bit ECC), 95 (uncontained ECC) need a reset: not a
    HOF whatever the exit; 13 (graphics engine exception) and 94 (contained ECC) leave the device
    usable (docs/design.md section 1)."""
    from leto_lightning.runtime.xid import XidMonitor, xid_verdict

    assert xid_verdict([]) == (True, "no Xid")
    assert xid_verdict([13, 94])[0] is True
    for fatal in (48, 79, 95):
        operable, why = xid_verdict([13, fatal])
        assert not operable and str(fatal) in why
    killed = Failure(rank=0, pid=1, signal=9)
    health = DeviceHealth(*xid_verdict([79]), {"xids": [79]})
    assert classify(killed, RuntimeConfig(), health).hof is False
    monitor = XidMonitor.start()  # this machine: no NVIDIA driver (or no NVML): nothing to drain
    assert monitor.drain() == {}
    monitor.close()


def test_startup_failures_are_told_apart_by_kind_not_text():
    """Issue 25 item 9: a pid or a time in the message does not make another failure; a signal
    is a kind of its own; a SIGKILL (OOM killer, operator, injected fault) and a hang say
    nothing about the script."""
    first = Failure(0, 101, exit_code=1, exception="RuntimeError: data server refused (pid 101, t=1714.2)")
    again = Failure(0, 202, exit_code=1, exception="RuntimeError: data server refused (pid 202, t=1719.8)")
    other = Failure(0, 303, exit_code=1, exception="ValueError: data server refused (pid 303)")
    assert first.kind() == again.kind() == "RuntimeError" != other.kind()
    assert Failure(0, 1, signal=signal.SIGSEGV).kind() == "SIGSEGV"
    assert Failure(0, 1, signal=signal.SIGBUS).kind() == "SIGBUS"
    assert Failure(0, 1, exit_code=2).kind() == "exit code 2"  # argparse: no exception reported
    assert Failure(0, 1, signal=signal.SIGKILL).kind() is None
    assert Failure(0, 1, hang=True).kind() is None
    assert Failure(0, None, exception="on node 1: trainer killed").kind() is None  # another node's


@pytest.mark.parametrize("line,printed", [
    ("RuntimeError: boom (pid 7)", "RuntimeError"),
    ("torch.distributed.DistBackendError: NCCL error", "DistBackendError"),
    ("ModuleNotFoundError: No module named 'nope'", "ModuleNotFoundError"),
    ("KeyboardInterrupt", "KeyboardInterrupt"),
    ("[rank0] iteration 5: loss 2.31", None),
    ("usage: train.py [-h]  train.py: error: argument --dim: invalid int value", None),
])
def test_the_last_line_of_a_traceback_names_the_exception(line, printed):
    found = printed_exception(line)
    assert (Failure(0, 1, exit_code=1, exception=found).exception_type if found else None) == printed


def test_environment_errors_of_a_trainer_stop_the_job():
    """A too small /dev/shm, a link planted in the run dir: every restart would meet them again."""
    for name in ("SharedMemoryCapacityError", "PlantedLinkError"):
        verdict = classify(Failure(0, 1, exit_code=1, exception=f"{name}: ..."), RuntimeConfig(), OK)
        assert verdict.stop and not verdict.hof, verdict
