"""What a checkpoint carries besides the model: extras, several models, stateful loaders;
and the clear errors for a checkpoint that does not fit or an argument that is wrong."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cudakit


class Ema:
    """A user object with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.value = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"].clone()


def test_extras_plain_values_and_every_rng_come_back(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    ema = Ema()
    ema.value += 5
    ckpt = cudakit.Checkpointer(
        tmp_path, model=model, extra={"ema": ema, "best": 0.25}, preemption=False
    )
    ckpt.extra["best"] = 0.125
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    path = ckpt.save()
    expected = (torch.rand(2), random.random(), np.random.rand())
    ckpt.close()

    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    other_ema = Ema()
    again = cudakit.Checkpointer(
        tmp_path, model=torch.nn.Linear(2, 2), extra={"ema": other_ema, "best": 1.0},
        preemption=False,
    )  # fmt: skip
    assert again.resume() == cudakit.Position(0, 0, 0, 1)  # no step, no batches: save 1
    assert again.resumed_from == path
    assert torch.equal(other_ema.value, torch.full((3,), 5.0))
    assert again.extra["best"] == 0.125
    got = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0])
    assert got[1:] == expected[1:]
    again.close()


def test_two_models_with_their_own_optimizers(tmp_path: Path) -> None:
    g, d = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opt_g, opt_d = torch.optim.Adam(g.parameters()), torch.optim.SGD(d.parameters(), lr=0.1)
    d(g(torch.ones(2, 3))).sum().backward()
    opt_g.step()
    ckpt = cudakit.Checkpointer(
        tmp_path, model={"G": g, "D": d}, optimizer=[opt_g, opt_d], preemption=False
    )
    ckpt.save()
    ckpt.close()
    g2, d2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opt_g2, opt_d2 = torch.optim.Adam(g2.parameters()), torch.optim.SGD(d2.parameters(), lr=0.1)
    again = cudakit.Checkpointer(
        tmp_path, model={"G": g2, "D": d2}, optimizer=[opt_g2, opt_d2], preemption=False
    )
    again.resume()
    assert torch.equal(g2.weight, g.weight)
    assert torch.equal(d2.bias, d.bias)
    state = opt_g2.state[g2.weight]
    assert torch.equal(state["exp_avg"], opt_g.state[g.weight]["exp_avg"])
    assert not opt_d2.state  # SGD without momentum had no state, and still has none
    again.close()


