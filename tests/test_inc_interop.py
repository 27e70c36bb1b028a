"""Interop with Neural Compressor itself: INC's own `convert()` (CPU, `use_qdq=True`, `maxabs_pow2`) loads the
measurement files `hqtflow measure` wrote, derives its scales from hqtflow's statistics, and runs the model.

The artifact's `quant_config.json` is fed to INC as-is, except for what a CPU run must change (`scale_method`:
INC's default `maxabs_hw` has no hardware scale set off Gaudi; `use_qdq`: CPU has no FP8 GEMM) and the
`dump_stats_path` prefix, which points into a copy of the artifact because INC writes its scale files next to
the measurement.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from hqtflow.formats import measurement as mf
from hqtflow.measure.run import MeasureSettings, measure

F_E4M3 = 448.0  # float8_e4m3fn full scale (CPU)
BACKOFF_ACT, BACKOFF_W = 0.25, 0.5  # INC's maxabs backoffs


def pow2_scale(maxabs: float, backoff: float) -> float:
    """INC maxabs_pow2: 2**ceil(log2(maxabs / (F * backoff)))."""
    return 2.0 ** math.ceil(math.log2(maxabs / (F_E4M3 * backoff)))


def _measure(model_dir: Path, wiki_text: Path, out: Path, config: Path | None) -> Path:
    s = MeasureSettings(output=str(out), model=str(model_dir), config=str(config) if config else None,
                        text=(str(wiki_text),), limit=4, max_length=64, batch_size=2)
    return measure(s, show_progress=False)


@pytest.mark.parametrize("blocklist", [None, ["lm_head"]], ids=["all-linears", "lm_head-blocklisted"])
def test_inc_convert_accepts_hqtflow_measurement(inc, tiny_llama, wiki_text, tmp_path, blocklist):
    from transformers import AutoModelForCausalLM

    measure_cfg = None
    if blocklist:
        measure_cfg = tmp_path / "measure.json"
        measure_cfg.write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs", "method": "HOOKS",
                                           "blocklist": {"names": blocklist, "types": []}}))
    artifact = _measure(tiny_llama, wiki_text, tmp_path / "artifact", measure_cfg)
    before = {p.name: p.read_bytes() for p in artifact.iterdir()}

    # INC writes measure_hooks_maxabs_MAXABS_POW2.{json,npz} next to the measurement: work on a copy.
    work = tmp_path / "inc"
    shutil.copytree(artifact, work)
    inc_cfg = json.loads((work / "quant_config.json").read_text())
    assert inc_cfg["mode"] == "QUANTIZE"
    prefix = Path(inc_cfg["dump_stats_path"]).name
    assert prefix == "measure"
    inc_cfg.update(dump_stats_path=str(work / prefix), scale_method="maxabs_pow2", use_qdq=True)

    stats = mf.read_measurement(work / f"{prefix}_hooks_maxabs.json").nodes
    assert stats, "hqtflow measured nothing"

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if blocklist:
        assert "lm_head" not in stats
        assert set(stats) == linears - {"lm_head"}
    else:
        assert set(stats) == linears  # lm_head included
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 48))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.float()

    config = inc.FP8Config(**inc_cfg)
    assert config.mode == "QUANTIZE" and config.scale_method == "maxabs_pow2"
    qmodel = inc.convert(model, config)

    # INC read our .npz (no measurement of its own in QUANTIZE mode) and wrote its scale file next to it.
    scale_file = work / f"{prefix}_hooks_maxabs_MAXABS_POW2.json"
    assert scale_file.is_file(), sorted(p.name for p in work.iterdir())
    inc_scales = json.loads(scale_file.read_text())
    assert inc_scales["Mode"] == "Scale" and set(inc_scales["Nodes"]) == set(stats)

    patched = {n: m for n, m in qmodel.named_modules() if type(m).__name__ == "PatchedLinear"}
    assert set(patched) == set(stats), (sorted(set(stats) - set(patched)), sorted(set(patched) - set(stats)))
    if blocklist:
        assert type(qmodel.lm_head) is torch.nn.Linear  # left in bf16 by INC too

    for name, node in stats.items():
        mod = patched[name]
        maxabs_in = float(node.inputs[0].reshape(()))
        maxabs_w = float(node.params["weight"].reshape(()))
        assert maxabs_in > 0 and maxabs_w > 0, name
        want_in, want_w = pow2_scale(maxabs_in, BACKOFF_ACT), pow2_scale(maxabs_w, BACKOFF_W)
        # QDQ path: the input QuantDequant holds scale (dequantize) and scale_inv (quantize) as Python floats
        assert mod.quant_input.scale == want_in, (name, maxabs_in, mod.quant_input.scale, want_in)
        assert mod.quant_input.scale_inv == 1.0 / want_in, name
        assert mod.dequant_weights.scale == want_w, (name, maxabs_w, mod.dequant_weights.scale, want_w)
        assert mod.weight.dtype == torch.float8_e4m3fn
        assert inc_scales["Nodes"][name]["inputs"] == [want_in]
        assert inc_scales["Nodes"][name]["params"]["weight"] == want_w

    with torch.inference_mode():
        out = qmodel(input_ids=ids).logits.float()
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert not torch.equal(out, ref), "the converted model did not quantize anything"
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.1, f"FP8 QDQ logits are {rel:.3f} (relative L2) away from bf16"
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.99, cos

    # the artifact itself is untouched
    assert {p.name: p.read_bytes() for p in artifact.iterdir()} == before


def test_inc_converts_with_a_json_only_dump_brought_in_by_import_hqt(inc, tiny_llama, wiki_text, tmp_path):
    """A dump copied without its .npz, written with the legacy node key `input` (INC's fix_fields reads it as
    `inputs`), is brought in whole: import-hqt writes the .npz and module list INC reads, and INC's convert derives
    its scales from them. The measure config's device_for_scales CPU (hqtflow's own target, which INC refuses) stays
    out of the quant_config.json written for INC."""
    from conftest import run_cli
    from transformers import AutoModelForCausalLM

    cfg = tmp_path / "measure.json"
    cfg.write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs", "device_for_scales": "CPU"}))
    artifact = _measure(tiny_llama, wiki_text, tmp_path / "artifact", cfg)
    inc_cfg = json.loads((artifact / "quant_config.json").read_text())
    assert "device_for_scales" not in inc_cfg
    stem = "measure_hooks_maxabs"
    raw = json.loads((artifact / f"{stem}.json").read_text())
    raw["Nodes"] = {k: {("input" if key == "inputs" else key): v for key, v in n.items()} for k, n in raw["Nodes"].items()}
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / f"{stem}.json").write_text(json.dumps(raw))
    r = run_cli("import-hqt", dump, "-o", tmp_path / "imp", "--model", tiny_llama)
    assert r.exit_code == 0, r.output
    assert {f"{stem}{s}" for s in mf.RANK_FILES} <= {p.name for p in (tmp_path / "imp").iterdir()}
    stats = mf.read_measurement(artifact / f"{stem}.json").nodes
    imported = mf.read_measurement(tmp_path / "imp" / f"{stem}.json").nodes
    assert {k: n.to_json() for k, n in imported.items()} == {k: n.to_json() for k, n in stats.items()}

    work = tmp_path / "inc"
    shutil.copytree(tmp_path / "imp", work)
    inc_cfg.update(dump_stats_path=str(work / "measure"), scale_method="maxabs_pow2", use_qdq=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    qmodel = inc.convert(model, inc.FP8Config(**inc_cfg))
    patched = {n: m for n, m in qmodel.named_modules() if type(m).__name__ == "PatchedLinear"}
    assert set(patched) == set(stats)
    for name, node in stats.items():
        assert patched[name].quant_input.scale == pow2_scale(float(node.inputs[0].reshape(())), BACKOFF_ACT), name


@pytest.mark.parametrize("allowlist, blocklist", [
    ({"types": ["Linear"], "names": ["lm_head"]}, {"types": [], "names": []}),
    ({"types": ["Conv2d"], "names": [r"mlp\.(up|down)"]}, {"types": [], "names": []}),
    ({"types": [], "names": ["q_proj"]}, {"types": [], "names": []}),
    ({"types": ["Linear"], "names": []}, {"types": [], "names": ["self_attn"]}),
    ({"types": ["Conv2d"], "names": ["layers.0"]}, {"types": [], "names": ["down"]}),
    ({"types": [], "names": []}, {"types": ["Linear"], "names": []}),
])
def test_allow_and_block_lists_select_what_inc_selects(inc, allowlist, blocklist):
    """Module selection equals INC's own `should_quantize` (a non-empty allowlist admits a module by type OR by
    name; the blocklist then removes by type or name)."""
    from types import SimpleNamespace

    from neural_compressor.torch.algorithms.fp8_quant._core.utils import should_quantize

    from hqtflow.formats.quant_config import QuantConfig

    ours = QuantConfig.from_dict({"allowlist": allowlist, "blocklist": blocklist})
    theirs = SimpleNamespace(cfg={"mod_dict": {"Linear": "linear", "Conv2d": "linear"}, "allowlist": allowlist,
                                  "blocklist": blocklist, "dynamic_quantization": False})
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj",
             "model.layers.1.mlp.gate_proj", "lm_head"]
    for name in names:
        for type_name in ("Linear", "Conv2d"):
            assert ours.selects(name, type_name) == should_quantize(theirs, type_name, name), (name, type_name)
