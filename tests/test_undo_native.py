"""The native undo of a speculative update (optim/undo_native.py) against the torch undo and
against the state before the update, element by element.

Tolerances are in ulps of the operands, not of the result: an inverse recovers an old moment
from ``m1 - (1-b1) g'``, which cancels when the old moment was small, so its absolute error
is set by the magnitudes that entered the subtraction. Per element, with ``u = 2**-23`` (an
fp32 ulp at 1; a rounding errs by at most ``u/2`` of its result):

* native vs torch: each rounds at most four times at those magnitudes (torch: the product,
  the subtraction, possibly fused or not, and the division; native: one to three), so they
  differ by at most ``2u`` of ``(|m1| + (1-b1)|g'|) / b1`` (likewise for ``v``, and
  ``|p1| + |p0|`` for the parameter). The bound is ``4u`` of it: twice that.
* undo(update(x)) vs x: the forward's roundings add as many again, bound ``8u``.

Both are far below what any test of training parity tolerates (1e-4 relative).
"""

from __future__ import annotations

import pytest
import torch

from stronghold_hf.optim import CPUAdam
from stronghold_hf.optim import cpu_adam as cpu_adam_module
from stronghold_hf.optim import undo_native
from stronghold_hf.speculation import undo_adamw_

NATIVE_ERROR = undo_native.native_undo_error()
pytestmark = pytest.mark.skipif(NATIVE_ERROR is not None, reason=f"native undo unavailable: {NATIVE_ERROR}")

U = 2.0**-23
LR = 1e-2
NUMEL = 70_001  # above the kernel's 65536-element threshold for threads, not a multiple of 16

# (name, betas, weight_decay, grad_mul, steps applied before the one undone)
CASES = [
    ("default", (0.9, 0.999), 0.1, 0.37, 3),
    ("no-decay", (0.9, 0.999), 0.0, 0.37, 3),
    ("unscaled", (0.9, 0.999), 0.1, 1.0, 3),
    ("small-betas", (0.3, 0.5), 0.1, 2.5, 3),  # the forward's other lerp branch (1 - b1 >= 0.5)
    ("beta1-0", (0.0, 0.999), 0.1, 0.37, 3),
    ("beta2-0", (0.9, 0.0), 0.1, 0.37, 3),
    ("both-0", (0.0, 0.0), 0.0, 0.37, 3),
    ("fresh", (0.9, 0.999), 0.1, 0.37, 0),  # the undone step was the state's first (t == 1)
]
GRAD_DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def two_threads():
    """The undo runs on the host worker with every core: split the work as it would be."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _stepped(betas, wd, grad_mul, steps, grad_dtype, *, kernel="native", seed=0):
    """A CPUAdam state after ``steps`` steps, and one more step with ``grad_mul``: returns the
    optimizer, the master, the gradient of the last step and the master and state before it."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(NUMEL, generator=gen)
    p[:5] = torch.tensor([0.0, 1e-30, -1e-20, 3e4, -7.5])  # zero, tiny, large magnitudes
    opt = CPUAdam([p], lr=LR, betas=betas, weight_decay=wd, kernel=kernel)
    p.grad_dtype = None  # the engine's bf16 host gradients sit on fp32 masters the same way
    for k in range(steps + 1):
        g = torch.randn(NUMEL, generator=gen).mul_(0.1 * (k + 1)).to(grad_dtype)
        g[:3] = 0.0  # a gradient of exactly 0 (AdamW's v then only decays)
        if k == steps:
            before = p.clone(), {key: t.clone() for key, t in opt.state[p].items()}
        p.grad = g
        opt.step(inv_loss_scale=grad_mul)
    return opt, p, g, before


def _hyper(betas, wd):
    return dict(lr=LR, betas=betas, eps=1e-8, weight_decay=wd)


def _undone(opt, p, g, hyper, grad_mul, kernel):
    q = p.clone()
    state = {key: t.clone() for key, t in opt.state[p].items()}
    undo_adamw_([q], [g], [state], hyper, grad_mul, kernel=kernel)
    return q, state


