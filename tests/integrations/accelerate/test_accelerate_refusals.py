"""Bad input fails before training, with one line naming the value and the fix: options, the
Accelerate features Leto cannot protect, a ``leto:`` key in an Accelerate config, ``-m``."""

from __future__ import annotations

import os
import sys

import pytest
from acc_job import CONFIG, QUIET, free_port, run

from leto_lightning.errors import ConfigurationError, UsageError


def test_bad_options_name_the_value_and_the_fix(monkeypatch) -> None:
    from leto_lightning.accelerate import LetoConfig

    with pytest.raises(ConfigurationError, match=r"^tier1_parity=9 exceeds data_pages=8: .* lower tier1_parity or "
                                                 r"raise data_pages$"):
        LetoConfig(tier1_parity=9)
    with pytest.raises(ConfigurationError, match=r"shadow_level=5: choose 1, 2 or 3"):
        LetoConfig(shadow_level=5)
    with pytest.raises(ConfigurationError, match="rollback_window='yes'"):
        LetoConfig(rollback_window="yes")
    monkeypatch.setenv("LETO_DATA_PAGES", "2")
    with pytest.raises(ConfigurationError, match="tier1_parity=3 exceeds data_pages=2"):
        LetoConfig(tier1_parity=3).with_environment()  # the environment wins, and is validated
    monkeypatch.setenv("LETO_DATA_PAGES", "many")
    with pytest.raises(ConfigurationError, match=r"LETO_DATA_PAGES='many': expected int"):
        LetoConfig().with_environment()
    monkeypatch.setenv("LETO_DATA_PAGES", "4")
    assert LetoConfig().with_environment().retained_config().data_pages == 4


def test_what_leto_cannot_protect_is_refused_at_construction(monkeypatch) -> None:
    """Checked before Accelerate's own set-up: no process group, no state touched."""
    from accelerate.utils import DistributedDataParallelKwargs

    from leto_lightning.accelerate import LetoAccelerator

    with pytest.raises(ConfigurationError, match=r"gradient_as_bucket_view=True.*leave gradient_as_bucket_view=False"):
        LetoAccelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    with pytest.raises(ConfigurationError, match=r"LetoAccelerator\(fsdp_plugin=<object .*\): not a "
                                                 r"FullyShardedDataParallelPlugin -- use .*fsdp_version=2"):
        LetoAccelerator(fsdp_plugin=object())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # FSDP1: Accelerate's default version (FSDP2: sharded/)
    with pytest.raises(ConfigurationError, match=r"^ACCELERATE_USE_FSDP=true with FSDP_VERSION=1 \(an Accelerate "
                                                 r"config with FSDP1\): .*fsdp_version: 2"):
        LetoAccelerator()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    for var, name in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                      ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")):  # what `accelerate launch` sets from a config
        monkeypatch.setenv(var, "true")
        with pytest.raises(ConfigurationError, match=rf"^{var}=true \(an Accelerate config with {name}\): .* use plain "
                                                     r"data parallelism"):
            LetoAccelerator()
        monkeypatch.delenv(var)
    with pytest.raises(ConfigurationError, match=r"leto=\{'tier1_parity': 1\}: pass leto=LetoConfig"):
        LetoAccelerator(leto={"tier1_parity": 1})


def test_torchrun_worker_without_a_script_file_is_refused(monkeypatch) -> None:
    """A worker of ``accelerate launch -m ...`` (here: pytest, no script file) cannot be re-run
    by its agent: refused, naming the command to use."""
    from leto_lightning.accelerate import LetoAccelerator

    for key, value in dict(TORCHELASTIC_RUN_ID="none", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                           LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                           TORCHELASTIC_USE_AGENT_STORE="True", ACCELERATE_MIXED_PRECISION="no").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LETO_ROLE", raising=False)
    with pytest.raises(UsageError, match=r"under accelerate: .*start it as `accelerate launch --config_file "
                                         r"configs/accelerate/leto.yaml train.py` \(not with -m or --no_python\)"):
        LetoAccelerator()


def test_accelerate_launch_refuses_a_leto_section_and_dash_m(tmp_path) -> None:
    """Real ``accelerate launch``: a config with a ``leto:`` section fails in Accelerate's own check
    (it names the key); ``-m`` fails in every worker at ``LetoAccelerator(...)``, before training."""
    config = tmp_path / "bad.yaml"
    config.write_text(CONFIG.read_text() + "leto:\n  tier1_parity: 2\n")
    from acc_job import SCRIPT

    bad = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(SCRIPT)], tmp_path,
              timeout=120)
    assert bad.returncode != 0 and "unknown keys (['leto'])" in bad.stdout, bad.stdout[-3000:]
    env = dict(QUIET, PYTHONPATH=os.pathsep.join(sys.path))
    module = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                  "--main_process_port", str(free_port()), "-m", "leto_lightning.examples.accelerate_train"],
                 tmp_path, env=env, timeout=180)
    assert module.returncode != 0
    assert "(not with -m or --no_python)" in module.stdout, module.stdout[-3000:]
    assert not (tmp_path / "leto-runs").exists() and not list(tmp_path.rglob("*.pt"))  # nothing trained
