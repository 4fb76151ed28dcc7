"""The one simulated tau (distill/acceptance.py): the bonus token counted, the chain stopping at
the first rejection, K capping it, floats and tensors alike."""

import pytest
import torch

from draftsmith.distill.acceptance import simulated_tau


def test_tau_counts_the_bonus_token_and_stops_at_k():
    assert simulated_tau([]) == 1.0  # target-only decoding
    assert simulated_tau([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert simulated_tau([0.8, 0.5, 0.9], k=2) == pytest.approx(2.2)
    assert simulated_tau([1.0] * 4) == 5.0  # K always-right drafts: K + 1 tokens
    assert simulated_tau([0.0, 1.0, 1.0]) == 1.0  # nothing after the first rejection counts


def test_tensors_are_one_chain_per_element():
    hits = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])]
    assert simulated_tau(hits).tolist() == [3.0, 2.0, 1.0]  # heads accepted until the first miss, + 1
    p = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    assert simulated_tau([p, p]).flatten().tolist() == pytest.approx([1.75, 1.3125])