def _scales(p1, state1, g, betas, wd, grad_mul, p_other):
    """Per element, the magnitudes each inverse's roundings are relative to (module docstring)."""
    b1, b2 = betas
    gp = g.float() * grad_mul
    decay = 1.0 - LR * wd
    return {"param": (p1.abs() + p_other.abs()) / decay,
            "exp_avg": state1["exp_avg"].abs() + (1 - b1) * gp.abs(),  # divided by b1 after
            "exp_avg_sq": state1["exp_avg_sq"] + (1 - b2) * gp * gp}


def _assert_within(got, want, scale, ulps, what):
    err = (got - want).abs()
    bound = ulps * U * scale
    worst = (err / bound.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    assert bool((err <= bound).all()), f"{what}: {worst:.2f}x the bound of {ulps} ulps of the operands"


def _check_moments(state, betas, fresh, reference, scales, ulps, what):
    for key, beta in (("exp_avg", betas[0]), ("exp_avg_sq", betas[1])):
        if fresh or beta == 0.0:
            # Nothing to invert: a fresh state's moments were 0; a beta of 0 made them irrelevant.
            assert bool((state[key] == 0).all()), f"{what} {key}: not exactly 0"
        else:
            _assert_within(state[key], reference[key], scales[key] / beta, ulps, f"{what} {key}")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32-grad", "bf16-grad"])
@pytest.mark.parametrize("name,betas,wd,grad_mul,steps", CASES, ids=[c[0] for c in CASES])
def test_native_undo_matches_the_torch_undo(name, betas, wd, grad_mul, steps, grad_dtype):
    opt, p1, g, _ = _stepped(betas, wd, grad_mul, steps, grad_dtype)
    state1 = opt.state[p1]
    hyper = _hyper(betas, wd)
    p_nat, st_nat = _undone(opt, p1, g, hyper, grad_mul, "native")
    p_ref, st_ref = _undone(opt, p1, g, hyper, grad_mul, "torch")
    assert st_nat["step"].item() == st_ref["step"].item() == steps  # exactly one step back
    scales = _scales(p1, state1, g, betas, wd, grad_mul, p_ref)
    _assert_within(p_nat, p_ref, scales["param"], 4, "param")
    _check_moments(st_nat, betas, steps == 0, st_ref, scales, 4, "native vs torch")


@pytest.mark.parametrize("forward", ["native", "torch"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32-grad", "bf16-grad"])
@pytest.mark.parametrize("name,betas,wd,grad_mul,steps", CASES, ids=[c[0] for c in CASES])
def test_undo_of_an_update_recovers_the_state_before_it(name, betas, wd, grad_mul, steps, grad_dtype, forward):
    """undo(update(x)) == x to ulps of the operands, whichever kernel stepped; and at least as
    many elements come back bit for bit as through the torch undo."""
    if forward == "native" and cpu_adam_module.native_kernel_error() is not None:
        pytest.skip("CPUAdam's native kernel is unavailable")
    opt, p1, g, (p0, st0) = _stepped(betas, wd, grad_mul, steps, grad_dtype, kernel=forward)
    hyper = _hyper(betas, wd)
    p_nat, st_nat = _undone(opt, p1, g, hyper, grad_mul, "native")
    p_ref, st_ref = _undone(opt, p1, g, hyper, grad_mul, "torch")
    scales = _scales(p1, opt.state[p1], g, betas, wd, grad_mul, p0)
    _assert_within(p_nat, p0, scales["param"], 8, "param")
    assert st_nat["step"].item() == steps
    if steps == 0:
        _check_moments(st_nat, betas, True, None, scales, 8, "undo")
    else:
        _check_moments(st_nat, betas, False, st0, scales, 8, "undo")
    exact = [(p_nat == p0).sum().item(), (p_ref == p0).sum().item()]
    for key in ("exp_avg", "exp_avg_sq"):
        if steps:
            exact += [(st_nat[key] == st0[key]).sum().item(), (st_ref[key] == st0[key]).sum().item()]
    assert all(nat >= ref for nat, ref in zip(exact[::2], exact[1::2])), exact
    assert exact[0] >= 0.9 * NUMEL, exact  # the parameter rounds back onto its old fp32 value


def test_native_undo_is_independent_of_threads_and_grouping():
    """Elementwise math, one contiguous slice per thread: 1 or 2 threads, one call or one per
    tensor, the same bits (so a run's result does not depend on the worker's core count)."""
    betas, wd, grad_mul = (0.9, 0.999), 0.1, 0.37
    runs = []
    for threads, together in ((1, True), (2, True), (2, False)):
        torch.set_num_threads(threads)
        params, grads, states = [], [], []
        for seed in range(3):
            opt, p, g, _ = _stepped(betas, wd, grad_mul, 2, torch.bfloat16, seed=seed)
            params.append(p.detach().clone())
            grads.append(g)
            states.append({k: t.clone() for k, t in opt.state[p].items()})
        if together:
            undo_adamw_(params, grads, states, _hyper(betas, wd), grad_mul, kernel="native")
        else:
            for args in zip(params, grads, states):
                undo_adamw_(*map(lambda a: [a], args), _hyper(betas, wd), grad_mul, kernel="native")
        runs.append((params, states))
    for params, states in runs[1:]:
        for a, b in zip(params, runs[0][0]):
            assert torch.equal(a, b)
        for sa, sb in zip(states, runs[0][1]):
            assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_torch_undo_runs_when_the_native_library_is_unavailable(monkeypatch):
    class Unavailable:  # a NativeLibrary that could not be built
        def load(self):
            return None

        def error(self):
            return "RuntimeError: no C++ compiler found"

    betas, wd, grad_mul = (0.9, 0.999), 0.1, 0.37
    opt, p1, g, (p0, st0) = _stepped(betas, wd, grad_mul, 2, torch.bfloat16)
    p_ref, st_ref = _undone(opt, p1, g, _hyper(betas, wd), grad_mul, "torch")
    monkeypatch.setattr(undo_native, "_NATIVE", Unavailable())
    p_auto, st_auto = _undone(opt, p1, g, _hyper(betas, wd), grad_mul, "auto")
    assert torch.equal(p_auto, p_ref) and all(torch.equal(st_auto[k], st_ref[k]) for k in st_ref)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler.*kernel='torch'"):
        _undone(opt, p1, g, _hyper(betas, wd), grad_mul, "native")


def test_auto_leaves_a_layout_the_kernel_does_not_read_to_torch():
    """An fp16 gradient (no CPUAdam kernel reads one) is undone by torch, the rest natively."""
    betas, wd, grad_mul = (0.9, 0.999), 0.1, 0.37
    opt, p1, g, _ = _stepped(betas, wd, grad_mul, 2, torch.float32)
    g16 = g.to(torch.float16)
    states = [{k: t.clone() for k, t in opt.state[p1].items()} for _ in range(2)]
    params = [p1.clone(), p1.clone()]
    undo_adamw_(params, [g, g16], states, _hyper(betas, wd), grad_mul)
    q, st = _undone(opt, p1, g16, _hyper(betas, wd), grad_mul, "torch")
    assert torch.equal(params[1], q) and all(torch.equal(states[1][k], st[k]) for k in st)
    q, st = _undone(opt, p1, g, _hyper(betas, wd), grad_mul, "native")
    assert torch.equal(params[0], q) and all(torch.equal(states[0][k], st[k]) for k in st)
    with pytest.raises(ValueError, match="fp32 layout"):
        undo_adamw_([p1.clone()], [g16], [states[0]], _hyper(betas, wd), grad_mul, kernel="native")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32-grad", "bf16-grad"])
def test_the_step_tables_undo_is_the_same_undo(grad_dtype):
    """A missed speculation undoes from the cached table of the step it undoes
    (CPUAdam.undo_table): bit for bit what the undo that checks and addresses each tensor gives,
    and no table where the undo would read other tensors than the step did."""
    if cpu_adam_module.native_kernel_error() is not None:
        pytest.skip("CPUAdam's native kernel is unavailable")
    betas, wd, grad_mul = (0.9, 0.999), 0.1, 0.37
    opt, p1, g, _ = _stepped(betas, wd, grad_mul, 2, grad_dtype)
    hyper = _hyper(betas, wd)
    p_ref, st_ref = _undone(opt, p1, g, hyper, grad_mul, "native")
    assert opt.undo_table(0, lambda p: torch.zeros_like(g) if p is p1 else None) is None  # another gradient
    assert opt.undo_table(0, lambda p: None) is None  # the undo reads none of the step's tensors
    table = opt.undo_table(0, lambda p: p.grad)
    assert table is not None and opt.undo_table(0, lambda p: p.grad) is table  # made once
    undo_native.undo_adamw_table_(table, hyper, grad_mul)
    assert torch.equal(p1, p_ref)
    assert all(torch.equal(opt.state[p1][k], st_ref[k]) for k in st_ref)


REDO_CASES = [  # (name, betas, weight_decay, speculative grad_mul, redo's grad_mul, redo's lr, steps before)
    ("clipped", (0.9, 0.999), 0.1, 1.0, 0.37, LR, 3),
    ("rescaled-new-lr", (0.9, 0.999), 0.1, 0.5, 0.2, 2 * LR, 3),
    ("no-decay", (0.9, 0.999), 0.0, 1.0, 0.37, LR, 3),
    ("small-betas", (0.3, 0.5), 0.1, 2.5, 0.1, LR, 3),
    ("fresh", (0.9, 0.999), 0.1, 1.0, 0.37, LR, 0),
]


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=["no-image", "bf16-image", "fp16-image"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32-grad", "bf16-grad"])
@pytest.mark.parametrize("name,betas,wd,spec_mul,redo_mul,redo_lr,steps", REDO_CASES, ids=[c[0] for c in REDO_CASES])
def test_the_fused_rollback_and_redo_is_the_undo_then_the_step(name, betas, wd, spec_mul, redo_mul, redo_lr, steps,
                                                               grad_dtype, out_dtype):
    """A missed speculation's rollback and redo in one pass (CPUAdam.redo_groups) leaves the
    master, both moments, the step count and the compute-dtype image bit for bit where the
    table undo followed by the step leaves them, for a first step too, and with the redo at
    another coefficient and learning rate."""
    if cpu_adam_module.native_kernel_error() is not None:
        pytest.skip("CPUAdam's native kernel is unavailable")
    runs = []
    for fused in (False, True):
        opt, p1, g, _ = _stepped(betas, wd, spec_mul, steps, grad_dtype)  # the speculative step is the last
        image = None
        if out_dtype is not None:
            image = torch.empty(NUMEL, dtype=out_dtype)
            opt.register_copy_out(p1, image)
            p1.grad = g
            opt.step(inv_loss_scale=spec_mul)  # one more speculative step, now with the image
        spec_hyper = _hyper(betas, wd)
        opt.param_groups[0]["lr"] = redo_lr
        if fused:
            assert opt.redo_groups([0], [spec_hyper], spec_mul, clip_coef=redo_mul)
        else:
            undo_native.undo_adamw_table_(opt.undo_table(0, lambda p: p.grad), spec_hyper, spec_mul)
            opt.step_groups([0], clip_coef=redo_mul)
        runs.append((p1.clone(), {k: t.clone() for k, t in opt.state[p1].items()},
                     None if image is None else image.clone()))
    (p_ref, st_ref, im_ref), (p_got, st_got, im_got) = runs
    assert torch.equal(p_got, p_ref)
    assert all(torch.equal(st_got[k], st_ref[k]) for k in st_ref), [k for k in st_ref if not torch.equal(st_got[k], st_ref[k])]
    assert im_ref is None or torch.equal(im_got.view(torch.int16), im_ref.view(torch.int16))


def test_the_fused_redo_declines_what_it_cannot_do_exactly():
    """No cached step for the gradients the masters hold now (another gradient tensor), or a
    torch kernel: it returns False and changes nothing, and the caller undoes and steps apart."""
    if cpu_adam_module.native_kernel_error() is not None:
        pytest.skip("CPUAdam's native kernel is unavailable")
    opt, p1, g, _ = _stepped((0.9, 0.999), 0.1, 1.0, 2, torch.float32)
    before = p1.clone(), {k: t.clone() for k, t in opt.state[p1].items()}
    p1.grad = g.clone()  # the same values in another tensor: not the step's table
    assert not opt.redo_groups([0], [_hyper((0.9, 0.999), 0.1)], 1.0, clip_coef=0.5)
    assert torch.equal(p1, before[0]) and all(torch.equal(opt.state[p1][k], v) for k, v in before[1].items())
    torch_opt, q, gq, _ = _stepped((0.9, 0.999), 0.1, 1.0, 1, torch.float32, kernel="torch")
    assert not torch_opt.redo_groups([0], [_hyper((0.9, 0.999), 0.1)], 1.0, clip_coef=0.5)
