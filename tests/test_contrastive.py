"""Contrastive flow matching (training/objectives/contrastive.py): the term's form (DeltaFM), its optimum in closed
form, and its own logged loss."""
import torch

import train_flow_matching as fm
from training.objectives import contrastive


def test_the_term_is_minus_lambda_times_the_error_against_the_previous_samples_target():
    g = torch.Generator().manual_seed(0)
    v_hat, v = torch.randn(5, 3, 4, 4, generator=g), torch.randn(5, 3, 4, 4, generator=g)
    term = contrastive.term(v_hat, v, 0.05)
    expected = torch.stack([-0.05 * (v_hat[i] - v[i - 1]).pow(2).mean() for i in range(5)])  # v[-1]: sample 0's
    torch.testing.assert_close(term, expected)


def test_the_objective_s_minimiser_is_the_shifted_and_scaled_conditional_mean():
    """A model of one free vector per input group (A at even rows, B at odd: each sample's negative, the row
    before, is of the other group), fitted by gradient descent to the training objective, lands on
    (E[v | x] - lambda E[v' | x]) / (1 - lambda): docs/methods.md's closed form."""
    g = torch.Generator().manual_seed(0)
    group = torch.arange(64) % 2
    v = torch.randn(64, 2, generator=g) * 0.3 + torch.tensor([[2.0, -1.0], [-0.5, 1.5]])[group]
    c = torch.zeros(2, 2, requires_grad=True)
    opt = torch.optim.SGD([c], lr=0.5)
    lam = 0.3
    for _ in range(500):
        opt.zero_grad()
        v_hat = c[group]
        ((v_hat - v).pow(2).mean(1) + contrastive.term(v_hat, v, lam)).mean().backward()
        opt.step()
    mean_a, mean_b = v[group == 0].mean(0), v[group == 1].mean(0)
    expected = torch.stack([(mean_a - lam * mean_b), (mean_b - lam * mean_a)]) / (1 - lam)
    torch.testing.assert_close(c.detach(), expected, atol=1e-4, rtol=0)


def test_training_loss_returns_the_plain_loss_and_the_term_on_its_own():
    class Model(torch.nn.Module):
        def forward(self, x, timestep, cond, noise_level=None):
            return x * 0.5

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    t = torch.rand(4, generator=g)
    loss, terms = fm.training_loss(Model(), x0, {}, t, noise, "v", 0.05)
    torch.testing.assert_close(loss, fm.flow_matching_loss(Model(), x0, {}, t, noise))
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    torch.testing.assert_close(terms["contrastive"], contrastive.term(x_t * 0.5, noise - x0, 0.05))
    assert fm.training_loss(Model(), x0, {}, t, noise, "v", 0.0)[1] == {}  # off: no term, nothing logged
