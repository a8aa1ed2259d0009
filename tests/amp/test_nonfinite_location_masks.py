"""Additive ``-inf`` masks are not non-finite sources: the rule is the value, not how it is passed.

A tensor whose only non-finite values are ``-inf`` is an additive attention mask
(``nn.Transformer.generate_square_subsequent_mask``) wherever it is passed: to a
module positionally or by keyword, or to the step function itself. A NaN or a
``+inf`` is bad in any input, keyword arguments included.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cudakit.amp import NonFiniteWarning, autocast_step, find_nonfinite

NAN = float("nan")


class TinyLM(nn.Module):
    """PyTorch's word_language_model TransformerModel, small: the mask goes positionally."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.decoder = nn.Linear(width, vocab)
        self.poison = False

    def forward(self, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(src) * math.sqrt(8), mask)
        out = self.decoder(h)
        return out * NAN if self.poison else out


def lm_loss(model: TinyLM, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(src, mask)
    return nn.functional.cross_entropy(logits.flatten(0, 1), src.flatten())


def _poisoned_lm() -> tuple[TinyLM, torch.Tensor, torch.Tensor]:
    """The model with a NaN weight in its decoder, a batch, the causal -inf mask."""
    torch.manual_seed(0)
    model = TinyLM()
    src = torch.randint(0, 11, (2, 5))
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        model.decoder.weight[3, 2] = NAN
    return model, src, mask


def test_positional_mask_to_a_module_is_not_blamed() -> None:
    model, src, mask = _poisoned_lm()
    found = find_nonfinite(lambda s, m: lm_loss(model, s, m), src, mask)
    assert found is not None
    assert (found.phase, found.name, found.module) == ("forward", "decoder", "Linear")


def test_mask_passed_to_the_step_function_is_not_an_input_source() -> None:
    model, src, mask = _poisoned_lm()
    for found in (
        find_nonfinite(lambda s, m: lm_loss(model, s, m), src, mask),
        find_nonfinite(lambda s, mask: lm_loss(model, s, mask), src, mask=mask),
    ):
        assert found is not None
        assert (found.phase, found.name) == ("forward", "decoder")


def test_finite_step_with_a_mask_finds_nothing() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    src = torch.randint(0, 11, (2, 5))
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    assert find_nonfinite(lambda s, m: lm_loss(model, s, m), src, mask) is None


def test_nan_and_plus_inf_inputs_of_the_step_are_still_named() -> None:
    model = nn.Linear(4, 1)
    for bad in (NAN, math.inf):
        x = torch.ones(2, 4)
        x[1, 2] = bad
        found = find_nonfinite(lambda x: model(x).sum(), x)
        assert found is not None
        assert (found.phase, found.name) == ("input", "args[0]")
        found = find_nonfinite(lambda x: model(x).sum(), x=x)
        assert found is not None
        assert (found.phase, found.name) == ("input", "kwargs['x']")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lin(hidden_states)  # type: ignore[no-any-return]


class Outer(nn.Module):
    """Its own code overflows to +inf and passes the result on (HF style, by keyword)."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = Block()
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).abs() * math.inf
        out = self.b(hidden_states=h) if self.keyword else self.b(h)
        return out  # type: ignore[no-any-return]


def test_plus_inf_made_by_the_enclosing_module_is_its_own_by_keyword_too() -> None:
    torch.manual_seed(0)
    for keyword in (False, True):
        model = Outer(keyword)
        found = find_nonfinite(lambda x, m=model: m(x).sum(), torch.ones(2, 4))
        assert found is not None
        assert (found.phase, found.name, found.module) == ("forward", "", "Outer"), keyword


def test_a_skipped_masked_lm_window_names_the_module() -> None:
    """The word_language_model loop under ``autocast_step(locate_nonfinite=True)``."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=True)
    train = step(lambda s, m: lm_loss(model, s, m))
    src = torch.randint(0, 11, (2, 5))
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    train(src, mask)
    model.poison = True
    with pytest.warns(NonFiniteWarning, match="TinyLM"):
        found = train(src, mask).nonfinite
    assert found is not None
    assert (found.phase, found.name, found.module) == ("forward", "", "TinyLM")
