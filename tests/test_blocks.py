"""Finding the blocks: ModuleList, Sequential and ModuleDict stacks, and the one
override (`blocks="layers"`) that tp, pp, recomputation and fsdp all use."""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_one_process, make_spec
from workers import TitanStyle, many_engine_runs

import meshfit as mf
from meshfit.parallel.blocks import find_blocks, use_blocks


def test_the_guess_is_the_largest_same_type_stack_and_the_override_wins() -> None:
    model = TitanStyle()
    assert find_blocks(model).name == "stem"  # six Linears beat four blocks
    use_blocks(model, "layers")
    stack = find_blocks(model)
    assert (stack.name, stack.keys) == ("layers", ["0", "1", "2", "3"])
    assert find_blocks(TitanStyle()).name == "stem"  # per model, not global


def test_a_module_dict_of_blocks_is_found() -> None:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(3)})
    assert find_blocks(model).name == "layers"


def test_a_wrong_override_names_the_containers_there_are() -> None:
    with pytest.raises(mf.MeshfitError, match=r"blocks='head' is a Linear.*stem, layers"):
        use_blocks(TitanStyle(), "head")
    with pytest.raises(mf.MeshfitError, match=r"blocks='nope' is not in the model"):
        mf.parallelize(TitanStyle(), loss_fn=torch.nn.functional.cross_entropy, blocks="nope")


def test_one_blocks_override_serves_tp_pp_fsdp_and_recomputation() -> None:
    named = {"blocks": "layers"}
    plans = ("tp=2", "pp=2", "fsdp=2", "dp=2,checkpointing=full")
    specs = [make_spec("titan", plan, options=named) for plan in plans]
    results = mf.launch(many_engine_runs, nproc=2, args=(specs,))
    check_against_one_process(specs, results)
    # fsdp shards each named block as its own unit (plus the root)
    assert results[2]["fsdp_units"] == 5
