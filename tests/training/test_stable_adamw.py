"""StableAdamW (`optim.stable_adamw`, `config.optimizer="stableadamw"`) against the paper's Algorithm 2
written out in NumPy (Wortsman et al. 2023), and its update clipping at work."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bert_jax.training import optim

B1, B2, EPS = 0.9, 0.98, 1e-6
CALM_STEPS = 30  # steps of a constant gradient before the spike


def stable_adamw_reference(params, grads, lrs, *, weight_decay, decayed):
    """Algorithm 2 of Wortsman et al. 2023 in float64, one variable at a time (`params`: {name: array}).

    The moments use the paper's corrected betas `b_hat = b (1 - b**(t-1)) / (1 - b**t)`, which make
    them the bias-corrected averages directly (the paper's `v_t`, `u_t`); then
    `RMS_t = sqrt(mean(g**2 / max(u_t, eps**2)))`, `eta_t = lr_t / max(1, RMS_t)`, and
    `theta -= eta_t * (weight_decay * theta + v_t / (sqrt(u_t) + eps))` (decay only for `decayed`
    names). Returns the parameters after each step and each step's RMS per variable.
    """
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    first = {k: np.zeros_like(v) for k, v in w.items()}
    second = {k: np.zeros_like(v) for k, v in w.items()}
    history, rms_history = [], []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        b1_hat = B1 * (1 - B1 ** (t - 1)) / (1 - B1 ** t)
        b2_hat = B2 * (1 - B2 ** (t - 1)) / (1 - B2 ** t)
        rms_t = {}
        for k in w:
            gk = np.asarray(g[k], np.float64)
            first[k] = b1_hat * first[k] + (1 - b1_hat) * gk
            second[k] = b2_hat * second[k] + (1 - b2_hat) * gk ** 2
            rms_t[k] = np.sqrt(np.mean(gk ** 2 / np.maximum(second[k], EPS ** 2)))
            eta = lr / max(1.0, rms_t[k])
            decay = weight_decay if k in decayed else 0.0
            w[k] = w[k] - eta * (decay * w[k] + first[k] / (np.sqrt(second[k]) + EPS))
        history.append({k: v.copy() for k, v in w.items()})
        rms_history.append(rms_t)
    return history, rms_history


def _stack(flat):
    """The JAX tree of the reference's variables: the two layers' kernels stacked as a scanned encoder
    holds them (`encoder/layers/...`, leading layer axis), the others as they are."""
    return {"w": jnp.asarray(flat["w"], jnp.float32), "bias": jnp.asarray(flat["bias"], jnp.float32),
            "encoder": {"layers": {"kernel": jnp.asarray(np.stack([flat["layer_0"], flat["layer_1"]]),
                                                           jnp.float32)}}}


def test_four_steps_match_the_papers_algorithm_with_one_rms_per_tensor_and_per_scanned_layer():
    rng = np.random.default_rng(0)
    flat = {"w": rng.normal(size=(3, 4)), "bias": rng.normal(size=(4,)),
            "layer_0": rng.normal(size=(3, 3)), "layer_1": rng.normal(size=(3, 3))}
    flat = {k: v.astype(np.float32).astype(np.float64) for k, v in flat.items()}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) * 0.1 for k, v in flat.items()} for _ in range(4)]
    grads[2]["w"] = grads[2]["w"] * 50.0  # a spike: w's RMS > 1 at step 3
    grads[3]["layer_1"] = grads[3]["layer_1"] * 30.0  # one scanned layer's spike: only layer 1 is clipped
    lrs = [0.01, 0.02, 0.03, 0.015]
    want, rms = stable_adamw_reference(flat, grads, lrs, weight_decay=0.1, decayed={"w", "layer_0", "layer_1"})
    # The clip engages where a gradient jumps (RMS_t can reach 1 / sqrt(1 - b2_hat_t): 1.7 at t=3, 2.0 at t=4)
    # and not on the other layer of the same scanned leaf.
    assert rms[2]["w"] > 1.5 and rms[3]["layer_1"] > 1.5 and rms[3]["layer_0"] < 1.3
    assert all(r <= 1 + 1e-9 for r in rms[0].values())  # the first step: u_1 = g_1**2, so RMS is 1

    tx = optim.make_optimizer("stableadamw", lambda count: jnp.asarray(lrs)[count], weight_decay=0.1,
                              b1=B1, b2=B2, eps=EPS, clip_norm=None)
    params = _stack(flat)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for k in range(4):
        updates, state = step(_stack(grads[k]), state, params)
        params = optax.apply_updates(params, updates)
        got = {"w": params["w"], "bias": params["bias"], "layer_0": params["encoder"]["layers"]["kernel"][0],
               "layer_1": params["encoder"]["layers"]["kernel"][1]}
        for name in flat:
            np.testing.assert_allclose(got[name], want[k][name], rtol=0, atol=1e-6, err_msg=f"step {k + 1} {name}")


def test_a_gradient_spike_gets_a_smaller_step_than_adamws_and_the_rest_the_same_step():
    params = {"spiky": jnp.ones((4, 4)), "calm": jnp.ones((4, 4))}
    calm_grads = {"spiky": jnp.full((4, 4), 0.01), "calm": jnp.full((4, 4), 0.01)}
    spike = {"spiky": jnp.full((4, 4), 10.0), "calm": jnp.full((4, 4), 0.01)}  # 1000x on one tensor
    steps = {}
    for name in ("adamw", "stableadamw"):
        tx = optim.make_optimizer(name, lambda count: 1e-3, weight_decay=0.0, b2=B2, clip_norm=None)
        state = tx.init(params)
        first, state = tx.update(calm_grads, state, params)
        for _ in range(CALM_STEPS - 1):
            _, state = tx.update(calm_grads, state, params)
        spiked, _ = tx.update(spike, state, params)
        steps[name] = first, spiked
    # The first step: u_1 = g_1**2, RMS = 1, no clipping: AdamW's step exactly.
    for name in params:
        np.testing.assert_allclose(steps["stableadamw"][0][name], steps["adamw"][0][name], rtol=1e-6)
    adam, stable = steps["adamw"][1], steps["stableadamw"][1]
    # The spike at step t: u_t = b2_hat * 0.01**2 + (1 - b2_hat) * 10**2 (the calm steps' average is
    # exactly 0.01**2), RMS_t = sqrt(10**2 / u_t): the step shrinks by 1 / RMS_t (~0.21 at t = 31).
    ratio = float(jnp.mean(stable["spiky"] / adam["spiky"]))
    t = CALM_STEPS + 1
    b2_hat = B2 * (1 - B2 ** (t - 1)) / (1 - B2 ** t)
    u_t = b2_hat * 1e-4 + (1 - b2_hat) * 100.0
    np.testing.assert_allclose(ratio, 1 / np.sqrt(100.0 / u_t), rtol=1e-4)
    assert ratio < 0.25
    np.testing.assert_allclose(stable["calm"], adam["calm"], rtol=1e-6)  # its own RMS is 1: untouched


def test_the_state_is_adamws_and_global_norm_clipping_still_chains_in_front():
    params = {"w": jnp.ones((2, 3)), "bias": jnp.zeros(3)}
    ours = optim.make_optimizer("stableadamw", lambda c: 1e-3, clip_norm=None).init(params)
    adamw = optim.make_optimizer("adamw", lambda c: 1e-3, clip_norm=None).init(params)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(adamw)
    clipped = optim.make_optimizer("stableadamw", lambda c: 1e-3, clip_norm=1.0)
    assert jax.tree_util.tree_structure(clipped.init(params)) == jax.tree_util.tree_structure(
        optim.make_optimizer("adamw", lambda c: 1e-3, clip_norm=1.0).init(params))
    assert "stableadamw" in optim.OPTIMIZERS
