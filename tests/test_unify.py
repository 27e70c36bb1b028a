"""`hqtflow unify`: group parsing, exact merge rules, and the proofs that a unified N-rank measurement equals the
1-rank one (weights bit for bit, activations within 1e-4 relative in float32: the all-reduce changes the order of
the row-parallel sums, nothing else)."""

import json
import shutil

import numpy as np
import pytest

from conftest import ROOT, SMOLLM2_TP3_CALIBRATION, run_cli
from hqtflow.errors import ConfigError, ProvenanceWarning
from hqtflow.formats.artifact import read_manifest
from hqtflow.unify import _concat, check_rank_order, parse_groups

RTOL = 1e-4
CFG = ROOT / "quantization_config"


# ---- groups ---------------------------------------------------------------------------------------
def test_group_forms():
    assert parse_groups(["0123", "4567"], 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_groups(["0-7"], 8) == [list(range(8))]
    assert parse_groups(["0,1,2,3", "4,5,6,7"], 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_groups(["0-15"], 16) == [list(range(16))]
    assert parse_groups(["8-15", "0-7"], 16) == [list(range(8, 16)), list(range(8))]
    assert parse_groups(["0", "1"], 2) == [[0], [1]]
    assert parse_groups(["0123 4567"], 8) == parse_groups(["0,1,2,3  4,5,6,7"], 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("groups, world, message", [
    (["012"], 4, "rank(s) 3 are missing"),
    (["0123", "3456"], 7, "rank(s) 3 appear more than once"),
    (["012", "34"], 5, "different sizes"),
    (["0-9"], 8, "rank(s) 8, 9 do not exist"),
    (["0x1"], 2, "not a list of ranks"),
    (["\u0660\u0661"], 2, "not a list of ranks"),  # Arabic-Indic digits: ranks are written 0-9
    (["\uff10-\uff11"], 2, "not a list of ranks"),  # full-width digits
    (["3-1"], 4, "runs backwards"),
    ([], 2, "No groups"),
    ([" "], 2, "No groups"),
    ([str(r) for r in range(12)], 12, "write ranks past 9 in a comma list, 8,9,10,11, or a range, 8-11"),
])
def test_bad_groups(groups, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_groups(groups, world)


def test_groups_must_be_consecutive_ranks_in_order():
    """Merged rank k runs the k-th slice of the fewer-card layout: `02 13` or `4567 0123` are refused (--force
    allows them for per-tensor statistics, and says so)."""
    assert check_rank_order([[0, 1], [2, 3]], ["01", "23"]) == []
    for tokens in (["02", "13"], ["4567", "0123"]):
        parsed = parse_groups(tokens, 8 if len(tokens[0]) == 4 else 4)
        with pytest.raises(ConfigError, match=r"not consecutive ranks in order \((0-1 2-3|0-3 4-7)\).*--force"):
            check_rank_order(parsed, tokens)
        with pytest.warns(ProvenanceWarning, match="--force: Groups"):
            assert check_rank_order(parsed, tokens, force=True) == [f"groups {' '.join(tokens)} out of rank order"]


def test_packed_shards_are_deinterleaved():
    # rank r holds [gate_r; up_r]; the full vector is [gate_0; gate_1; up_0; up_1]
    r0 = np.array([[1], [2], [10], [20]], dtype=np.float32)
    r1 = np.array([[3], [4], [30], [40]], dtype=np.float32)
    assert _concat([r0, r1], 2).flatten().tolist() == [1, 2, 3, 4, 10, 20, 30, 40]
    assert _concat([r0, r1], 1).flatten().tolist() == [1, 2, 10, 20, 3, 4, 30, 40]


# ---- proofs on a tiny model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def uneven_model(tiny_factory):
    """A model whose vocabulary (517 = 12 * 43 + 1) divides by no rank count: transformers shards lm_head unevenly
    (259 + 258 rows on 2 ranks, 173 + 173 + 171 on 3); its 12 heads divide by 1 to 4 ranks."""
    return tiny_factory("llama", hidden_size=96, intermediate_size=120, num_attention_heads=12, num_key_value_heads=12,
                        head_dim=8, vocab_size=517, dtype="float32")


@pytest.fixture(scope="module")
def runs(uneven_model, wiki_text, tmp_path_factory):
    """The same model (the uneven vocabulary's) and batches measured with --tp 1, 2 and 4 (float32), per tensor
    (outputs included) and per channel."""
    model = uneven_model
    base = tmp_path_factory.mktemp("unify")
    pc = base / "pc.json"
    pc.write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs_per_channel", "measure_exclude": "NONE"}))
    common = ["--text", wiki_text, "--limit", "4", "--max-length", "32", "--batch-size", "2", "--dtype", "fp32"]
    out = {}
    for name, cfg, tp in (("pt1", CFG / "maxabs_measure_include_outputs.json", 1),
                          ("pt2", CFG / "maxabs_measure_include_outputs.json", 2),
                          ("pt4", CFG / "maxabs_measure_include_outputs.json", 4),
                          ("pc1", pc, 1), ("pc2", pc, 2)):
        r = run_cli("measure", model, "-o", base / name, "-c", cfg, "--tp", str(tp), *common)
        assert r.exit_code == 0, r.output
        out[name] = base / name
    out["model"] = model
    return out


def nodes(path, stem):
    return json.loads((path / f"{stem}.json").read_text())["Nodes"]


def assert_equal_measurements(unified: dict, ref: dict):
    assert set(unified) == set(ref)
    for name, node in ref.items():
        u = unified[name]
        np.testing.assert_array_equal(u["params"]["weight"], node["params"]["weight"], err_msg=name)  # bit for bit
        for key in ("inputs", "outputs"):
            assert (key in u) == (key in node), f"{name} {key}"
            if key in node:
                np.testing.assert_allclose(u[key], node[key], rtol=RTOL, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_unify_two_ranks_equals_one(runs, tmp_path):
    r = run_cli("unify", "-g", "01", "-m", runs["pt2"], "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output
    assert_equal_measurements(nodes(tmp_path / "u", "measure_hooks_maxabs"), nodes(runs["pt1"], "measure_hooks_maxabs"))
    m = read_manifest(tmp_path / "u", "hqtflow.measurement")
    assert m.data["world_size"] == 1 and m.data["unified_from"]["groups"] == [[0, 1]]
    assert set(m.data["unified_from"]["files"]) == {"measure_hooks_maxabs_0_2.json", "measure_hooks_maxabs_1_2.json"}
    assert m.data["merge"]["row_parallel_outputs"].startswith("observed after the all-reduce")
    assert m.model == read_manifest(runs["pt1"], "hqtflow.measurement").model


@pytest.mark.slow
def test_unify_four_ranks_equals_one(runs, tmp_path):
    r = run_cli("unify", "-g", "0123", "-m", runs["pt4"], "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output
    assert_equal_measurements(nodes(tmp_path / "u", "measure_hooks_maxabs"), nodes(runs["pt1"], "measure_hooks_maxabs"))
    # 4 -> 2 cards, with HQT's spelling and the range form giving the same result
    assert run_cli("unify", "-g", "01", "23", "-m", runs["pt4"], "-o", tmp_path / "two").exit_code == 0
    assert run_cli("unify", "-g", "0-1", "-g", "2-3", "-m", runs["pt4"], "-o", tmp_path / "two_b").exit_code == 0
    for g in range(2):
        a, b = nodes(tmp_path / "two", f"measure_hooks_maxabs_{g}_2"), nodes(tmp_path / "two_b", f"measure_hooks_maxabs_{g}_2")
        assert a == b
    # and 4 -> 2 -> 1 equals 4 -> 1
    assert run_cli("unify", "-g", "01", "-m", tmp_path / "two", "-o", tmp_path / "one").exit_code == 0
    assert_equal_measurements(nodes(tmp_path / "one", "measure_hooks_maxabs"), nodes(runs["pt1"], "measure_hooks_maxabs"))


@pytest.mark.slow
def test_identity_groups_return_each_rank(runs, tmp_path):
    assert run_cli("unify", "-g", "0", "1", "-m", runs["pt2"], "-o", tmp_path / "same").exit_code == 0
    for r in range(2):
        assert nodes(tmp_path / "same", f"measure_hooks_maxabs_{r}_2") == nodes(runs["pt2"], f"measure_hooks_maxabs_{r}_2")
    # out of rank order with --force (per-tensor statistics): each merged rank is its group's, and the manifest says
    r = run_cli("unify", "-g", "1", "0", "--force", "-m", runs["pt2"], "-o", tmp_path / "swapped")
    assert r.exit_code == 0 and "--force: Groups 1 0 are not consecutive ranks in order" in r.stderr, r.output
    for r_new, r_old in ((0, 1), (1, 0)):
        assert nodes(tmp_path / "swapped", f"measure_hooks_maxabs_{r_new}_2") == nodes(runs["pt2"], f"measure_hooks_maxabs_{r_old}_2")
    assert read_manifest(tmp_path / "swapped", "hqtflow.measurement").data["forced"] == ["groups 1 0 out of rank order"]


@pytest.mark.slow
def test_per_channel_concatenation(runs, tmp_path):
    r = run_cli("unify", "-g", "01", "-m", runs["pc2"], "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output
    u = nodes(tmp_path / "u", "measure_hooks_maxabs_per_channel")
    ref = nodes(runs["pc1"], "measure_hooks_maxabs_per_channel")
    assert_equal_measurements(u, ref)
    # shapes: column weights and outputs concatenated, row inputs concatenated
    assert np.array(u["model.layers.0.self_attn.q_proj"]["params"]["weight"]).shape == (96, 1)  # 12 heads x 8
    assert np.array(u["model.layers.0.self_attn.q_proj"]["outputs"]).shape == (1, 96, 1)
    assert np.array(u["model.layers.0.mlp.down_proj"]["inputs"]).shape == (1, 120, 1)
    assert np.array(u["lm_head"]["params"]["weight"]).shape == (517, 1)  # 259 + 258 rows


# ---- foreign dumps, stray files, bad input ---------------------------------------------------------
@pytest.mark.slow
def test_foreign_dump_with_stray_files(runs, tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    for f in runs["pt2"].glob("measure_hooks_maxabs_*"):
        shutil.copy(f, dump)
    (dump / "measure_hooks_maxabs_MAXABS_POW2_0_2.json").write_text("{}")  # a scale file
    (dump / "backup_measure_01-01").mkdir()  # INC's backups
    # a foreign dump enters only through import-hqt
    r = run_cli("unify", "-g", "01", "-m", dump, "-o", tmp_path / "u")
    assert r.exit_code == 3 and "hqtflow import-hqt" in r.stderr and not (tmp_path / "u").exists(), r.output
    assert run_cli("import-hqt", dump, "-o", tmp_path / "imp").exit_code == 0
    r = run_cli("unify", "-g", "01", "-m", tmp_path / "imp", "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output
    assert_equal_measurements(nodes(tmp_path / "u", "measure_hooks_maxabs"), nodes(runs["pt1"], "measure_hooks_maxabs"))
    data = read_manifest(tmp_path / "u", "hqtflow.measurement").data
    assert data["unified_from"]["provenance_known"] is False and data["provenance_known"] is False
    # an earlier unify output of another world size beside them: ambiguous unless told
    shutil.copy(tmp_path / "u" / "measure_hooks_maxabs.json", dump / "measure_hooks_maxabs_0_1.json")
    r = run_cli("import-hqt", dump, "-o", tmp_path / "imp2")
    assert r.exit_code == 3 and "world sizes [1, 2]" in r.stderr and "--world-size" in r.stderr
    assert run_cli("import-hqt", dump, "-o", tmp_path / "imp2", "--world-size", "2").exit_code == 0
    assert read_manifest(tmp_path / "imp2", "hqtflow.measurement").data["world_size"] == 2
    # per-channel statistics of an imported dump (no recorded styles) need the plan
    pc = tmp_path / "pcdump"
    pc.mkdir()
    for f in runs["pc2"].glob("measure_hooks_*"):
        shutil.copy(f, pc)
    assert run_cli("import-hqt", pc, "-o", tmp_path / "pci").exit_code == 0
    r = run_cli("unify", "-g", "01", "-m", tmp_path / "pci", "-o", tmp_path / "pcu")
    assert r.exit_code == 3 and "--parallel-plan" in r.stderr and not (tmp_path / "pcu").exists()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({r"(q|k|v|gate|up)_proj$": "column", r"(o|down)_proj$": "row", "lm_head": "column"}))
    r = run_cli("unify", "-g", "01", "-m", tmp_path / "pci", "-o", tmp_path / "pcu", "--parallel-plan", plan)
    assert r.exit_code == 0, r.output
    u, ref = nodes(tmp_path / "pcu", "measure_hooks_maxabs_per_channel"), nodes(runs["pc1"], "measure_hooks_maxabs_per_channel")
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        np.testing.assert_array_equal(u[name]["params"]["weight"], ref[name]["params"]["weight"])


@pytest.mark.slow
def test_bad_input(runs, tmp_path):
    def refused(args, message, command="unify"):
        r = run_cli(command, *args, "-o", tmp_path / "out")
        assert r.exit_code in (2, 3), r.output  # a wrong group (usage) or a wrong artifact
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "out").exists()

    refused(["-g", "012", "-m", runs["pt2"]], "rank(s) 2 do not exist")
    refused(["-g", "1", "0", "-m", runs["pt2"]], "not consecutive ranks in order (0 1)")
    r = run_cli("unify", "-g", "1", "0", "--force", "-m", runs["pc2"], "-o", tmp_path / "out")  # warned, then refused
    assert r.exit_code == 2 and "concatenating the shards of groups out of rank order" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    refused(["-g", "0", "-m", runs["pt2"]], "rank(s) 1 are missing")
    refused(["-g", "01", "-m", tmp_path / "nope"], "does not exist")
    broken = tmp_path / "broken"
    shutil.copytree(runs["pt2"], broken)
    (broken / "measure_hooks_maxabs_1_2.json").write_text("{ nope")
    refused(["-g", "01", "-m", broken], "modified after it was written: measure_hooks_maxabs_1_2.json")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    shutil.copy(runs["pt2"] / "measure_hooks_maxabs_0_2.json", foreign)
    refused(["-g", "01", "-m", foreign], "hqtflow import-hqt")
    refused([foreign], "rank(s) 1 are missing", "import-hqt")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(foreign, corrupt)
    (corrupt / "measure_hooks_maxabs_1_2.json").write_text("[]")
    refused([corrupt], "is not an HQT measurement file", "import-hqt")


@pytest.mark.slow
def test_unified_files_load_in_neural_compressor(runs, tmp_path):
    from conftest import need

    try:
        from neural_compressor.torch.quantization import FP8Config, convert
    except Exception as e:  # noqa: BLE001
        need(False, f"neural_compressor does not import ({e})")
    import torch
    from transformers import AutoModelForCausalLM

    assert run_cli("unify", "-g", "01", "-m", runs["pt2"], "-o", tmp_path / "u").exit_code == 0
    model = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.bfloat16).eval()
    cfg = FP8Config(mode="QUANTIZE", scale_method="maxabs_pow2", use_qdq=True, observer="maxabs",
                    measure_exclude="NONE", dump_stats_path=str(tmp_path / "u" / "measure"))
    q = convert(model, cfg)
    stats = nodes(tmp_path / "u", "measure_hooks_maxabs")
    mod = q.get_submodule("model.layers.1.mlp.down_proj")
    raw = torch.tensor(stats["model.layers.1.mlp.down_proj"]["inputs"][0][0][0], dtype=torch.bfloat16) / 112
    assert float(mod.quant_input.scale) == 2.0 ** np.ceil(np.log2(raw.item()))
    with torch.inference_mode():
        assert torch.isfinite(q(torch.tensor([[1, 2, 3, 4]])).logits).all()


# ---- end to end on SmolLM2 --------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_three_ranks_unified_gives_the_same_checkpoint(smollm2, smollm2_tp3, data_dir, tmp_path):
    """measure --tp 3 -> unify -g 012 -> quantize -> generate equals measuring on one rank.

    Scales are identical except where a statistic lies within float32 reduction noise of a rounding boundary
    of the scale (a power of two for pow2 methods): those are listed, and their statistics differ by < RTOL."""
    import torch
    from safetensors import safe_open

    one = run_cli("measure", smollm2, "-o", tmp_path / "m1", "--text", data_dir / "wikitext2_valid.txt",
                  *SMOLLM2_TP3_CALIBRATION)  # as smollm2_tp3 measured on 3 ranks
    assert one.exit_code == 0, one.output
    assert run_cli("unify", "-g", "012", "-m", smollm2_tp3, "-o", tmp_path / "u").exit_code == 0
    ref = nodes(tmp_path / "m1", "measure_hooks_maxabs")
    uni = nodes(tmp_path / "u", "measure_hooks_maxabs")
    assert_equal_measurements(uni, ref)

    for src in ("m1", "u"):
        q = run_cli("quantize", "-m", tmp_path / src, "-o", tmp_path / f"fp8_{src}", "--scale-method", "maxabs_pow2")
        assert q.exit_code == 0, q.output
    with safe_open(tmp_path / "fp8_m1" / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "fp8_u" / "model.safetensors", "pt") as b:
        keys = [k for k in a.keys() if k.endswith("_scale")]
        differ = [k for k in keys if not torch.equal(a.get_tensor(k), b.get_tensor(k))]
    for k in differ:  # only input scales can differ, and only at a boundary the noise straddles
        assert k.endswith("input_scale"), k
        node = k.rsplit(".", 1)[0]
        x, y = ref[node]["inputs"][0][0][0], uni[node]["inputs"][0][0][0]
        assert abs(x - y) <= RTOL * abs(x), (k, x, y)
    assert len(differ) <= len(keys) // 50, differ
    g = run_cli("generate", tmp_path / "fp8_u", "-p", "The capital of France is", "--max-new-tokens", "6")
    g1 = run_cli("generate", tmp_path / "fp8_m1", "-p", "The capital of France is", "--max-new-tokens", "6")
    assert g.exit_code == 0 and g.stdout == g1.stdout and "Paris" in g.stdout


def test_nodes_on_some_ranks_are_unioned():
    """Experts under expert parallelism live on one rank each: union, not KeyError."""
    from pathlib import Path

    from hqtflow.formats.measurement import LoadedMeasurement, Measurement, NodeStats
    from hqtflow.unify import merge_group

    def stats(v):
        return NodeStats([np.array([[v]], dtype=np.float32)], [], {"weight": np.array([[v / 2]], dtype=np.float32)})

    r0 = Measurement({"attn": stats(1.0), "experts.0": stats(3.0)}, 0, 4, "DynamicRange")
    r1 = Measurement({"attn": stats(2.0), "experts.1": stats(5.0)}, 1, 4, "DynamicRange")
    src = LoadedMeasurement(Path("."), None, [r0, r1], ["a_0_2", "a_1_2"], 2)
    merged, _ = merge_group(src, [0, 1], {})
    assert set(merged) == {"attn", "experts.0", "experts.1"}
    assert merged["attn"].inputs[0][0, 0] == 2.0 and merged["experts.1"].params["weight"][0, 0] == 2.5


def test_import_of_optimum_habana_single_group_unify_output(tmp_path):
    """optimum-habana's unify_measurements.py writes `"LocalRank": -1` into the file of a single group
    (`unified_json["LocalRank"] = group_index if groups_num != 1 else -1`); INC itself writes -1 ranks as null.
    Such a file is a one-rank measurement, not a file claiming to be rank -1."""
    from hqtflow.formats.measurement import NodeStats, write_measurement

    dump = tmp_path / "unified"
    dump.mkdir()
    nodes = {"model.layers.0.mlp.up_proj": NodeStats([np.array([[3.5]], np.float32)], [],
                                                    {"weight": np.array([[0.25]], np.float32)})}
    write_measurement(dump, "measure_hooks_maxabs", nodes, local_rank=-1, num_samples=0, twins=(".json",))
    assert json.loads((dump / "measure_hooks_maxabs.json").read_text())["LocalRank"] == -1
    r = run_cli("import-hqt", dump, "-o", tmp_path / "imp")
    assert r.exit_code == 0, r.output
    r = run_cli("unify", "-g", "0", "-m", tmp_path / "imp", "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output


# ---- a vocabulary that does not divide by the rank count ---------------------------------------------
@pytest.fixture(scope="module")
def uneven(runs, uneven_model, wiki_text, tmp_path_factory):
    """uneven_model measured per tensor on 1 to 4 ranks, by rank count: `runs`' measurements, and 3 ranks."""
    three = tmp_path_factory.mktemp("uneven") / "tp3"
    r = run_cli("measure", uneven_model, "-o", three, "--tp", "3", "--text", wiki_text, "--limit", "2", "--max-length",
                "32", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    return {1: runs["pt1"], 2: runs["pt2"], 3: three, 4: runs["pt4"]}


def weight_scales(measurement, out):
    """quantize --scales-only with per-channel weight scales: per rank, {node: (weight scales, input scale)}."""
    cfg = out.parent / "pcs.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "act_maxabs_pow2_weights_pcs_maxabs_pow2"}))
    r = run_cli("quantize", "-m", measurement, "-o", out, "--scales-only", "-c", cfg, "--scales-for", "gaudi2")
    assert r.exit_code == 0, r.output
    files = sorted(out.glob("*_ACT_MAXABS_POW2_WEIGHTS_PCS_MAXABS_POW2*.json"))
    return [{k: (np.array(v["params"]["weight"]["0"]), v["inputs"][0])
             for k, v in json.loads(f.read_text())["Nodes"].items()} for f in files]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_scales_of_uneven_shards_are_the_true_slices(uneven, tp, tmp_path):
    """Each rank's per-channel weight scales of a column-parallel layer are the one-rank scales of the rows it held
    (rank r's rows start after the preceding ranks' recorded rows, not at r * its own row count)."""
    full = weight_scales(uneven[1], tmp_path / "one")[0]
    ranks = weight_scales(uneven[tp], tmp_path / "many")
    layers = read_manifest(uneven[tp], "hqtflow.measurement").data["ranks"]
    rows = [r["layers"]["lm_head"]["weight_shape"][0] for r in layers]
    assert len(set(rows)) > 1 and sum(rows) == 517
    for name in ("lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
        np.testing.assert_array_equal(np.concatenate([r[name][0] for r in ranks]), full[name][0], err_msg=name)


@pytest.mark.slow
def test_unified_uneven_shards_quantize_as_measured(uneven, tmp_path):
    """unify 4 -> 2 and 4 -> 1 of the uneven vocabulary record each merged rank's rows as the sum of its group's
    (130 + 130 and 130 + 127 of 517), and --scales-only gives each merged rank the scales of those rows: 4 -> 1
    equals a direct one-rank measurement's."""
    full = weight_scales(uneven[1], tmp_path / "ref")
    for groups in (["01", "23"], ["0123"]):
        out = tmp_path / "-".join(groups)
        r = run_cli("unify", "-g", *groups, "-m", uneven[4], "-o", out)
        assert r.exit_code == 0, r.output
        shapes = [r["layers"]["lm_head"]["weight_shape"] for r in
                  read_manifest(out, "hqtflow.measurement").data["ranks"]]
        assert shapes == ([[260, 96], [257, 96]] if len(groups) == 2 else [[517, 96]])
        ranks = weight_scales(out, tmp_path / f"s{len(groups)}")
        for name in ("lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):  # column-parallel
            np.testing.assert_array_equal(np.concatenate([r[name][0] for r in ranks]), full[0][name][0], err_msg=name)
    for name, (w, x) in full[0].items():  # 4 -> 1: every node
        np.testing.assert_array_equal(ranks[0][name][0], w, err_msg=name)
        assert ranks[0][name][1] == pytest.approx(x, rel=RTOL), name


@pytest.mark.slow
def test_rank_files_out_of_manifest_order_are_refused_everywhere(runs, tmp_path):
    """A manifest whose ranks list the files out of order is refused by every reader (the rank file's LocalRank is
    checked in formats.measurement), as unify refused it: scale files would otherwise be written for the wrong shard."""
    bad = tmp_path / "swapped"
    shutil.copytree(runs["pt2"], bad)
    manifest = json.loads((bad / "hqtflow_manifest.json").read_text())
    ranks = manifest["data"]["ranks"]
    ranks[0], ranks[1] = ranks[1], ranks[0]
    (bad / "hqtflow_manifest.json").write_text(json.dumps(manifest))
    for args in (["quantize", "-m", bad, "-o", tmp_path / "s", "--scales-only", "--scales-for", "gaudi2"],
                 ["inspect", bad], ["unify", "-g", "01", "-m", bad, "-o", tmp_path / "u"]):
        r = run_cli(*args)
        assert r.exit_code == 3 and "measure_hooks_maxabs_1_2.json says it is rank 1, not 0" in r.stderr, (args, r.output)
        assert "Traceback" not in r.output
    assert not (tmp_path / "s").exists() and not (tmp_path / "u").exists()


@pytest.mark.slow
def test_kv_fp8_of_a_multi_rank_measurement_says_why(runs, tmp_path):
    """A measurement on several ranks has no KV-cache statistics, nor its unification: --kv-cache fp8 says so (not
    that an older hqtflow wrote it)."""
    assert run_cli("unify", "-g", "01", "-m", runs["pt2"], "-o", tmp_path / "u").exit_code == 0
    r = run_cli("quantize", "-m", tmp_path / "u", "-o", tmp_path / "q", "--kv-cache", "fp8")
    assert r.exit_code == 3 and "a measurement on several ranks (and one unified from it) carries none; measure on " \
        "one rank (--tp 1)" in r.stderr, r.output


def test_expert_nodes_are_checked(tiny_factory, tmp_path):
    """Expert nodes are checked as the others are: against the model's experts (`import-hqt --model`: an expert 99 of
    a 4-expert model is refused), and between ranks (a 4-expert rank beside a 6-expert one: another model)."""
    from hqtflow.formats.measurement import NodeStats, write_measurement

    def dump(name, experts_by_rank):
        d = tmp_path / name
        d.mkdir()
        for r, experts in enumerate(experts_by_rank):
            names = ["model.layers.0.self_attn.q_proj"] + [f"model.layers.0.mlp.experts.{e}.{p}" for e in experts
                                                           for p in ("gate_up_proj", "down_proj")]
            nodes = {n: NodeStats([np.array([[1.0]], np.float32)], [], {"weight": np.array([[0.5]], np.float32)})
                     for n in names}
            stem = f"measure_hooks_maxabs_{r}_{len(experts_by_rank)}" if len(experts_by_rank) > 1 else "measure_hooks_maxabs"
            write_measurement(d, stem, nodes, local_rank=r if len(experts_by_rank) > 1 else None, num_samples=2,
                              twins=(".json",))
        return d

    mixtral = tiny_factory("mixtral")  # 4 experts
    r = run_cli("import-hqt", dump("ok", [range(4)]), "-o", tmp_path / "ok_i", "--model", mixtral)
    assert r.exit_code == 0, r.output
    r = run_cli("import-hqt", dump("e99", [[0, 99]]), "-o", tmp_path / "e99_i", "--model", mixtral)
    assert r.exit_code == 3 and "Node model.layers.0.mlp.experts.99.gate_up_proj of rank 0" in r.stderr, r.output
    r = run_cli("import-hqt", dump("ep", [[0, 1], [2, 3]]), "-o", tmp_path / "ep_i", "--model", mixtral)
    assert r.exit_code == 0, r.output  # expert parallelism: other experts on each rank
    mixed = dump("mixed", [range(4), range(6)])
    r = run_cli("import-hqt", mixed, "-o", tmp_path / "mixed_i")
    assert r.exit_code == 3 and "its expert nodes overlap rank 0's without being the same" in r.stderr, r.output
    assert not (tmp_path / "mixed_i").exists()