def test_an_optimizer_saved_before_its_first_step_resumes_fresh(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    ckpt.save()
    assert not opt.state  # saving did not step it
    ckpt.close()
    m2 = torch.nn.Linear(2, 1)
    o2 = torch.optim.Adam(m2.parameters())
    again = cudakit.Checkpointer(tmp_path, model=m2, optimizer=o2, preemption=False)
    again.resume()
    assert not o2.state
    again.close()


def test_an_lbfgs_saved_before_its_first_step_is_refused_as_it_was(tmp_path: Path) -> None:
    """DCP's get_state_dict makes a state for an optimizer that has none by stepping it
    with zero gradients and a zero learning rate; LBFGS's step needs a closure. The
    save is refused, naming the optimizer and the fix, with its learning rate and
    groups, the gradients and the directory as they were."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5)
    groups = [dict(g) for g in opt.param_groups]
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    with pytest.raises(cudakit.CheckpointSaveError) as info:
        ckpt.save()
    ckpt.close()
    text = str(info.value)
    assert text.startswith("Checkpointer.save(): optimizer 0 (LBFGS) has no state yet")
    assert "Save after its first step" in text
    assert not opt.state
    assert [dict(g) for g in opt.param_groups] == groups
    assert opt.param_groups[0]["lr"] == 0.5
    assert model.weight.grad is None
    assert model.bias.grad is None
    assert cudakit.find_latest(tmp_path) is None


class StatefulLoader:
    """Like torchdata's StatefulDataLoader: resumes by itself from its state_dict."""

    def __init__(self, n: int) -> None:
        self.n, self.next = n, 0

    def __iter__(self) -> Any:
        while self.next < self.n:
            self.next += 1
            yield torch.tensor([float(self.next)])
        self.next = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def test_a_stateful_loader_keeps_its_own_position(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    loader = StatefulLoader(6)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, loader=loader, every=1, preemption=False)
    seen: list[int] = []

    def crash_at_the_fourth() -> None:
        for _ in ckpt.epochs(1):
            for batch in ckpt.batches():
                seen.append(int(batch))
                if len(seen) == 4:
                    raise KeyError("crash")  # a crash while the fourth batch is in hand

    with pytest.raises(KeyError):
        crash_at_the_fourth()
    loader2 = StatefulLoader(6)
    again = cudakit.Checkpointer(
        tmp_path, model=torch.nn.Linear(1, 1), loader=loader2, every=1, preemption=False
    )
    rest = [int(b) for _ in again.epochs(1) for b in again.batches()]
    assert seen == [1, 2, 3, 4]
    assert rest == [4, 5, 6]  # the fourth batch was handed out but its save point not reached
    again.close()


def test_a_loader_and_extras_set_after_creation_are_the_ones_saved(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, every=1, preemption=False)
    ckpt.loader = StatefulLoader(6)  # set on the attributes, not passed at creation
    ckpt.extra = {"best": 0.5}

    def crash_at_the_fourth() -> None:
        for _ in ckpt.epochs(1):
            for batch in ckpt.batches():
                if int(batch) == 4:
                    raise KeyError("crash")

    with pytest.raises(KeyError):
        crash_at_the_fourth()
    ckpt.close()
    again = cudakit.Checkpointer(
        tmp_path, model=torch.nn.Linear(1, 1), loader=StatefulLoader(6),
        extra={"best": 1.0}, every=1, preemption=False,
    )  # fmt: skip
    rest = [int(b) for _ in again.epochs(1) for b in again.batches()]
    assert again.extra["best"] == 0.5
    assert rest == [4, 5, 6]  # the loader set on the attribute was saved with its position
    again.close()


def _saved(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    path = ckpt.save()
    ckpt.close()
    assert path is not None
    return path


def test_a_checkpoint_of_another_model_names_missing_and_unexpected_keys(
    tmp_path: Path,
) -> None:
    path = _saved(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    ckpt = cudakit.Checkpointer(tmp_path / "x", model=other, optimizer=opt, preemption=False)
    with pytest.raises(cudakit.CheckpointError) as info:
        ckpt.load(path)
    text = str(info.value)
    assert "missing from the checkpoint: model.model.2.bias, model.model.2.weight" in text
    assert "in the checkpoint but not in this run: model.model.1.bias, model.model.1." in text
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert not opt.state  # the optimizer is as it was: never stepped
    ckpt.close()


def test_a_checkpoint_with_other_shapes_names_them(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(other.parameters())
    ckpt = cudakit.Checkpointer(tmp_path / "x", model=other, optimizer=opt, preemption=False)
    with pytest.raises(
        cudakit.CheckpointError, match=r"shape \(3, 2\) in the checkpoint, \(4, 2\)"
    ):
        ckpt.load(path)
    ckpt.close()


def test_another_number_of_optimizers_or_schedulers_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ckpt = cudakit.Checkpointer(
        tmp_path / "x", model=model, optimizer=opt, scheduler=sched, preemption=False
    )
    with pytest.raises(cudakit.CheckpointError, match=r"1 optimizer\(s\), 0 scheduler\(s\)"):
        ckpt.load(path)
    ckpt.close()


def _refusal(
    tmp_path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path | None
) -> str:
    """The message of a fresh run's refused ``load(path)`` (a CheckpointError)."""
    assert path is not None
    ckpt = cudakit.Checkpointer(tmp_path / "x", model=model, optimizer=opt, preemption=False)
    with pytest.raises(cudakit.CheckpointError) as info:
        ckpt.load(path)
    ckpt.close()
    return str(info.value)


def _options(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize(
    ("make", "stepped", "expects", "holds"),
    [
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            False,
            "options dampening, momentum, nesterov",
            "options amsgrad, betas, capturable, decoupled_weight_decay, eps",
        ),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            True,
            "options dampening, momentum, nesterov and the state momentum_buffer",
            "options amsgrad, betas, capturable, decoupled_weight_decay, eps and the state "
            "exp_avg, exp_avg_sq, step",
        ),
        (
            lambda p: torch.optim.RMSprop(p, lr=0.1),
            False,
            "options alpha, centered, momentum",
            "options amsgrad, betas, decoupled_weight_decay, fused and the state",
        ),
        (
            lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True),
            True,
            "state max_exp_avg_sq",
            "state exp_avg, exp_avg_sq, step",
        ),
    ],
    ids=["sgd-fresh", "sgd-stepped", "rmsprop-fresh", "adam-amsgrad-stepped"],
)
def test_a_checkpoint_of_another_optimizer_type_is_refused_naming_both(
    tmp_path: Path, make: Any, stepped: bool, expects: str, holds: str
) -> None:
    """A checkpoint saved with Adam, resumed into another optimizer (fresh, or one that
    has stepped), is cudakit's "does not fit" refusal naming the optimizer, what it
    expects and what the checkpoint holds, and the fix; nothing changes."""
    path = _saved(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = make(model.parameters())
    if stepped:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    options = _options(opt)
    text = _refusal(tmp_path, model, opt, path)
    assert f"{path} does not fit this run's models and optimizers" in text
    assert "Missing key" not in text
    name = type(opt).__name__
    assert f"optimizer 0 ({name}) of model 'model' expects the {expects}" in text
    assert f"the checkpoint holds the {holds}" in text
    assert "Build each optimizer as the checkpoint's was saved" in text  # the fix
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key])
    assert _options(opt) == options
    assert opt.state.keys() == state.keys()
    for p, entries in state.items():
        assert opt.state[p].keys() == entries.keys()
        for key, value in entries.items():
            assert torch.equal(opt.state[p][key], value)


def test_another_number_of_parameter_groups_is_refused_naming_both(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model[0].parameters())
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.5})
    text = _refusal(tmp_path, model, opt, path)
    assert "optimizer 0 (Adam) of model 'model' has 2 parameter group(s)" in text
    assert "the checkpoint's has 1" in text
    assert "Missing key" not in text
    assert [g["lr"] for g in opt.param_groups] == [0.001, 0.5]


