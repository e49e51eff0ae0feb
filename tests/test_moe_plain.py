"""The plain-expert MoE decode kernel (dsv4lab/kernels/moe_decode_plain.py): the kernel against its
reference under Triton's interpreter (CPU), the Experts plumbing that hands plain stacks to the
kernel slot, the install rule, and on the GPU the embedded model's decode with it against the
masked-loop reference."""
import pytest
import torch

import dsv4lab
from dsv4lab.kernels import dispatch, install
from dsv4lab.kernels.device import triton_importable
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.moe import Experts
from oracle_util import Counting, decode_logits, interp_check_result

BF16_UNIT = 2.0 ** -7
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_importable()), reason="needs CUDA + triton")


def test_interp_plain_moe_matches_reference():
    res = interp_check_result("moe_plain_interp_check.py")
    for case in ("f32", "f32_no_limit"):
        assert res[case]["rel"] <= 1e-5, (case, res[case])   # fp32: the summation order alone
    for case in ("bf16", "bf16_x_f32_w"):
        assert res[case]["rel"] <= BF16_UNIT, (case, res[case])   # bf16: a rounding flip at most
    for case in ("f32", "bf16", "bf16_x_f32_w", "f32_no_limit"):
        assert res[case]["deterministic"] and res[case]["dtype_ok"] and res[case]["shape_ok"], (case, res[case])
    assert res["f32"]["clamped"] and not res["f32_no_limit"]["clamped"]   # the clamp was reached and not
    assert "need [E, I, H], [E, I, H], [E, H, I]" in res["bad_shape_error"]


@pytest.fixture(scope="module")
def embedded():
    return dsv4lab.load(device="cpu", dtype=torch.float32, kernels=False, progress=False)


def test_plain_experts_hand_their_stacks_to_the_decode_kernel(embedded):
    m = embedded
    ids = torch.randint(2, m.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = decode_logits(m, ids, steps=5)
    kern = Counting(dispatch.moe_decode)   # on CPU: the plain reference through the kernel slot
    experts = [mod for mod in m.modules() if isinstance(mod, Experts)]
    try:
        for ex in experts:
            ex.kernel, ex.kernel_devices = kern, ("cpu", "cuda")
        got = decode_logits(m, ids, steps=5)
        w1, w3, w2 = experts[0].kernel_stacks(experts[0].stack())
        assert w1.shape == (experts[0].n_experts, m.config.moe_intermediate_size, m.config.hidden_size)
        assert w2.shape == (experts[0].n_experts, m.config.hidden_size, m.config.moe_intermediate_size)
        assert experts[0][1].w1.weight.data_ptr() == w1[1].data_ptr()   # views into the stack, no copy
        assert not experts[0].kernel_applies(torch.zeros(1, 4), experts[0].stack(), prefill=True)
    finally:
        for ex in experts:
            ex.kernel, ex.kernel_devices = None, Experts.kernel_devices
    assert kern.calls == 5 * len(experts)   # one call per MoE layer per decode step, none in prefill
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_install_gives_plain_experts_the_decode_kernel_only(embedded, monkeypatch):
    m = embedded
    monkeypatch.setattr(install, "_on_cuda", lambda t: t is not None)   # CPU weights pass for CUDA ones
    monkeypatch.setattr(install, "have_triton_cuda", lambda: True)
    try:
        install_kernels(m, "layers.0.mlp.experts")
        ex = m.layers[0].mlp.experts
        assert ex.kernel is dispatch.moe_decode and ex.prefill_kernel is None
        assert m.layers[1].mlp.experts.kernel is None   # the pattern matched one block
    finally:
        m.use_kernels(enable=False)


@pytest.mark.gpu
@gpu
def test_gpu_embedded_plain_moe_kernel_matches_masked_loop():
    from dsv4lab.kernels.moe_decode_plain import moe_decode_plain_triton
    from dsv4lab.kernels.moe_decode_ref import moe_decode_plain_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    for xdt, wdt, tol in ((torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, BF16_UNIT)):
        x = torch.randn(3, 7168, device="cuda", generator=g).to(xdt)
        w1 = (torch.randn(8, 3072, 7168, device="cuda", generator=g) * 7168 ** -0.5).to(wdt)
        w3 = (torch.randn(8, 3072, 7168, device="cuda", generator=g) * 7168 ** -0.5).to(wdt)
        w2 = (torch.randn(8, 7168, 3072, device="cuda", generator=g) * 3072 ** -0.5).to(wdt)
        ids = torch.stack([torch.randperm(8, device="cuda", generator=g)[:6] for _ in range(3)])
        wts = torch.rand(3, 6, device="cuda", generator=g)
        got = moe_decode_plain_triton(x, ids, wts, w1, w3, w2, 10.0)
        want = moe_decode_plain_ref(x, ids, wts, w1, w3, w2, 10.0)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
        assert torch.equal(got, moe_decode_plain_triton(x, ids, wts, w1, w3, w2, 10.0))
    m = dsv4lab.load(device="cuda", dtype=torch.float32, progress=False)   # kernels installed by load
    assert all(ex.kernel is dispatch.moe_decode for ex in m.modules() if isinstance(ex, Experts))
    ids = torch.randint(2, m.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5)).cuda()
    got = decode_logits(m, ids, steps=16)
    m.use_kernels(enable=False)
    ref = decode_logits(m, ids, steps=16)
    assert (got - ref).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
