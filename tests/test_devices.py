from __future__ import annotations

import pytest

from meshfit import MeshfitError
from meshfit.launch import plan_workers
from meshfit.launch.devices import format_inventory, inventory, parse_device_ids, select_devices


def test_parse_device_ids() -> None:
    assert parse_device_ids("0,2") == [0, 2]
    assert parse_device_ids("all") is None
    assert parse_device_ids("cpu") == []
    with pytest.raises(MeshfitError, match="twice"):
        parse_device_ids("1,1")
    with pytest.raises(MeshfitError, match="GPU indices separated by commas"):
        parse_device_ids("gpu0")


def test_unknown_device_id_lists_the_ones_that_exist(monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(MeshfitError, match=r"no GPU with index 7; the GPUs here are: none"):
        select_devices("7")


def test_selection_maps_through_existing_visibility(monkeypatch) -> None:
    from meshfit.launch import devices

    fake = devices.Inventory(
        cpu_cores=2,
        gpus=tuple(devices.GPU(i, "Fake", 2**30, (9, 0)) for i in range(3)),
        cuda_visible_devices="4,5,6",
    )
    monkeypatch.setattr(devices, "inventory", lambda: fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert select_devices("0,2") == {"CUDA_VISIBLE_DEVICES": "4,6"}
    with pytest.raises(MeshfitError, match="the GPUs here are: 0, 1, 2"):
        select_devices("3")


def test_inventory_lists_the_cpu() -> None:
    rows = format_inventory(inventory())
    assert rows[0][0] == "cpu" and "cores" in rows[0][3]


def test_cpu_workers_get_one_thread_each(monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    setup = plan_workers(None, None, None)
    assert setup.device_kind == "cpu" and setup.threads == 1
    assert setup.env["OMP_NUM_THREADS"] == "1"
    assert plan_workers(3, None, 2).env["OMP_NUM_THREADS"] == "2"
    with pytest.raises(MeshfitError, match="at least 1"):
        plan_workers(0, None, None)


def test_an_apple_gpu_is_listed_with_what_meshfit_does_with_it(monkeypatch) -> None:
    monkeypatch.setattr("torch.backends.mps.is_available", lambda: True)
    inv = inventory()
    assert inv.mps
    rows = format_inventory(inv)
    assert ("mps", "Apple GPU (Metal)", "shared", "found; meshfit trains on the CPU here") in rows
