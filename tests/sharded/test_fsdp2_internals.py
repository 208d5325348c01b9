"""The private FSDP2 attributes the retained binding re-points (updater.fsdp2) are where it
expects them on the installed torch; when one moves, the binding fails naming it.

Runs in a forked child with a one-rank gloo group (a HashStore: no port), so this process never
holds a process group.
"""

from __future__ import annotations

import pytest

from leto_lightning.testing.crash import run_in_child
from leto_lightning.updater.fsdp2 import PRIVATE_ATTRIBUTES, FSDP2InternalsError, check_torch_version


def _inspect_internals() -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from leto_lightning.updater.fsdp2 import fsdp_params, local_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 5)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        found = fsdp_params(model)
        fsdp_param = next(iter(found.values()))
        state = model._get_fsdp_state()
        owners = {"FSDPModule": model, "FSDPState": state, "FSDPParamGroup": state._fsdp_param_groups[0],
                  "FSDPParam": fsdp_param, "DTensor": fsdp_param.sharded_param}
        missing = [f"{owner}.{name}" for owner, name in PRIVATE_ATTRIBUTES if not hasattr(owners[owner], name)]
        shard = local_shard(fsdp_param, "weight")
        del fsdp_param._sharded_param_data  # as if torch renamed it
        try:
            local_shard(fsdp_param, "weight")
            moved = ""
        except FSDP2InternalsError as exc:
            moved = str(exc)
        return {"n_params": len(found), "missing": missing, "padded": shard.padded_shape, "moved": moved}
    finally:
        dist.destroy_process_group()


def test_private_fsdp2_attributes_present_and_a_moved_one_is_named():
    result = run_in_child(_inspect_internals, timeout=60)
    assert result.exit_code == 0 and not result.killed, result
    info = result.value
    assert isinstance(info, dict)
    assert info["missing"] == [], f"FSDP2 internals moved in this torch: {info['missing']} (adapt updater/fsdp2.py)"
    assert info["n_params"] == 2 and info["padded"] == (5, 3)
    assert "FSDPParam._sharded_param_data is missing" in info["moved"], info["moved"]


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0+cpu", "3.0.0"])
def test_untested_torch_refused_naming_the_range(version):
    with pytest.raises(FSDP2InternalsError, match=r"torch >=2\.13,<2\.14"):
        check_torch_version(version)


def test_installed_torch_is_in_the_tested_range():
    check_torch_version()
