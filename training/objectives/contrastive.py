"""Contrastive flow matching (Stoica et al. 2025, "Contrastive Flow Matching", gstoica27/DeltaFM): the velocity
error minus lambda times the error against another sample's target,

    L = |v_hat_i - v_i|^2 - lambda |v_hat_i - v_j|^2,   j = i - 1 in the micro-batch (a roll by one),

which pushes each conditional flow away from the others (DeltaFM trains with lambda = 0.05). Only the second term
lives here; the trainer adds it to the flow-matching loss and logs it on its own (loss_contrastive).

What it does at the optimum (derived here; docs/methods.md): for a fixed x_t the minimiser of
E|v_hat - v|^2 - lambda E|v_hat - v'|^2 is v_hat = (E[v | x_t] - lambda E[v']) / (1 - lambda), and as the
negative belongs to an independent sample, E[v'] = E[eps - x0] = -mean(x0) whatever the condition: the model
learns the flow-matching velocity, shifted by lambda mean(x0) and scaled by 1 / (1 - lambda). lambda < 1 keeps
the objective bounded below (sections' range of objective.contrastive_weight).
"""


def term(v_hat, v, weight):
    """Per-sample -weight |v_hat_i - v_{i-1}|^2 (mean over the elements, as the flow-matching loss): v_hat the
    predicted velocities and v their targets, (B, ...) each, in fp32."""
    negative = v.roll(1, dims=0)
    return -weight * (v_hat - negative).pow(2).mean(dim=tuple(range(1, v.dim())))


def problems(cfg, chosen=None):
    """The check of the micro-batch: one sample has no other to contrast with. At start-up (train.batch_size as
    written), and once train.batch_size="auto" is resolved (fit.plan_batch; `chosen`: how it came to be)."""
    weight, batch = cfg["objective"].get("contrastive_weight", 0.0), cfg["train"]["batch_size"]
    if not weight or batch != 1:
        return []
    if chosen is None:
        return [f"objective.contrastive_weight={weight} contrasts each sample with another of its micro-batch, and "
                f"train.batch_size=1 has none: use train.batch_size >= 2, or objective.contrastive_weight=0"]
    return [f"objective.contrastive_weight={weight} contrasts each sample with another of its micro-batch, and "
            f"train.batch_size='auto' chose 1 ({chosen}), which has none: make room for 2 (train.gradient_checkpointing"
            f"=true, train.ema_device='cpu', a smaller model.* or data.resolution), give train.global_batch at least 2 "
            f"per process, or set objective.contrastive_weight=0"]
