"""bf16 matmuls via the fp32 GEMM (hqtflow.bf16_matmul): the function of a bf16 GEMM, and only where it applies."""

import platform

import pytest
import torch
import torch.nn.functional as F

from hqtflow import bf16_matmul
from hqtflow.bf16_matmul import Bf16MatmulsViaFp32, bf16_matmuls_via_fp32


def _operands(seed=0, m=37, k=131, n=29):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16(),
            torch.randn(n, generator=g).bfloat16())


def test_bf16_matmuls_are_fp32_gemms_rounded_once():
    x, w, b = _operands()
    with Bf16MatmulsViaFp32():
        y = F.linear(x, w, b)
        outs = [x @ w.t(), torch.matmul(x, w.t()), x.matmul(w.t()), torch.mm(x, w.t()), x.mm(w.t()),
                torch.bmm(x[None], w.t()[None])[0], x[None].bmm(w.t()[None])[0]]
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).bfloat16())
    for o in outs:
        assert o.dtype == torch.bfloat16 and torch.equal(o, (x.float() @ w.float().t()).bfloat16())
    # the function of a bf16 GEMM: within bf16's rounding of the exact product (plus fp32 sums)
    exact = F.linear(x.double(), w.double(), b.double())
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-4).all()
    native = F.linear(x, w, b)
    assert ((native.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-4).all()


def test_other_tensors_and_ops_pass_through():
    x, w, b = _operands(1)
    fp32, fp32_mm = F.linear(x.float(), w.float(), b.float()), x.float() @ w.float().t()
    with Bf16MatmulsViaFp32():
        assert torch.equal(F.linear(x.float(), w.float(), b.float()), fp32)  # fp32: untouched
        mixed = torch.matmul(x.float(), w.float().t())
        assert mixed.dtype == torch.float32 and torch.equal(mixed, fp32_mm)
        s = x + x  # not a matmul
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        torch.mm(x, w.t(), out=out)  # an `out=` call keeps torch's own kernel
    assert torch.equal(s, x + x) and torch.equal(out, torch.mm(x, w.t()))


@pytest.mark.parametrize("flags,vendor,faster", [
    (("avx", "avx2", "f16c", "fma"), "GenuineIntel", True),                 # no native bf16: emulated
    (("avx", "avx2", "f16c", "fma"), "AuthenticAMD", True),
    (("avx2", "avx512_bf16", "avx512f"), "GenuineIntel", True),             # VDPBF16PS at a quarter of the FMA rate
    (("avx2", "avx512_bf16", "avx512f"), "AuthenticAMD", False),            # Zen 4/5: native bf16 is the faster
    (("amx_bf16", "amx_tile", "avx512_bf16", "avx512f"), "GenuineIntel", False),  # AMX
])
def test_where_the_fp32_gemm_is_faster(monkeypatch, flags, vendor, faster):
    from hqtflow import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: vendor)
    assert hardware.fp32_gemm_is_faster() is faster
    assert isinstance(bf16_matmuls_via_fp32(), Bf16MatmulsViaFp32) is faster


def test_cpu_vendor_is_read():
    from hqtflow import hardware

    vendor = hardware.cpu_vendor()
    assert isinstance(vendor, str) and vendor == vendor.strip()
    if platform.machine() == "x86_64":
        assert vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls"), vendor


def test_enabled_only_where_fp32_is_faster(monkeypatch):
    monkeypatch.setattr(bf16_matmul, "fp32_gemm_is_faster", lambda: False)
    assert not isinstance(bf16_matmuls_via_fp32(), Bf16MatmulsViaFp32)
    assert isinstance(bf16_matmuls_via_fp32(True), Bf16MatmulsViaFp32)
    monkeypatch.setattr(bf16_matmul, "fp32_gemm_is_faster", lambda: True)
    assert isinstance(bf16_matmuls_via_fp32(), Bf16MatmulsViaFp32)
    assert not isinstance(bf16_matmuls_via_fp32(False), Bf16MatmulsViaFp32)
