"""torchtitan's way of training a model bigger than one GPU, converted to cudakit.

Ported from torchtitan's trainer (torchtitan/train.py before the config refactor of
#2386) and its Llama 3 (torchtitan/models/llama3/model/model.py), at tiny size:
build under ``torch.device("meta")``, ``fully_shard`` per block then the root,
``to_empty``, ``init_weights()`` under ``no_grad``, AdamW, a warmup ``LambdaLR``,
``clip_grad_norm_`` with ``foreach=True``, the loss rescaled by the accumulation
steps, DCP checkpoints, and the seed checkpoint written by one process. The user's
side is ``cudakit.parallelize(init=...)``, ``autocast_step`` and ``Checkpointer``;
each is compared bit for bit with the hand-written flow where the maths is the same.

cudakit seeds each module's init from ``init_seed`` and the module's name
(docs/big-models.md), so its values are not those of one ``torch.manual_seed``
before ``init_weights()``: they are those of the same init run module by module
under those seeds, at any world size. torchtitan's own values (one seed, one
process) reach every rank through the seed checkpoint, as in torchtitan.
"""

from __future__ import annotations

import math
from typing import Any

import port_titan_model as titan
import pytest
import torch
from torch import nn

import cudakit.parallel as cp

TIMEOUT = 300  # seconds for one launch of every check (a busy 2-core machine)


def _equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _reference_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), "freqs_cis": model.freqs_cis}


# --------------------------------------------------------------------------- the init


def test_titan_init_draws_what_init_weights_draws() -> None:
    # The init a torchtitan user passes to cudakit, one module at a time, is
    # Transformer.init_weights(): under one seed the same values, bit for bit.
    torch.manual_seed(titan.SEED)
    theirs = titan.Transformer()
    with torch.no_grad():
        theirs.init_weights()
    torch.manual_seed(titan.SEED)
    ours = titan.Transformer()
    with torch.no_grad():
        for name, module in ours.named_modules():
            if titan.own_tensors(module):
                titan.titan_init(module, name)
    _equal_states(_reference_state(ours), _reference_state(theirs))


def test_meta_build_through_parallelize_is_the_seeded_cpu_build() -> None:
    before = torch.get_rng_state()
    model = cp.parallelize(
        titan.meta_model(), "none", device="cpu", init=titan.titan_init, init_seed=titan.SEED
    )
    assert torch.equal(torch.get_rng_state(), before)  # the global generator untouched
    _equal_states(titan.full_state(model), _reference_state(titan.seeded_reference()))
    # freqs_cis is recomputed (complex64, not the garbage to_empty leaves), and
    # stays out of the state dict, as torchtitan registers it.
    expected = titan.precompute_freqs_cis(titan.DIM // titan.HEADS, titan.SEQ, 10000.0)
    assert model.freqs_cis.dtype == torch.complex64
    assert torch.equal(model.freqs_cis, expected)
    assert "freqs_cis" not in model.state_dict()
    # torchtitan's rules: RMSNorm weights one, depth-scaled output projections, the
    # output cut at three of its stds.
    assert torch.equal(model.norm.weight, torch.ones(titan.DIM))
    std = titan.DIM**-0.5
    assert model.output.weight.abs().max() <= 3 * std
    deep = model.layers["1"].attention.wo.weight.detach().std()
    assert deep < model.layers["0"].attention.wo.weight.std() < 0.02
    assert math.isclose(float(deep), 0.02 / 2, rel_tol=0.15)


def test_the_model_level_init_weights_is_refused_with_the_per_module_form() -> None:
    # A torchtitan user's first try: the root's init_weights(buffer_device=None).
    # cudakit calls init once per module, so that is refused, before anything is
    # allocated, with the form that works.
    model = titan.meta_model()
    with pytest.raises(TypeError, match=r"^parallelize\(init=\.\.\.\) expects a callable") as info:
        cp.parallelize(model, "fsdp", device="cpu", init=model.init_weights)
    message = str(info.value)
    assert "got method <bound method Transformer.init_weights" in message
    assert "Transformer.init_weights() takes no module" in message
    assert "one module at a time" in message
    assert "init(module, name)" in message
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autocast_step_trains_as_the_titan_loop(dtype: torch.dtype) -> None:
    start = titan.seeded_reference().state_dict()
    ours, theirs = titan.Transformer(), titan.Transformer()
    ours.load_state_dict(start)
    theirs.load_state_dict(start)
    got = titan.cudakit_steps(ours, titan.batches(), dtype)
    want = titan.titan_steps(theirs, titan.batches(), dtype)
    assert len(got) == len(want) == titan.STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), step
    _equal_states(ours.state_dict(), theirs.state_dict())


