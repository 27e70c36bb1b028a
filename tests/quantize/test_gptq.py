"""GPTQ rounding (`measure --hessians`, `quantize --gptq`): the core against a float64 sequential reference and
round-to-nearest, the recorded Hessians against the inputs themselves, and the stages around them."""

import json

import pytest
import torch

from conftest import ROOT, refused_quantize, run_cli
from hqtflow.formats.artifact import read_manifest
from hqtflow.quantize.gptq import gptq_round
from hqtflow.scales import dequantize, quantize

CFG = ROOT / "quantization_config"


def _problem(out=48, n=40, tokens=400, seed=0):
    """A bf16 weight, inputs X [tokens, n] correlated as activations are (mostly a few directions, channels of
    unequal size), and their E[x xᵀ]."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, n, generator=g) * 0.05).bfloat16()
    low_rank = torch.randn(tokens, 6, generator=g) @ torch.randn(6, n, generator=g)
    x = (low_rank + 0.1 * torch.randn(tokens, n, generator=g)) * torch.linspace(0.2, 3.0, n)
    return w, x, x.t() @ x / tokens


def _scales(w):
    per_tensor = (w.float().abs().max() / 448).bfloat16()
    per_channel = (w.float().abs().amax(1) / 448).bfloat16()
    return per_tensor, per_channel


def _rtn(w, s):
    return dequantize(quantize(w, s.reshape(-1, 1) if s.numel() > 1 else s), s.reshape(-1, 1) if s.numel() > 1 else s,
                      torch.float32)


def _codes(w, s):
    return quantize(w, s.reshape(-1, 1) if s.numel() > 1 else s).view(torch.uint8)


def _sequential_reference(w, h, s, damp):
    """GPTQ as its defining recursion (OBQ's update, one column at a time, explicit inverse), in float64."""
    W, n = w.double().clone(), w.shape[1]
    H = h.double() + damp * h.double().diagonal().mean() * torch.eye(n, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    sc = s.double().reshape(-1).expand(w.shape[0])
    Q = torch.empty_like(W)
    for i in range(n):
        q = (W[:, i] / sc).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * sc
        Q[:, i] = q
        W[:, i + 1:] -= ((W[:, i] - q) / Hinv[i, i])[:, None] * Hinv[i, i + 1:][None, :]
        Hinv = Hinv - torch.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return Q


@pytest.mark.parametrize("per_channel", [False, True])
def test_diagonal_hessian_is_round_to_nearest(per_channel):
    w, _, _ = _problem()
    s = _scales(w)[per_channel]
    h = torch.diag(torch.rand(w.shape[1]) + 0.1)
    g = gptq_round(w, h, s)
    assert g.dtype == w.dtype and torch.equal(_codes(g, s), _codes(w, s))


@pytest.mark.parametrize("per_channel", [False, True])
def test_matches_sequential_reference(per_channel):
    w, _, h = _problem()
    s = _scales(w)[per_channel]
    ref = _sequential_reference(w, h, s, 0.01)
    ref_codes = quantize(ref.float(), s.float().reshape(-1, 1) if per_channel else s.float()).view(torch.uint8)
    for block in (7, 16, 128):  # blocks that do not divide the width, and one block for all
        codes = _codes(gptq_round(w, h, s, block=block, act_order=False), s)
        # float32 against float64: a column's error may land on the other side of a rounding boundary, rarely
        assert (codes != ref_codes).float().mean() < 0.01, block


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_on_grid_and_less_output_error(per_channel, act_order):
    w, x, h = _problem()
    s = _scales(w)[per_channel]
    g = gptq_round(w, h, s, act_order=act_order)
    # on the grid: quantizing GPTQ's weight with the same scale gives codes that dequantize to it exactly
    col = s.reshape(-1, 1) if per_channel else s
    assert torch.equal(dequantize(quantize(g, col), col, w.dtype), g)
    exact = x @ w.float().t()
    rtn_err = (x @ _rtn(w, s).t() - exact).norm()
    gptq_err = (x @ g.float().t() - exact).norm()
    assert gptq_err < 0.7 * rtn_err, (float(gptq_err), float(rtn_err))
    assert (_codes(g, s) != _codes(w, s)).any()


def test_unseen_inputs_round_to_nearest():
    w, _, h = _problem()
    s = _scales(w)[1]
    h[5, :] = h[:, 5] = 0  # input 5 never seen in calibration
    g = gptq_round(w, h, s)
    assert torch.isfinite(g.float()).all()
    assert torch.equal(_codes(g, s)[:, 5], _codes(w, s)[:, 5])


def test_saturates_at_fullscale():
    w, _, h = _problem()
    s = _scales(w)[0]
    g = gptq_round(w, h, s, fullscale=240.0)  # Gaudi 2's E4M3 range: no code beyond it
    assert (g.float() / s.float()).abs().max() <= 240


def test_recorder_is_mean_x_xT_of_unpadded_inputs(tiny_llama):
    from hqtflow import models
    from hqtflow.measure.hessians import HessianRecorder

    model = models.load_model(tiny_llama, "fp32")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    seen = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: seen.setdefault(n, []).append(a[0].detach().clone())) for n in names]
    rec = HessianRecorder(model, names)
    ids = torch.randint(5, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: not recorded
    with torch.inference_mode(), rec.batch(mask):
        model(input_ids=ids, attention_mask=mask)
    rec.close()
    for h in hooks:
        h.remove()
    mats = rec.matrices()
    layer = "model.layers.0"
    assert rec.owner[f"{layer}.self_attn.k_proj"] == rec.owner[f"{layer}.self_attn.v_proj"] == f"{layer}.self_attn.q_proj"
    assert rec.owner[f"{layer}.mlp.up_proj"] == f"{layer}.mlp.gate_proj"
    assert rec.owner[f"{layer}.mlp.down_proj"] == f"{layer}.mlp.down_proj"
    for n in names:
        x = seen[n][0]
        rows = x.reshape(-1, x.shape[-1])[mask.reshape(-1).bool()]
        assert rec.tokens[rec.owner[n]] == 15
        torch.testing.assert_close(mats[rec.owner[n]], rows.t() @ rows / 15, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("gptq") / "meas"
    r = run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "6", "--max-length", "64",
                "--hessians")
    assert r.exit_code == 0, r.output
    return out


def test_measure_writes_hessians(measured):
    from hqtflow.formats.hessians import read_hessians

    m = read_manifest(measured, "hqtflow.measurement")
    assert m.data["hessians"]["file"] == "hessians.safetensors" and "hessians.safetensors" in m.files
    hs = read_hessians(measured)
    h = hs.get("model.layers.1.mlp.down_proj", 128)
    assert h.shape == (128, 128) and torch.equal(h, h.t()) and torch.linalg.eigvalsh(h.double()).min() > -1e-6
    assert hs.modules["model.layers.1.self_attn.v_proj"] == "model.layers.1.self_attn.q_proj"
    assert "lm_head" in hs.modules  # measured (as its maxabs); quantize's default blocklist keeps it in bf16


def test_quantize_gptq_checkpoint(measured, tmp_path):
    import hqtflow
    from safetensors.torch import load_file

    for name, extra in (("rtn", ()), ("gptq", ("--gptq",))):
        r = run_cli("quantize", "-m", measured, "-o", tmp_path / name, "--scale-method", "fp8_dynamic", *extra)
        assert r.exit_code == 0, r.output
    rtn, gptq = (load_file(tmp_path / n / "model.safetensors") for n in ("rtn", "gptq"))
    scales = [k for k in rtn if k.endswith("weight_scale")]
    assert scales and all(torch.equal(rtn[k], gptq[k]) for k in scales)  # same scales, other codes
    changed = [k for k in rtn if k.endswith(".weight") and rtn[k].dtype == torch.float8_e4m3fn
               and not torch.equal(rtn[k].view(torch.uint8), gptq[k].view(torch.uint8))]
    assert len(changed) > 10
    assert read_manifest(tmp_path / "gptq", "hqtflow.checkpoint").data["weight_rounding"] == "gptq"
    assert read_manifest(tmp_path / "rtn", "hqtflow.checkpoint").data["weight_rounding"] == "nearest"
    r = run_cli("inspect", tmp_path / "gptq")
    assert r.exit_code == 0 and "weight_rounding: gptq" in r.stdout and "rounded by GPTQ" in r.stdout, r.output
    model, tok = hqtflow.load(tmp_path / "gptq")
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([tok.encode("The tower is tall.")])).logits).all()


