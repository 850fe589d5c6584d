"""CPUAdam against torch.optim.AdamW, element by element, for both kernels.

References: ``AdamW(foreach=False)`` (the single-tensor reference math) at a tight rtol for
either kernel; ``AdamW(fused=True)`` bit for bit for the torch kernel, whose chunking,
copy-out and scratch paths must not change a bit; and, for the native kernel, itself: its
result must not depend on thread count, chunk boundaries, group layout or copy-out.
"""

from __future__ import annotations

import copy
import io
import threading
import warnings

import pytest
import torch

from stronghold_hf.optim import CPUAdam
from stronghold_hf.optim import cpu_adam as cpu_adam_module

NATIVE_ERROR = cpu_adam_module.native_kernel_error()
KERNELS = ["native", "torch"]  # "native" cases skip (see the fixture) where it cannot be built

# 0-d, 1 element, empty, not a multiple of 16 (vector tail), and one larger matrix.
SHAPES = [(), (1,), (0, 3), (17, 33), (1000, 37)]
STEPS = 20

# Fused vs single-tensor AdamW differ by a few ulps per step (the fused kernel computes the
# lerp with an fma and orders sqrt/div differently). rtol covers normal-sized entries; entries
# that pass near zero need an absolute floor, which 1e-7 (1e-4 * lr) gives without hiding a
# real bug: one wrong update is ~lr = 1e-3.
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(autouse=True)
def one_intra_op_thread(request):
    """Many tiny kernel calls: with 2 OpenMP threads on a shared 2-core box every call pays a
    fork/join that can wait a scheduler tick (20x slower tests under load). Tests that care
    about the multi-threaded split ask for it explicitly."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("kernel") == "native" and NATIVE_ERROR is not None:
        pytest.skip(f"native kernel unavailable: {NATIVE_ERROR}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_params(seed: int = 0, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def grads_for(params, step: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def two_groups(params):
    """Trainer-style decay / no-decay split, with different betas per group."""
    return [
        {"params": params[3:], "weight_decay": 0.1},
        {"params": params[:3], "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6},
    ]


def set_grads(params, grads, mul: float = 1.0):
    for p, g in zip(params, grads):
        p.grad = g * mul if mul != 1.0 else g.clone()


def assert_close(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=ATOL)


def assert_equal(actual, expected):
    for a, e in zip(actual, expected):
        assert torch.equal(a.detach(), e.detach())


def assert_state_equal(opt_a, params_a, opt_b, params_b):
    for pa, pb in zip(params_a, params_b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


# --- parity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_parity_with_torch_adamw(kernel):
    ours_p, ref_p = make_params(), make_params()
    ours = CPUAdam(two_groups(ours_p), lr=1e-3, kernel=kernel)
    assert ours.kernel == kernel
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-3, foreach=False)
    # Copy-out on one big parameter: it must not change the update.
    ours.register_copy_out(ours_p[4], torch.empty(SHAPES[4], dtype=torch.bfloat16))
    for step in range(STEPS):
        if step == 10:  # mid-run lr change, per group
            for opt in (ours, ref):
                opt.param_groups[0]["lr"] = 3e-4
                opt.param_groups[1]["lr"] = 2e-3
        grads = grads_for(ours_p, step)
        set_grads(ours_p, grads)
        set_grads(ref_p, grads)
        if step % 7 == 3:  # a parameter without a gradient is skipped, as in torch
            ours_p[3].grad = ref_p[3].grad = None
        ours.step()
        ref.step()
        assert_close(ours_p, ref_p)
    for p, q in zip(ours_p, ref_p):
        s, r = ours.state[p], ref.state[q]
        assert s["step"].dtype == torch.float32 and s["step"].dim() == 0 and torch.equal(s["step"], r["step"])
        torch.testing.assert_close(s["exp_avg"], r["exp_avg"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(s["exp_avg_sq"], r["exp_avg_sq"], rtol=RTOL, atol=1e-9)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk_numel", [1 << 19, 16, 48])
def test_torch_kernel_bit_identical_to_torch_fused(chunk_numel, threads):
    """Same kernel, same element order: the scaled path's chunks and scratch, and copy-out,
    change nothing (also with the kernel's work split over 2 OpenMP threads)."""
    torch.set_num_threads(threads)
    ours_p, ref_p = make_params(), make_params()
    ours = CPUAdam(two_groups(ours_p), kernel="torch", chunk_numel=chunk_numel)
    ref = torch.optim.AdamW(two_groups(ref_p), fused=True)
    for p in ours_p[1::2]:
        ours.register_copy_out(p, torch.empty(p.shape, dtype=torch.float16))
    for step in range(8):
        grads = grads_for(ours_p, step)
        set_grads(ours_p, grads)
        set_grads(ref_p, grads)
        clip = 0.5 if step % 2 else 1.0
        ours.step(clip_coef=clip)
        ref.grad_scale = torch.tensor(1.0 / clip) if clip != 1.0 else None  # GradScaler's hook
        ref.step()
    assert_equal(ours_p, ref_p)
    assert_state_equal(ours, ours_p, ref, ref_p)


@pytest.mark.skipif(NATIVE_ERROR is not None, reason=f"native kernel unavailable: {NATIVE_ERROR}")
def test_native_kernel_independent_of_threads_groups_and_copy_out():
    """Each element's rounding is the same wherever thread and tensor boundaries fall."""
    shapes = [(70_001,), *SHAPES, (300, 301)]  # > 64K elements so that 2 threads really split
    runs = []
    for threads, layout, copy_out in [(1, "one", False), (2, "one", False), (2, "each", True), (2, "two", True)]:
        torch.set_num_threads(threads)
        params = make_params(shapes=shapes)
        groups = {"one": [params], "each": [[p] for p in params], "two": [params[:3], params[3:]]}[layout]
        opt = CPUAdam([{"params": g} for g in groups], kernel="native")
        if copy_out:
            for p in params:
                opt.register_copy_out(p, torch.zeros(p.shape, dtype=torch.bfloat16))
        for step in range(5):
            set_grads(params, grads_for(params, step))
            opt.step(clip_coef=0.5 if step % 2 else 1.0)
        runs.append(params)
    for other in runs[1:]:
        assert_equal(other, runs[0])


# --- state_dict ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_state_dict_round_trip_continues_bit_identically(kernel):
    straight_p, first_p = make_params(), make_params()
    straight = CPUAdam(two_groups(straight_p), kernel=kernel)
    first = CPUAdam(two_groups(first_p), kernel=kernel)
    for step in range(10):
        grads = grads_for(straight_p, step)
        for params, opt in ((straight_p, straight), (first_p, first)):
            set_grads(params, grads)
            opt.step()
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed_p = clone_params(first_p)
    resumed = CPUAdam(two_groups(resumed_p), lr=5.0, weight_decay=0.5, kernel=kernel)  # overwritten by the load
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(10, 20):
        grads = grads_for(straight_p, step)
        for params, opt in ((straight_p, straight), (resumed_p, resumed)):
            set_grads(params, grads)
            opt.step()
    assert_equal(resumed_p, straight_p)
    assert_state_equal(resumed, resumed_p, straight, straight_p)
    assert resumed.param_groups[0]["lr"] == 1e-3 and resumed.param_groups[0]["weight_decay"] == 0.1


def test_loads_torch_adamw_state_dict():
    ours_p, ref_p = make_params(), make_params()
    ref = torch.optim.AdamW(ref_p, foreach=False)
    set_grads(ref_p, grads_for(ref_p, 0))
    ref.step()
    with torch.no_grad():
        for p, q in zip(ours_p, ref_p):
            p.copy_(q)
    ours = CPUAdam(ours_p)
    ours.load_state_dict(ref.state_dict())
    assert_state_equal(ours, ours_p, ref, ref_p)
    assert "copy_out" not in str(ours.state_dict().keys())


# --- threads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_concurrent_step_groups_equal_sequential(kernel):
    shapes = [(300_000,), (1000, 37), (17, 33), (200_001,)]
    seq_p, thr_p = make_params(shapes=shapes), make_params(shapes=shapes)
    seq = CPUAdam([{"params": [p], "lr": 1e-3 * (i + 1)} for i, p in enumerate(seq_p)], kernel=kernel)
    thr = CPUAdam([{"params": [p], "lr": 1e-3 * (i + 1)} for i, p in enumerate(thr_p)], kernel=kernel)
    seq.register_copy_out(seq_p[0], torch.empty(shapes[0], dtype=torch.bfloat16))  # same path
    thr.register_copy_out(thr_p[0], torch.empty(shapes[0], dtype=torch.bfloat16))
    barrier = threading.Barrier(len(shapes))
    errors: list[BaseException] = []

    def worker(gi: int, coef: float) -> None:
        try:
            barrier.wait()  # maximize overlap, including the first step's lazy state creation
            thr.step_groups([gi], clip_coef=coef)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    for step in range(4):
        grads = grads_for(seq_p, step)
        set_grads(seq_p, grads)
        set_grads(thr_p, grads)
        coef = 0.5 if step % 2 else 1.0  # exercise the per-thread scratch too
        seq.step(clip_coef=coef)
        threads = [threading.Thread(target=worker, args=(gi, coef)) for gi in range(len(shapes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    assert_equal(thr_p, seq_p)
    assert_state_equal(thr, thr_p, seq, seq_p)


def test_same_group_twice_at_once_is_refused():
    params = make_params()
    opt = CPUAdam(two_groups(params))
    opt._in_flight.add(0)  # as if another thread were inside step_groups([0])
    with pytest.raises(RuntimeError, match="another thread"):
        opt.step_groups([0, 1])
    assert opt._in_flight == {0}  # the refused call claimed nothing
    opt._in_flight.clear()
    with pytest.raises(ValueError, match="distinct"):
        opt.step_groups([1, 1])
    opt.step_groups([0, 1])


# --- clip coefficient, loss scale, found_inf ----------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("clip_coef", "inv_loss_scale"), [(0.37, 1.0), (1.0, 1.0 / 1024), (torch.tensor(0.5), 1.0 / 8)])
def test_clip_coef_and_inv_loss_scale(kernel, clip_coef, inv_loss_scale):
    loss_scale = 1.0 / inv_loss_scale  # a power of two, as GradScaler's: unscaling is exact
    ours_p, ref_p, fused_p = make_params(), make_params(), make_params()
    ours = CPUAdam(two_groups(ours_p), kernel=kernel, chunk_numel=512)
    ref = torch.optim.AdamW(two_groups(ref_p), foreach=False)
    if kernel == "torch":
        # torch's own path for a scaled gradient: the GradScaler attributes of fused AdamW.
        fused = torch.optim.AdamW(two_groups(fused_p), fused=True)
        fused.grad_scale = torch.tensor(1.0 / (float(clip_coef) * inv_loss_scale))
    else:
        # The native kernel multiplies: as if it were handed grad * clip_coef.
        fused = CPUAdam(two_groups(fused_p), kernel="native")
    for step in range(STEPS):
        grads = grads_for(ours_p, step)
        set_grads(ours_p, grads, mul=loss_scale)  # as a loss-scaled backward leaves them
        set_grads(fused_p, grads, mul=loss_scale if kernel == "torch" else float(clip_coef))
        set_grads(ref_p, grads, mul=float(clip_coef))  # what the step should see
        before = [p.grad.clone() for p in ours_p]
        ours.step(clip_coef=clip_coef, inv_loss_scale=inv_loss_scale)
        ref.step()
        fused.step()
        assert_equal([p.grad for p in ours_p], before)  # .grad is read-only for CPUAdam
    assert_close(ours_p, ref_p)
    assert_equal(ours_p, fused_p)
    assert_state_equal(ours, ours_p, fused, fused_p)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("found_inf", [True, torch.tensor(1.0)])
def test_found_inf_skips_the_step_entirely(kernel, found_inf):
    ours_p, ref_p = make_params(), make_params()
    ours = CPUAdam(two_groups(ours_p), kernel=kernel)
    # The reference never sees the skipped steps; same kernel, so results match bit for bit.
    ref = torch.optim.AdamW(two_groups(ref_p), fused=True) if kernel == "torch" else CPUAdam(two_groups(ref_p), kernel=kernel)
    dest = torch.zeros(SHAPES[3], dtype=torch.bfloat16)
    ours.register_copy_out(ours_p[3], dest)
    for step in range(6):
        grads = grads_for(ours_p, step)
        set_grads(ours_p, grads)
        set_grads(ref_p, grads)
        if step in (0, 3):  # a skipped step is as if step() was not called (GradScaler semantics)
            params_before, state_before = [p.detach().clone() for p in ours_p], copy.deepcopy(ours.state)
            dest_before = dest.clone()
            ours.step(clip_coef=0.5, found_inf=found_inf)
            assert_equal(ours_p, params_before)
            assert torch.equal(dest, dest_before)
            assert len(ours.state) == len(state_before)
            for p in ours_p:
                for k, v in state_before.get(p, {}).items():
                    assert torch.equal(ours.state[p][k], v)
            continue
        ours.step(found_inf=torch.tensor(0.0))
        ref.step()
    assert_equal(ours_p, ref_p)
    assert_state_equal(ours, ours_p, ref, ref_p)
    assert ours.state[ours_p[0]]["step"].item() == 4


# --- copy-out -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kernel", "chunk_numel"), [(k, 1 << 19) for k in KERNELS] + [("torch", 4096)])
def test_copy_out_equals_master_cast(dtype, kernel, chunk_numel):
    params = make_params(shapes=[*SHAPES, (70_001,)])  # the last one splits over 2 threads
    opt = CPUAdam(two_groups(params), kernel=kernel, chunk_numel=chunk_numel)
    # Destinations are views into one flat buffer, as a pinned staging buffer would be.
    flat = torch.full((sum(p.numel() for p in params),), float("nan"), dtype=dtype)
    dests, offset = [], 0
    for p in params:
        dests.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
        opt.register_copy_out(p, dests[-1])
    if kernel == "native":
        torch.set_num_threads(2)  # the native kernel's slices split the big tensor
    for step in range(6):
        set_grads(params, grads_for(params, step))
        opt.step(inv_loss_scale=0.5 if step % 2 else 1.0)
        for p, d in zip(params, dests):
            assert torch.equal(d, p.detach().to(dtype))
    # Casting edge cases: ties, overflow to inf, subnormals and signed zero round like torch.
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 70000.0, -1e-7, 3e-39, -0.0, 1e30, 6.1e-5])
    with torch.no_grad():
        params[3].view(-1)[: special.numel()] = special
        params[3].grad = torch.zeros_like(params[3])
    opt.param_groups[0]["lr"] = 0.0  # an update that leaves the values as they are
    opt.step_groups([0])
    assert torch.equal(dests[3], params[3].detach().to(dtype))
    opt.param_groups[0]["lr"] = 1e-3
    assert opt.unregister_copy_out(params[3]) is dests[3]
    frozen = dests[3].clone()
    set_grads(params, grads_for(params, 99))
    opt.step()
    assert torch.equal(dests[3], frozen) and not torch.equal(frozen, params[3].detach().to(dtype))
    assert opt.unregister_copy_out(params[3]) is None


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("clip_coef", [1.0, 0.5])
@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_gradients_step_exactly_like_their_fp32_widening(kernel, clip_coef, state_bits):
    """A host gradient kept in bf16 (StrongholdConfig.host_grads) is widened exactly, so the
    step equals the step on the same values held in fp32, bit for bit, copy-out included."""
    shapes = SHAPES + [(3000, 7)]  # 8-bit moments need 4096 elements or more
    ours, ref = make_params(shapes=shapes), make_params(shapes=shapes)
    opts = [CPUAdam(two_groups(ps), lr=1e-3, weight_decay=0.1, kernel=kernel, state_bits=state_bits)
            for ps in (ours, ref)]
    outs = [[torch.empty(p.shape, dtype=torch.bfloat16) for p in ps] for ps in (ours, ref)]
    for opt, ps, out in zip(opts, (ours, ref), outs):
        for p, d in zip(ps, out):
            opt.register_copy_out(p, d)
    for step in range(4):
        grads = [g.to(torch.bfloat16) for g in grads_for(ours, step)]
        for p, g in zip(ours, grads):
            p.grad_dtype = None  # as the engine does for its masters
            p.grad = g
        for p, g in zip(ref, grads):
            p.grad = g.float()
        for opt in opts:
            opt.step(clip_coef=clip_coef)
    assert_equal(ours, ref)
    assert_equal(outs[0], outs[1])
    assert_state_equal(opts[0], ours, opts[1], ref)


def test_copy_out_validation():
    params = make_params()
    opt = CPUAdam(params)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        opt.register_copy_out(params[3], torch.empty(SHAPES[3]))
    with pytest.raises(ValueError, match="shape"):
        opt.register_copy_out(params[3], torch.empty((33, 17), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no param group"):
        opt.register_copy_out(torch.zeros(3), torch.empty(3, dtype=torch.bfloat16))


# --- LR schedulers ------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["lambda", "linear"])
def test_lr_schedulers(kind, kernel):
    def sched(opt):
        if kind == "lambda":  # lr drops to zero after 3 steps: parameters must then freeze
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 3 else 0.0)
        return torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=5)

    ours_p, ref_p = make_params(), make_params()
    ours, ref = CPUAdam(two_groups(ours_p), kernel=kernel), torch.optim.AdamW(two_groups(ref_p), foreach=False)
    ours_s, ref_s = sched(ours), sched(ref)
    snapshots = []
    for step in range(8):
        grads = grads_for(ours_p, step)
        set_grads(ours_p, grads)
        set_grads(ref_p, grads)
        ours.step()
        ref.step()
        ours_s.step()
        ref_s.step()
        snapshots.append([p.detach().clone() for p in ours_p])
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_close(ours_p, ref_p)
    if kind == "lambda":
        assert_equal(snapshots[-1], snapshots[2])
    else:
        assert ours.param_groups[0]["lr"] == pytest.approx(1e-4)


# --- errors -------------------------------------------------------------------------------------


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="amsgrad=False"):
        CPUAdam(make_params(), amsgrad=True)
    with pytest.raises(ValueError, match="Negate the loss"):
        CPUAdam(make_params(), maximize=True)
    with pytest.raises(ValueError, match="not on the CPU.*master"):
        CPUAdam([torch.empty(4, device="meta")])
    with pytest.raises(ValueError, match="register_copy_out"):
        CPUAdam([torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([torch.zeros(4, 3).t()])
    with pytest.raises(ValueError, match="multiple of 16"):
        CPUAdam(make_params(), chunk_numel=100)
    with pytest.raises(ValueError, match="'auto', 'native' or 'torch'"):
        CPUAdam(make_params(), kernel="fast")
    opt = CPUAdam(make_params())
    with pytest.raises(ValueError, match="param group 1"):  # a bad group added later is rejected
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.float16)]})
    assert len(opt.param_groups) == 1
    params = make_params()
    opt = CPUAdam(params)
    set_grads(params, grads_for(params, 0))
    with pytest.raises(ValueError, match="found_inf"):
        opt.step(clip_coef=float("inf"))


def test_kernel_fallback(monkeypatch):
    class Unavailable:  # a NativeLibrary that could not be built
        def load(self):
            return None

        def error(self):
            return "RuntimeError: no C++ compiler found"

    monkeypatch.setattr(cpu_adam_module, "_NATIVE", Unavailable())
    monkeypatch.setattr(cpu_adam_module, "_fallback_warned", threading.Event())
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler.*kernel='torch'"):
        assert CPUAdam(make_params()).kernel == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not once per optimizer
        assert CPUAdam(make_params()).kernel == "torch"
    with pytest.raises(RuntimeError, match="unavailable"):
        CPUAdam(make_params(), kernel="native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_param_refused():
    with pytest.raises(ValueError, match="not on the CPU"):
        CPUAdam([torch.zeros(4, device="cuda")])


def test_closure_and_deepcopy():
    params = make_params()
    opt = CPUAdam(params)

    def closure():
        set_grads(params, grads_for(params, 0))
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0
    clone = copy.deepcopy(opt)  # runtime attributes (lock, copy-out map) are rebuilt
    clone.step()
    assert clone.kernel == opt.kernel
    assert copy.deepcopy(CPUAdam(make_params(), kernel="torch")).kernel == "torch"  # the choice survives a copy
