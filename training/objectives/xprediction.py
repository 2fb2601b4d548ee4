"""x-prediction for flow matching (Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise", JiT):
the network outputs the clean image x0_hat, and the loss stays on the velocity.

In this codebase's convention (t = 1 is noise) x_t = (1 - t) x0 + t eps, so x_t - x0 = t (eps - x0) = t v and
a clean-image estimate is a velocity estimate v_hat = (x_t - x0_hat) / t. The division blows up near t = 0,
so t is clamped from below at T_MIN, JiT's t_eps (its `denoiser.py` clamps 1 - t, its t = 1 being data), and
the target is computed the same way: the loss is |x0_hat - x0|^2 / max(t, T_MIN)^2, exactly the v-prediction
loss wherever t >= T_MIN. Why predict x0: a clean image lies on a low-dimensional manifold, noise and velocity
do not, so a network with fewer channels than the patch's pixels (pixel-space patches, high-dimensional latents)
can still output it (JiT, sec. 3-4). The sampler converts the same way (train_flow_matching.sample).
"""
T_MIN = 0.05  # JiT's t_eps: the smallest noise level the conversion divides by


def velocity(x0_hat, x_t, t):
    """The velocity that a clean-image estimate implies at (x_t, t): (x_t - x0_hat) / max(t, T_MIN). `t`
    broadcasts against x_t (a (B, 1, 1, 1) column in training, a 0-dim tensor in the sampler)."""
    return (x_t - x0_hat) / t.clamp(min=T_MIN)
