"""stalewise.optim against the references: torch.optim, optax, and their schedulers.

Every comparison runs 100 steps on a problem of several leaves of different
shapes, flattened to one float32 vector. Gradients come from a noisy quadratic
evaluated on each side's own parameters, so the state feeds back as in training.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from numpy.testing import assert_allclose

from stalewise import optim
from stalewise.segments import Segments

SHAPES = {
    "layer1.weight": (7, 5),
    "layer1.bias": (5,),
    "conv.kernel": (3, 4, 2),
    "head.bias": (11,),
}
SEGMENTS = Segments.from_sizes(list(SHAPES), [math.prod(s) for s in SHAPES.values()])
STEPS = 100


class Problem:
    """Loss 0.5 * sum(c * (p - target)^2) plus fresh gradient noise at every step.

    Each parameter starts and ends on one side of zero (its target's), so that
    ``rtol`` alone can compare trajectories: near zero, float32 rounding of an
    O(1) history is large relative to the value. One leaf starts at zero.
    """

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n = SEGMENTS.total
        sign = rng.choice([-1.0, 1.0], size=n)
        self.p0 = (sign * rng.uniform(1.0, 2.0, size=n)).astype(np.float32)
        self.p0[SEGMENTS.offsets[1] : SEGMENTS.offsets[1] + SEGMENTS.sizes[1]] = 0.0
        self.target = (sign * rng.uniform(1.0, 2.0, size=n)).astype(np.float32)
        self.curvature = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
        self.noise = (0.1 * rng.normal(size=(STEPS, n))).astype(np.float32)

    def grad(self, flat: np.ndarray, step: int) -> np.ndarray:
        return self.curvature * (flat - self.target) + self.noise[step]


def split(flat: np.ndarray) -> dict[str, np.ndarray]:
    return {
        name: flat[o : o + n].reshape(SHAPES[name])
        for name, o, n in zip(SEGMENTS.names, SEGMENTS.offsets, SEGMENTS.sizes, strict=True)
    }


def run_ours(opt: optim.Optimizer, problem: Problem, steps: int = STEPS) -> np.ndarray:
    params = problem.p0.copy()
    state = opt.init(params, SEGMENTS)
    for t in range(steps):
        opt.apply(problem.grad(params, t), state, params)
    return params


def run_torch(make_opt, problem: Problem, steps: int = STEPS, make_sched=None) -> np.ndarray:
    tensors = [torch.tensor(a.copy()) for a in split(problem.p0).values()]
    opt = make_opt(tensors)
    sched = make_sched(opt) if make_sched else None
    for t in range(steps):
        flat = np.concatenate([x.detach().numpy().ravel() for x in tensors])
        for x, g in zip(tensors, split(problem.grad(flat, t)).values(), strict=True):
            x.grad = torch.from_numpy(g.copy())
        opt.step()
        if sched:
            sched.step()
    return np.concatenate([x.detach().numpy().ravel() for x in tensors])


def run_optax(tx: optax.GradientTransformation, problem: Problem, steps: int = STEPS) -> np.ndarray:
    params = {k: jnp.asarray(v) for k, v in split(problem.p0).items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(steps):
        flat = np.concatenate([np.asarray(params[k]).ravel() for k in SHAPES])
        grads = {k: jnp.asarray(v) for k, v in split(problem.grad(flat, t)).items()}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return np.concatenate([np.asarray(params[k]).ravel() for k in SHAPES])


def nanogpt_groups(tensors: list[torch.Tensor], weight_decay: float) -> list[dict]:
    return [
        {"params": [t for t in tensors if t.dim() >= 2], "weight_decay": weight_decay},
        {"params": [t for t in tensors if t.dim() < 2], "weight_decay": 0.0},
    ]


TORCH_CASES = {
    "sgd": (optim.sgd(0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd-momentum": (
        optim.sgd(0.05, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    ),
    "sgd-nesterov": (
        optim.sgd(0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "sgd-weight-decay": (
        optim.sgd(0.05, momentum=0.5, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, weight_decay=0.1),
    ),
    "adam": (optim.adam(0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    "adam-l2": (
        optim.adam(0.01, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    "adamw": (optim.adamw(0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
    "adamw-strong": (
        optim.adamw(0.01, weight_decay=0.5),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.5),
    ),
    # nanoGPT's configure_optimizers: tensors of 2 or more dimensions decay, 1-D ones do not
    "sgd-no-decay-1d": (
        optim.sgd(0.05, momentum=0.5, weight_decay=0.1, exclude_from_weight_decay=["bias$"]),
        lambda p: torch.optim.SGD(nanogpt_groups(p, 0.1), lr=0.05, momentum=0.5),
    ),
    "adam-no-decay-1d": (
        optim.adam(0.01, weight_decay=0.1, exclude_from_weight_decay=["bias$"]),
        lambda p: torch.optim.Adam(nanogpt_groups(p, 0.1), lr=0.01),
    ),
    "adamw-no-decay-1d": (
        optim.adamw(0.01, weight_decay=0.5, exclude_from_weight_decay=["bias$"]),
        lambda p: torch.optim.AdamW(nanogpt_groups(p, 0.5), lr=0.01),
    ),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch(case):
    ours, theirs = TORCH_CASES[case]
    problem = Problem(seed=1)
    assert_allclose(run_ours(ours, problem), run_torch(theirs, problem), rtol=1e-5)


def _decay_mask() -> dict[str, bool]:
    return {name: not name.endswith("bias") for name in SHAPES}


def test_lamb_unclipped_matches_optax():
    # optax.lamb never clips the trust ratio; here it reaches ~25.
    ours = optim.lamb(
        0.01, weight_decay=0.1, max_trust_ratio=math.inf, exclude_from_weight_decay=["bias$"]
    )
    theirs = optax.lamb(0.01, weight_decay=0.1, mask=_decay_mask())
    problem = Problem(seed=2)
    assert_allclose(run_ours(ours, problem), run_optax(theirs, problem), rtol=1e-5)


def test_lamb_default_matches_optax_inside_the_bounds():
    # With the default clip at 10 the rules coincide while the ratio stays below it.
    ours = optim.lamb(0.001, weight_decay=0.1, exclude_from_weight_decay=["bias$"])
    theirs = optax.lamb(0.001, weight_decay=0.1, mask=_decay_mask())
    problem = Problem(seed=2)
    params, state = problem.p0.copy(), ours.init(problem.p0, SEGMENTS)
    for t in range(STEPS):
        ours.apply(problem.grad(params, t), state, params)
        assert state.trust_ratio.min() > 0.0 and state.trust_ratio.max() < 10.0
    assert_allclose(params, run_optax(theirs, problem), rtol=1e-5)


def test_adamw_matches_optax():
    problem = Problem(seed=3)
    ours = run_ours(optim.adamw(0.01, weight_decay=0.1), problem)
    assert_allclose(ours, run_optax(optax.adamw(0.01, weight_decay=0.1), problem), rtol=1e-5)


def test_lars_matches_optax():
    # optax's lars keeps the learning rate inside the velocity; with a constant rate
    # that is the same rule.
    ours = optim.lars(
        0.5,
        momentum=0.9,
        weight_decay=0.01,
        trust_coefficient=0.02,
        exclude_from_weight_decay=["bias"],
        exclude_from_adaptation=["^head"],
    )
    theirs = optax.lars(
        0.5,
        weight_decay=0.01,
        weight_decay_mask=_decay_mask(),
        trust_coefficient=0.02,
        trust_ratio_mask={name: not name.startswith("head") for name in SHAPES},
        momentum=0.9,
    )
    problem = Problem(seed=4)
    assert_allclose(run_ours(ours, problem), run_optax(theirs, problem), rtol=1e-5)


def test_chain_clip_lamb_matches_optax():
    ours = optim.chain(optim.clip_by_global_norm(1.0), optim.lamb(0.01, max_trust_ratio=math.inf))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.lamb(0.01))
    problem = Problem(seed=5)
    assert_allclose(run_ours(ours, problem), run_optax(theirs, problem), rtol=1e-5)


# --- schedules -----------------------------------------------------------------


def test_warmup_cosine_matches_optax():
    ours = optim.warmup_cosine(0.1, warmup=10, total=50, floor=0.01)
    theirs = optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 50, end_value=0.01)
    counts = np.arange(70)
    assert_allclose([ours(int(n)) for n in counts], np.asarray(theirs(counts)), rtol=1e-6)


def test_warmup_cosine_values():
    s = optim.warmup_cosine(2.0, warmup=4, total=14, floor=0.5)
    assert [s(n) for n in range(5)] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert s(9) == pytest.approx(1.25)  # halfway through the cosine: (2 + 0.5) / 2
    assert s(14) == s(15) == s(10**9) == 0.5
    no_warmup = optim.warmup_cosine(1.0, warmup=0, total=10)
    assert no_warmup(0) == 1.0 and no_warmup(10) == 0.0


def test_step_decay_matches_torch_steplr():
    sched = optim.step_decay(0.3, every=7, gamma=0.5)
    opt = torch.optim.SGD([torch.zeros(1)], lr=0.3)
    steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    for n in range(40):  # torch's lr for its n-th optimizer.step() is ours at count n
        assert sched(n) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        opt.step()
        steplr.step()


def test_constant():
    assert optim.constant(0.25)(0) == optim.constant(0.25)(123) == 0.25


def test_schedule_as_lr_matches_torch():
    problem = Problem(seed=6)
    ours = run_ours(optim.sgd(optim.step_decay(0.05, 10, 0.5), momentum=0.9), problem, steps=40)
    theirs = run_torch(
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        problem,
        steps=40,
        make_sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
    )
    assert_allclose(ours, theirs, rtol=1e-5)


def test_schedule_as_lr_matches_optax():
    problem = Problem(seed=7)
    ours = run_ours(optim.adam(optim.warmup_cosine(0.02, 10, 80, 0.001)), problem)
    sched = optax.warmup_cosine_decay_schedule(0.0, 0.02, 10, 80, 0.001)
    assert_allclose(ours, run_optax(optax.adam(sched), problem), rtol=1e-5)