# --------------------------------------------------------------------------- gloo ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch at 2 ranks, then one at 3 on what the first saved."""
    directory = tmp_path_factory.mktemp("titan")
    seed = titan.seed_checkpoint(str(directory / "seed"))
    two = cp.launch(titan.at_two_ranks, str(directory), nprocs=2, timeout=TIMEOUT)
    three = cp.launch(titan.at_three_ranks, str(directory), nprocs=3, timeout=TIMEOUT)
    return {"seed": seed, 2: two, 3: three, "directory": directory}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_meta_build_equals_one_process(runs: dict[str, Any], world: int) -> None:
    want = _reference_state(titan.seeded_reference())
    _equal_states(runs[world][0]["build"]["state"], want)
    for rank, res in enumerate(runs[world]):
        build = res["build"]
        assert torch.equal(build["freqs_cis"], want["freqs_cis"]), rank
        assert build["finite"], rank


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_shards_each_block_of_a_module_dict(runs: dict[str, Any], world: int) -> None:
    # torchtitan keeps its blocks in an nn.ModuleDict and shards each, then the root:
    # one block's parameters are gathered at a time, never the whole model.
    for rank, res in enumerate(runs[world]):
        assert res["build"]["units"] == ["", "layers.0", "layers.1"], rank


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp2_autocast_step_trains_as_the_titan_loop(runs: dict[str, Any], precision: str) -> None:
    for rank, res in enumerate(runs[2]):
        run = res[precision]
        for step, (a, b) in enumerate(zip(run["ours"], run["theirs"], strict=True)):
            assert torch.equal(a, b), (rank, step)
    _equal_states(runs[2][0][precision]["ours_state"], runs[2][0][precision]["theirs_state"])


@pytest.mark.distributed
def test_fsdp2_accumulation_is_close_to_a_reduce_scatter_per_micro_batch(
    runs: dict[str, Any],
) -> None:
    # torchtitan reduce-scatters every micro-batch; cudakit (and the loop above)
    # once per window: the same sum in another order, so close, not equal.
    for rank, res in enumerate(runs[2]):
        run = res["fp32"]
        for a, b in zip(run["ours"], run["sync_each"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


@pytest.mark.distributed
def test_fsdp2_resume_after_a_crash_continues_bit_for_bit(runs: dict[str, Any]) -> None:
    for rank, res in enumerate(runs[2]):
        whole, resumed = res["resume"]["whole"], res["resume"]["resumed"]
        assert len(whole["losses"]) == titan.STEPS, rank
        assert len(resumed["losses"]) == titan.STEPS - 2, rank  # steps 3 and 4 only
        for key, loss in resumed["losses"].items():
            assert torch.equal(loss, whole["losses"][key]), (rank, key)
    _equal_states(runs[2][0]["resume"]["resumed"]["state"], runs[2][0]["resume"]["whole"]["state"])
    whole_opt = runs[2][0]["resume"]["whole"]["opt"]["state"]
    resumed_opt = runs[2][0]["resume"]["resumed"]["opt"]["state"]
    assert whole_opt.keys() == resumed_opt.keys()
    for key in whole_opt:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(whole_opt[key][field], resumed_opt[key][field]), (key, field)


@pytest.mark.distributed
def test_weights_saved_at_two_ranks_load_at_three(runs: dict[str, Any]) -> None:
    # docs/checkpoint.md: the model and optimizers reshard; a run's data position
    # taken mid-epoch belongs to its world size and is refused elsewhere.
    last = f"ckpt-{titan.STEPS:010d}"
    whole = runs[2][0]["resume"]["whole"]
    got = runs[3][0]["reshard"]
    _equal_states(got[last]["weights"], whole["state"])  # load_pretrained of a DCP folder
    _equal_states(got[last]["state"], whole["state"])  # Checkpointer.load at an epoch end
    for key, state in whole["opt"]["state"].items():
        for field, value in state.items():
            assert torch.equal(got[last]["opt"]["state"][key][field], value), (key, field)
    mid = got["ckpt-0000000002"]
    assert not torch.equal(mid["weights"]["output.weight"], whole["state"]["output.weight"])
    for rank, res in enumerate(runs[3]):
        assert res["reshard"][last]["verdict"] == "loaded", rank
        verdict = res["reshard"]["ckpt-0000000002"]["verdict"]
        assert "was saved mid-epoch (epoch 0, batch 4) by 2 rank(s)" in verdict, rank
        assert "cannot be resharded to 3 rank(s)" in verdict, rank
        assert "Resume at the same world size" in verdict, rank
    # The refused load changed nothing: the weights load_pretrained put there stay.
    _equal_states(mid["state"], mid["weights"])


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_the_seed_checkpoint_gives_every_rank_torchtitans_init(
    runs: dict[str, Any], world: int
) -> None:
    # torchtitan's create_seed_checkpoint: one process, one seed, init_weights();
    # every rank of the run loads it. freqs_cis is not saved: the init recomputes it.
    seed = titan.seed_checkpoint(str(runs["directory"] / "again"))
    for key, value in runs["seed"].state_dict().items():
        assert torch.equal(value, seed.state_dict()[key]), key  # the one process
    res = runs[world][0]["seeded"]
    assert res["missing"] == []
    _equal_states(res["state"], _reference_state(runs["seed"]))