def test_gptq_offload_equals_in_memory(measured, tmp_path, monkeypatch):
    from hqtflow.quantize import offload
    from test_offload import _assert_same_checkpoint

    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "mem", "--gptq")
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(offload, "QUANT_CHUNK_ELEMS", 1000)
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "off", "--gptq", "--disk-offload")
    assert r.exit_code == 0, r.output
    _assert_same_checkpoint(tmp_path / "mem", tmp_path / "off")


def test_gptq_refusals(measured, tiny_llama, wiki_text, tmp_path):
    plain = tmp_path / "plain"
    r = run_cli("measure", tiny_llama, "-o", plain, "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output
    refused_quantize(["-m", plain, "-o", tmp_path / "out", "--gptq"], "measure again with --hessians", tmp_path, 3)
    refused_quantize(["-m", measured, "-o", tmp_path / "out", "--gptq", "--scales-only"], "--scales-only", tmp_path, 2)
    refused_quantize(["-m", measured, "-o", tmp_path / "out", "--gptq", "--scale-method",
                      "smoothquant_weights_output_channel_maxabs_pow2"], "SmoothQuant", tmp_path, 2)
    r = run_cli("measure", tiny_llama, "-o", tmp_path / "tp", "--text", wiki_text, "--hessians", "--tp", "2")
    assert r.exit_code == 2 and "--tp 1" in r.stderr and not (tmp_path / "tp").exists()


def _hessian_file(path, tensors, meta):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("case", ["format", "version", "old-version", "odd-version", "map", "tokens", "shape", "dtype",
                                  "nan", "asymmetric", "covariance", "offsets", "nested-header"])
def test_hessian_file_refusals(tmp_path, case):
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.hessians import Hessians

    good = {"format": "hqtflow-hessians", "version": "1", "modules": json.dumps({"a": "a"}), "tokens": '{"a": 3}'}
    h = torch.eye(4)
    meta, tensors, width = dict(good), {"a": h}, 4
    if case == "format":
        meta["format"] = "something-else"
    elif case == "version":
        meta["version"] = "2"
    elif case == "map":
        meta["modules"] = json.dumps({"a": "b"})
    elif case == "shape":
        width = 8
    elif case == "old-version":
        meta["version"] = "0"
    elif case == "odd-version":
        meta["version"] = "\u00b9"  # a superscript one: isdigit(), yet no integer
    elif case == "tokens":
        meta["tokens"] = '{"a": -3}'
    elif case == "dtype":
        tensors = {"a": h.half()}
    elif case == "nan":
        tensors = {"a": h * float("nan")}
    elif case == "asymmetric":
        tensors = {"a": torch.triu(torch.ones(4, 4))}  # half of a second moment
    elif case == "covariance":
        tensors = {"a": torch.eye(4) + 2 * (torch.ones(4, 4) - torch.eye(4))}  # |h_ij| > sqrt(h_ii h_jj)
    path = _hessian_file(tmp_path / "hessians.safetensors", tensors, meta)
    if case == "offsets":  # a header this hqtflow's check passes but the safetensors library refuses
        from hqtflow.formats.safetensors_files import safetensors_header

        start, header = safetensors_header(path)
        header["a"]["data_offsets"] = [0, 4]
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + path.read_bytes()[start:])
    elif case == "nested-header":
        text = b"[" * 100000 + b"]" * 100000
        path.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(ArtifactError) as e:
        Hessians(path).get("a", width)
    assert str(e.value).count(".") >= 1 and "\n" not in str(e.value)
    if case == "version":
        assert "newer" in str(e.value)