def test_a_stepped_optimizer_the_checkpoint_holds_more_state_for_is_refused(
    tmp_path: Path,
) -> None:
    """An Adam that has stepped without amsgrad, loading an amsgrad checkpoint, would
    take amsgrad=True without max_exp_avg_sq (and fail at its next step): refused, and
    nothing changes."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), amsgrad=True)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False) as ckpt:
        path = ckpt.save()
    other = torch.optim.Adam(model.parameters())
    other.step()
    options = _options(other)
    text = _refusal(tmp_path, model, other, path)
    assert "optimizer 0 (Adam) of model 'model' keeps the state exp_avg, exp_avg_sq" in text
    assert "the checkpoint holds the state max_exp_avg_sq as well" in text
    assert _options(other) == options
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in other.state.values())


def test_a_stepped_lbfgs_of_another_history_length_is_refused(tmp_path: Path) -> None:
    def closure_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: float) -> None:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.full((4, 2), x)).square().mean()
            loss.backward()
            return loss

        opt.step(closure)

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=1, history_size=3)
    for x in (1.0, 2.0, 3.0, 4.0):
        closure_step(model, opt, x)
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False) as ckpt:
        path = ckpt.save()
    torch.manual_seed(0)
    again = torch.nn.Linear(2, 1)
    short = torch.optim.LBFGS(again.parameters(), max_iter=1, history_size=3)
    closure_step(again, short, 1.0)
    closure_step(again, short, 2.0)
    history = len(next(iter(short.state.values()))["old_dirs"])
    text = _refusal(tmp_path, again, short, path)
    assert "does not fit" in text
    assert "optim.model.state.weight.al.1" in text
    assert "load into a new optimizer" in text
    assert len(next(iter(short.state.values()))["old_dirs"]) == history


def test_groups_a_scheduler_changed_are_refused_with_the_hint(tmp_path: Path) -> None:
    """An lr scheduler built on the optimizer but not on the saved run's (or not passed)
    adds ``initial_lr`` to its groups: the refusal says where it comes from."""
    path = _saved(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters())
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # not passed to the Checkpointer
    text = _refusal(tmp_path, model, opt, path)
    assert "optimizer 0 (Adam) of model 'model' expects the options initial_lr" in text
    assert "an lr scheduler adds initial_lr: build the schedulers as the saved run did" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"directory": 3}, TypeError, r"Checkpointer\(directory=...\) expects a path"),
        ({"directory": ""}, ValueError, r"expects a non-empty path"),
        ({"model": "net"}, TypeError, r"Checkpointer\(model=...\) expects an nn.Module"),
        ({"model": None}, TypeError, r"build the step with autocast_step\(..., model=model\)"),
        ({"model": {"a.b": torch.nn.Linear(1, 1)}}, ValueError, r"names without dots"),
        ({"optimizer": "adam"}, TypeError, r"expects a torch.optim.Optimizer"),
        ({"scheduler": torch.optim.lr_scheduler.StepLR}, TypeError, r"scheduler instance"),
        ({"step": 3}, TypeError, r"Checkpointer\(step=...\) expects an autocast_step"),
        ({"loader": iter([1, 2])}, TypeError, r"re-iterable loader"),
        ({"loader": 5}, TypeError, r"re-iterable of batches"),
        ({"extra": [1]}, TypeError, r"extra=\.\.\.\) expects a dict"),
        ({"extra": {1: 2}}, TypeError, r"extra=\.\.\.\) expects str names as keys, got int 1"),
        ({"keep": 0}, ValueError, r"Checkpointer\(keep=...\) expects an int >= 1"),
        ({"keep": 1.5}, TypeError, r"Checkpointer\(keep=...\) expects an int"),
        ({"every": -1}, ValueError, r"Checkpointer\(every=...\) expects an int >= 1"),
        ({"async_save": "yes"}, TypeError, r"async_save=...\) expects True or False"),
        ({"preemption": 1}, TypeError, r"preemption=...\) expects True or False"),
        ({"exit_code": 300}, ValueError, r"exit_code=...\) expects an int"),
        ({"requeue": "sometimes"}, TypeError, r"'auto', True or False"),
    ],
)
def test_every_bad_argument_is_refused_clearly(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = torch.nn.Linear(1, 1)
    args: dict[str, Any] = {"directory": tmp_path / "c", "model": model, "preemption": False}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        cudakit.Checkpointer(args.pop("directory"), **args)
    assert not (tmp_path / "c").exists()  # refused before anything was made


def test_an_optimizer_of_parameters_outside_the_model_is_refused(tmp_path: Path) -> None:
    model, stray = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"optimizer 0 \(SGD\) steps parameters that are not"):
        cudakit.Checkpointer(
            tmp_path, model=model, optimizer=torch.optim.SGD(stray.parameters(), lr=1)
        )


def test_calls_after_close_are_a_clear_error(tmp_path: Path) -> None:
    ckpt = cudakit.Checkpointer(tmp_path, model=torch.nn.Linear(1, 1), preemption=False)
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"Checkpointer.save\(\) after close\(\)"):
        ckpt.save()


def test_batches_without_a_loader_says_where_to_pass_it(tmp_path: Path) -> None:
    ckpt = cudakit.Checkpointer(tmp_path, model=torch.nn.Linear(1, 1), preemption=False)
    with pytest.raises(TypeError, match=r"Checkpointer\(loader=...\)"):
        next(ckpt.batches())
    with pytest.raises(TypeError, match=r"Checkpointer.batches\(loader=...\) expects a re-it"):
        next(ckpt.batches(iter([1])))
    with pytest.raises(ValueError, match=r"epochs\(stop=...\) expects an int >= 0"):
        next(ckpt.epochs(-1))
    ckpt.close()


def test_a_checkpoint_loads_into_the_model_however_it_is_wrapped(tmp_path: Path) -> None:
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))

    model = net()
    compiled = torch.compile(model)
    opt = torch.optim.Adam(compiled.parameters())
    compiled(torch.ones(2, 3)).sum().backward()
    opt.step()
    ckpt = cudakit.Checkpointer(tmp_path, model=compiled, optimizer=opt, preemption=False)
    ckpt.save()
    ckpt.close()
    for wrap in (lambda m: m, torch.nn.DataParallel):
        target = wrap(net())
        target_opt = torch.optim.Adam(target.parameters())
        again = cudakit.Checkpointer(tmp_path, model=target, optimizer=target_opt, preemption=False)
        again.resume()
        again.close()
        bare = cudakit.unwrap(target)
        assert torch.equal(bare[0].weight, model[0].weight)
        assert torch.equal(
            target_opt.state[bare[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"]
        )
