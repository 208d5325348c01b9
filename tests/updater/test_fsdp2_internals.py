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


def _refusals() -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from leto_lightning.errors import LetoError
    from leto_lightning.retained.config import RetainedConfig
    from leto_lightning.updater.fsdp2 import create_fsdp2

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    messages = []
    try:
        def attempt(optimizer_of, shard_head: bool = True, step_first: bool = False) -> None:
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
            fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
            if shard_head:
                fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            optimizer = optimizer_of(model.parameters())
            if step_first:
                model(torch.ones(1, 3)).sum().backward()
                optimizer.step()
            try:
                create_fsdp2(model, optimizer, RetainedConfig(page_bytes=64), job_id="never", rank=0)
                messages.append("accepted")
            except LetoError as exc:  # refused before any store exists
                messages.append(f"{type(exc).__name__}: {exc}")

        attempt(torch.optim.Adagrad)
        attempt(torch.optim.AdamW, step_first=True)
        attempt(torch.optim.AdamW, shard_head=False)
        from torch.distributed.fsdp import FullyShardedDataParallel
        fsdp1 = FullyShardedDataParallel(torch.nn.Linear(3, 4), device_id=torch.device("cpu"))
        try:
            create_fsdp2(fsdp1, torch.optim.AdamW(fsdp1.parameters()), RetainedConfig(page_bytes=64), job_id="never",
                         rank=0)
            messages.append("accepted")
        except LetoError as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
    return messages


def test_unsupported_inputs_refused_with_the_fix():
    result = run_in_child(_refusals, timeout=60)
    assert result.exit_code == 0, result
    adagrad, stepped, unsharded, fsdp1 = result.value
    assert fsdp1.startswith("ConfigurationError:") and "FSDP1" in fsdp1 and "fully_shard" in fsdp1, fsdp1
    assert adagrad.startswith("ConfigurationError: Adagrad:") and "SGD, Adam and AdamW" in adagrad
    assert stepped.startswith("UsageError:") and "before the optimizer's first step" in stepped
    assert unsharded.startswith("ConfigurationError: param 1.weight") and "not sharded by fully_shard" in unsharded


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0+cpu", "3.0.0"])
def test_untested_torch_refused_naming_the_range(version):
    with pytest.raises(FSDP2InternalsError, match=r"torch >=2\.13,<2\.14"):
        check_torch_version(version)


def test_installed_torch_is_in_the_tested_range():
    check_torch_version()


def test_dcp_calls_the_optimizers_own_load_state_dict():
    """``set_state_dict`` / ``set_optimizer_state_dict`` must call the bound optimizer's instance
    ``load_state_dict`` (updater.fsdp2_state copies into the retained views there); if torch's
    DCP started calling the class's, loads would bypass the retained store."""
    import torch
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    optimizer.load_state_dict = lambda state_dict: None  # type: ignore[method-assign]  # as the binding does
    resolve = getattr(dcp_state_dict, "_state_dict_fn", None)
    assert resolve is not None, "torch's DCP state_dict._state_dict_fn moved (adapt updater/fsdp2_state)"
    assert resolve(optimizer, "load_state_dict") is optimizer.load_state_dict
    assert resolve(optimizer, "state_dict") == optimizer.state_dict