def test_indefinite_hessian_refused(measured, tmp_path):
    """A Hessian file rewritten (manifest re-hashed, as a hostile copy would be) with a matrix that is not positive
    semi-definite: one sentence naming the module, exit 3, nothing written."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from hqtflow.formats.artifact import MANIFEST, sha256_file

    bad = tmp_path / "meas"
    shutil.copytree(measured, bad)
    path = bad / "hessians.safetensors"
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = json.loads(meta["modules"])["model.layers.0.mlp.down_proj"]
    n = tensors[key].shape[0]
    # every covariance within what its variances allow, yet far from positive semi-definite (eigenvalue 1 - 0.9 n)
    tensors[key] = 1.9 * torch.eye(n) - 0.9 * torch.ones(n, n)
    save_file(tensors, str(path), metadata=meta)
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["files"]["hessians.safetensors"] = sha256_file(path)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    r = run_cli("quantize", "-m", bad, "-o", tmp_path / "out", "--gptq")
    # (stderr also holds transformers' weight-loading bar: the model was loaded before the matrix was read)
    assert r.exit_code == 3 and "Traceback" not in r.output, r.output
    assert "down_proj is not positive semi-definite" in r.stderr.strip().splitlines()[-1]
    assert not [p for p in tmp_path.iterdir() if p.name not in ("meas",)]


def test_hessians_outside_the_manifest_refused(tiny_llama, wiki_text, measured, tmp_path):
    """A Hessian file the manifest does not list (copied in afterwards) is never read: refused, exit 3."""
    import shutil

    plain = tmp_path / "plain"
    r = run_cli("measure", tiny_llama, "-o", plain, "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output
    shutil.copyfile(measured / "hessians.safetensors", plain / "hessians.safetensors")
    refused_quantize(["-m", plain, "-o", tmp_path / "out", "--gptq"], "is not listed in the measurement's manifest",
                     tmp_path, 3)


def test_unify_one_rank_keeps_hessians(measured, tmp_path):
    from hqtflow.formats.hessians import read_hessians

    r = run_cli("unify", "-g", "0", "-m", measured, "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output
    assert read_manifest(tmp_path / "u", "hqtflow.measurement").data["hessians"]["matrices"] > 0
    a, b = read_hessians(measured), read_hessians(tmp_path / "u")
    assert torch.equal(a.get("model.layers.0.mlp.down_proj", 128), b.get("model.layers.0.mlp.down_proj", 128))
    r = run_cli("quantize", "-m", tmp_path / "u", "-o", tmp_path / "q", "--gptq")
    assert r.exit_code == 0, r.output
    r = run_cli("inspect", tmp_path / "u")
    assert r.exit_code == 0 and "Linears (quantize --gptq)" in r.stdout, r.output


@pytest.mark.parametrize("factor", [1e-40, 1e30])
def test_hessian_scale_does_not_matter(factor):
    """GPTQ depends on H only up to a constant factor: tiny (subnormal) and huge second moments give the same codes."""
    w, _, h = _problem()
    s = _scales(w)[1]
    assert torch.equal(_codes(gptq_round(w, h * factor, s), s), _codes(gptq_round(w, h, s), s))
