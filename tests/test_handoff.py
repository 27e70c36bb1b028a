"""`hqtflow handoff`: the optimum-habana / TGI-Gaudi command lines for hqtflow's artifacts.

No Gaudi here: the commands are parsed (shlex) and checked, never run. Every host path they name exists, every
container path lies in a `-v` mount of an existing host path, the QUANT_CONFIG they name parses in Neural
Compressor's FP8Config (and hqtflow's strict reader) and points at the artifact's rank files, the world size is
the artifact's, and the seeds' recipes give the seed READMEs' commands (script, flags, world size, QUANT_CONFIG).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT, need, run_cli

RECIPES = ROOT / "recipes"
CFG = ROOT / "quantization_config"
SEEDS = ROOT.parent / "shared" / "seeds"
COMMON = ["--text", None, "--limit", "4", "--max-length", "32", "--batch-size", "2"]


@pytest.fixture(scope="module")
def arts(tiny_llama, wiki_text, tmp_path_factory):
    """Real artifacts of the tiny Llama: a 2-rank measurement, its Gaudi2 scale files, it unified to 1; and an
    8-rank measurement (the 1-rank statistics written as 8 INC rank files, imported) unified to 2 and to 1."""
    from hqtflow.formats import measurement as mf

    base = tmp_path_factory.mktemp("handoff")
    common = [wiki_text if a is None else a for a in COMMON]
    steps = [
        ("measure", tiny_llama, "-o", base / "m2", "--tp", "2", "-c", CFG / "maxabs_measure.json", *common),
        ("measure", tiny_llama, "-o", base / "m1", *common),
        ("quantize", "-m", base / "m2", "-o", base / "s2", "--scales-only", "--scale-method", "maxabs_hw",
         "--scales-for", "gaudi2"),
        ("unify", "-g", "01", "-m", base / "m2", "-o", base / "m2to1"),
    ]
    for args in steps:
        r = run_cli(*args)
        assert r.exit_code == 0, r.output
    one = mf.read_measurement(base / "m1" / "measure_hooks_maxabs.json")
    dump = base / "dump8"
    dump.mkdir()
    for rank in range(8):
        mf.write_measurement(dump, f"measure_hooks_maxabs_{rank}_8", one.nodes, local_rank=rank, num_samples=one.num_samples)
    steps = [("import-hqt", dump, "-o", base / "m8", "--model", tiny_llama),
             ("unify", "-g", "0123", "4567", "-m", base / "m8", "-o", base / "m8to2"),
             ("unify", "-g", "01234567", "-m", base / "m8", "-o", base / "m8to1")]
    for args in steps:
        r = run_cli(*args)
        assert r.exit_code == 0, r.output
    return {p.name: p for p in base.iterdir()} | {"model": tiny_llama}


def handoff(*args, tmp: Path):
    script = tmp / "run.sh"
    r = run_cli("handoff", *args, "-o", script)
    assert r.exit_code == 0, r.output
    assert os.access(script, os.X_OK) and script.read_text().rstrip("\n") == r.stdout.rstrip("\n")
    return commands(script.read_text())


def commands(text: str) -> list[list[str]]:
    """The command lines of a script or README block (comments, cd and set lines dropped; `\\` joined)."""
    text = text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] not in ("cd", "set") and not re.match(r"^\w+=\S*$", line.strip()):
            out.append(words)
    return out


def split_env(words):
    env = {}
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        k, _, v = words[0].partition("=")
        env[k], words = v, words[1:]
    return env, words


def oh_parts(words):
    """optimum-habana: (env, world size, script, args)."""
    env, rest = split_env(words)
    assert rest[0] == "python"
    rest = rest[1:]
    world = 1
    if rest[0] == "../gaudi_spawn.py":
        assert rest[1] == "--use_deepspeed" and rest[2] == "--world_size"
        world, rest = int(rest[3]), rest[4:]
    return env, world, rest[0], rest[1:]


def docker_parts(words):
    """TGI-Gaudi docker run: (mounts {container: host}, env, flags, image, args)."""
    assert words[:2] == ["docker", "run"]
    mounts, env, flags, i = {}, {}, [], 2
    while not re.match(r"^[\w.-]+(/[\w.-]+)+:[\w.]+$", words[i]):
        w = words[i]
        if w == "-v":
            host, container = words[i + 1].split(":")[:2]
            mounts[container] = host
            i += 2
        elif w == "-e":
            k, _, v = words[i + 1].partition("=")
            env[k] = v
            i += 2
        elif w == "-p":
            flags.append(f"-p {words[i + 1]}")
            i += 2
        else:
            flags.append(w)
            i += 1
    return mounts, env, flags, words[i], words[i + 1:]


def host_of(container_path: str, mounts: dict) -> Path:
    """The host path a container path resolves to through the mounts (the deepest mount wins)."""
    best = max((c for c in mounts if container_path == c or container_path.startswith(c.rstrip("/") + "/")), key=len,
               default=None)
    assert best is not None, f"{container_path} lies in no -v mount {sorted(mounts)}"
    return Path(mounts[best]) / os.path.relpath(container_path, best)


def check_config(path: Path, inc, *, mode: str, files_base: Path | None, world: int, mapper=lambda p: Path(p)):
    """The QUANT_CONFIG parses in INC's FP8Config and hqtflow's reader, and its dump_stats_path names every rank's files."""
    from hqtflow.formats.quant_config import QuantConfig

    from neural_compressor.torch.algorithms.fp8_quant._quant_common.quant_config import Fp8cfg

    raw = json.loads(path.read_text())
    cfg = inc.FP8Config(**raw)  # optimum-habana's first step; it then tests .measure / .quantize (mode as written)
    assert cfg.mode == mode == raw["mode"] and (cfg.measure, cfg.quantize) == (mode == "MEASURE", mode == "QUANTIZE")
    QuantConfig.from_dict(raw)
    # INC's own parser, which FP8Config leaves to prepare()/convert() on the device (use_qdq: the CPU needs it)
    parsed = Fp8cfg.parse({**raw, "dump_stats_path": str(mapper(raw["dump_stats_path"])), "use_qdq": True}).cfg
    for key in ("seperate_measure_files", "row_parallel_linear_allreduce_quantization", "ignore_modules_wo_measures"):
        assert isinstance(raw.get(key, False), bool), key  # INC tests passed-through values for truth
    if files_base is not None:
        base = mapper(raw["dump_stats_path"])
        assert base == files_base and parsed["measure_file"].startswith(f"{base}_hooks_{raw['observer']}")
        suffixes = [""] if world == 1 else [f"_{r}_{world}" for r in range(world)]
        for s in suffixes:  # the files INC opens: named after the observer as written
            stem = f"{base}_hooks_{raw['observer']}{s}"
            assert Path(f"{stem}.npz").is_file() and Path(f"{stem}.json").is_file(), stem
        # no more ranks than the world size
        assert not Path(f"{base}_hooks_{raw['observer']}_{world}_{world}.json").exists()
    return raw


@pytest.mark.parametrize("name,world", [("m2", 2), ("s2", 2), ("m2to1", 1), ("m8", 8), ("m8to2", 2), ("m8to1", 1)])
def test_optimum_habana_paths_and_config(arts, name, world, inc, tmp_path):
    art = arts[name]
    [cmd] = handoff(art, "--to", "optimum-habana", tmp=tmp_path)
    env, w, script, args = oh_parts(cmd)
    assert w == world
    assert script == "run_generation.py"
    qc = Path(env["QUANT_CONFIG"])
    assert qc.is_absolute() and qc.is_file() and qc.parent.parent == tmp_path / "run"  # a copy beside the script
    raw = check_config(qc, inc, mode="QUANTIZE", files_base=art.resolve() / "measure", world=world)
    if name == "s2":  # scale files: used as they are
        assert raw["recalc_scales"] is False
        for r in range(2):
            assert (art / f"measure_hooks_maxabs_MAXABS_HW_{r}_2.npz").is_file()
    model = Path(args[args.index("--model_name_or_path") + 1])
    assert model.is_dir() and model.resolve() == arts["model"].resolve()
    for word in [*args, *env.values()]:  # every absolute path named exists
        if word.startswith("/"):
            assert Path(word).exists(), word


@pytest.mark.parametrize("name,world", [("m2", 2), ("s2", 2), ("m8to1", 1), ("m8", 8)])
def test_tgi_gaudi_mounts_and_config(arts, name, world, inc, tmp_path):
    art = arts[name]
    [cmd] = handoff(art, "--to", "tgi-gaudi", "--port", "8081", tmp=tmp_path)
    mounts, env, flags, image, args = docker_parts(cmd)
    assert image == "ghcr.io/huggingface/tgi-gaudi:2.0.1" and "-p 8081:80" in flags
    for host in mounts.values():
        assert Path(host).is_absolute() and Path(host).exists(), host
    assert Path(mounts["/usr/src/hqt_output"]) == art.resolve()
    qc = host_of(env["QUANT_CONFIG"], mounts)
    assert qc.is_file()
    check_config(qc, inc, mode="QUANTIZE", files_base=art.resolve() / "measure", world=world,
                 mapper=lambda p: host_of(p, mounts))
    assert host_of(args[args.index("--model-id") + 1], mounts).resolve() == arts["model"].resolve()
    assert ("--num-shard" in args) == (world > 1)
    if world > 1:
        assert args[args.index("--num-shard") + 1] == str(world) and args[args.index("--sharded") + 1] == "true"
        assert env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"
    assert "HUGGING_FACE_HUB_TOKEN" in env and env["HUGGING_FACE_HUB_TOKEN"] == ""  # passed through, never written
    assert json.loads((art / "quant_config.json").read_text())["dump_stats_path"].startswith(str(art.resolve()))


def test_measure_handoff_round_trip(arts, inc, tmp_path):
    """--mode measure: the Gaudi run dumps into DIR/hqt_output, which import-hqt reads back."""
    [cmd] = handoff(RECIPES / "llama2-70b-8x.yaml", "--to", "optimum-habana", "--mode", "measure", tmp=tmp_path)
    env, world, script, _ = oh_parts(cmd)
    assert (world, script) == (8, "run_lm_eval.py")
    raw = check_config(Path(env["QUANT_CONFIG"]), inc, mode="MEASURE", files_base=None, world=8)
    dump = Path(raw["dump_stats_path"])
    assert dump.parent == tmp_path / "run" / "hqt_output" and dump.parent.is_dir()
    text = (tmp_path / "run.sh").read_text()
    assert f"hqtflow import-hqt {tmp_path / 'run' / 'hqt_output'}" in text


def test_a_device_for_scales_of_hqtflow_stays_out_of_the_config_for_inc(arts, inc, tmp_path):
    """device_for_scales CPU/CUDA (hqtflow's --scales-for targets, which INC refuses) is dropped from the QUANT_CONFIG
    copy handed to INC, and the script says so; GAUDI2 is kept."""
    recipe = (RECIPES / "llama2-70b-8x.yaml").read_text().replace("../quantization_config/maxabs_measure.json", "m.json")
    (tmp_path / "r.yaml").write_text(recipe)
    for device, kept in (("CUDA", False), ("gaudi2", True)):
        (tmp_path / "m.json").write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs", "device_for_scales": device}))
        [cmd] = handoff(tmp_path / "r.yaml", "--to", "optimum-habana", "--mode", "measure", tmp=tmp_path)
        raw = check_config(Path(split_env(cmd)[0]["QUANT_CONFIG"]), inc, mode="MEASURE", files_base=None, world=8)
        assert ("device_for_scales" in raw) == kept and raw.get("device_for_scales", "GAUDI2") == "GAUDI2"
        note = f"# device_for_scales {device} is hqtflow's own target, which INC refuses: dropped"
        assert (note in (tmp_path / "run.sh").read_text()) == (not kept)


def test_two_handoffs_keep_their_own_configs(arts, tmp_path):
    """Scripts side by side (8 -> 1 and 8 -> 2, both maxabs_quant.json) each point at their own artifact."""
    paths = {}
    for name in ("m8to1", "m8to2"):
        script = tmp_path / f"{name}.sh"
        assert run_cli("handoff", RECIPES / "llama2-70b-8x.yaml", "-m", arts[name], "--to", "optimum-habana",
                       "-o", script).exit_code == 0
        [cmd] = commands(script.read_text())
        paths[name] = Path(split_env(cmd)[0]["QUANT_CONFIG"])
    assert paths["m8to1"] != paths["m8to2"]
    for name, qc in paths.items():
        assert json.loads(qc.read_text())["dump_stats_path"] == str(arts[name].resolve() / "measure")


def test_a_script_named_after_its_artifact_gets_a_folder_beside_it(arts, tmp_path):
    """`handoff out/s2 -o out/s2.sh` (reference.md's example): the default folder named after the script would be
    the artifact itself, which is never edited, so the configs go to `out/s2-handoff/`; the artifact is untouched."""
    import shutil

    art = tmp_path / "s2"
    shutil.copytree(arts["s2"], art)
    before = sorted(p.relative_to(art) for p in art.rglob("*"))
    r = run_cli("handoff", art, "--to", "optimum-habana", "-o", tmp_path / "s2.sh")
    assert r.exit_code == 0, r.output
    [cmd] = commands((tmp_path / "s2.sh").read_text())
    assert Path(split_env(cmd)[0]["QUANT_CONFIG"]).parent.parent == tmp_path / "s2-handoff"
    assert sorted(p.relative_to(art) for p in art.rglob("*")) == before


def seed_blocks(name: str) -> list[list[str]]:
    path = SEEDS / name
    need(path.is_file(), f"seed README {path} not found")
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)
    return [c for b in blocks for c in commands(b)]


def seed_oh(model: str, config: str, script: str, offload: bool = False) -> list[str]:
    found = [c for c in seed_blocks("optimum-habana-text-generation-readme.md")
             if c[0] == f"QUANT_CONFIG=./quantization_config/{config}" and script in c and model in c
             and ("--disk_offload" in c) == offload]
    assert len(found) == 1, (model, config, script, found)
    return found[0]


def substance_oh(words, *, model_dir: Path | None = None):
    env, world, script, args = oh_parts(words)
    config = env.pop("QUANT_CONFIG")
    path = Path(config) if Path(config).is_absolute() else model_dir / config
    mode = json.loads(path.read_text())["mode"].upper()
    i = args.index("--model_name_or_path")
    model, args = args[i + 1], args[:i] + args[i + 2:]
    return {"env": env, "world": world, "script": script, "args": sorted(args), "model": model,
            "config": Path(config).name, "mode": mode}


# (recipe, --mode, artifact fixture or None, seed: (model, config, script))
SEED_RUNS = [
    ("llama2-70b-8x", "measure", None, ("meta-llama/Llama-2-70b-hf", "maxabs_measure.json", "run_lm_eval.py")),
    ("llama2-70b-8x", "quantize", "m8", ("meta-llama/Llama-2-70b-hf", "maxabs_quant.json", "run_lm_eval.py")),
    ("llama2-70b-8x", "quantize", "m8to2", ("meta-llama/Llama-2-70b-hf", "maxabs_quant.json", "run_generation.py")),
    ("llama2-70b-8x", "quantize", "m8to1", ("meta-llama/Llama-2-70b-hf", "maxabs_quant.json", "run_generation.py")),
    ("mixtral-8x7b", "measure", None, ("mistralai/Mixtral-8x7B-v0.1", "maxabs_measure.json", "run_generation.py")),
    ("mixtral-8x7b", "quantize", "m2to1", ("mistralai/Mixtral-8x7B-v0.1", "maxabs_quant_mixtral.json", "run_generation.py")),
    ("falcon-180b-8x", "measure", None, ("tiiuae/falcon-180B", "maxabs_measure_include_outputs.json", "run_lm_eval.py")),
    ("falcon-180b-8x", "quantize", "m8", ("tiiuae/falcon-180B", "maxabs_quant.json", "run_generation.py")),
    ("phi-2", "measure", None, ("microsoft/phi-2", "maxabs_measure.json", "run_lm_eval.py")),
    ("phi-2", "quantize", "m2to1", ("microsoft/phi-2", "maxabs_quant_phi.json", "run_generation.py")),
]


@pytest.mark.parametrize("recipe,mode,artifact,seed", SEED_RUNS, ids=[f"{r}-{m}-{a}" for r, m, a, _ in SEED_RUNS])
def test_recipes_give_the_seed_commands(arts, recipe, mode, artifact, seed, tmp_path):
    args = ["-m", arts[artifact]] if artifact else []
    [cmd] = handoff(RECIPES / f"{recipe}.yaml", "--to", "optimum-habana", "--mode", mode, *args, tmp=tmp_path)
    ours = substance_oh(cmd)
    # m8to1: the seed's single-card quantize with disk offload (after unify -g 01234567)
    want = seed_oh(*seed, offload=artifact == "m8to1")
    if artifact == "m8to2":  # the seed's run_generation.py quantize example, on the 2 cards unify -g 0123 4567 made
        want = [w if w != "8" else "2" for w in want]
    theirs = substance_oh(want, model_dir=ROOT)
    assert ours == theirs


def test_recipe_tgi_gives_the_seed_docker_run(arts, tmp_path):
    blocks = [c for c in seed_blocks("tgi-gaudi-readme.md") if c[:2] == ["docker", "run"] and
              any(w.startswith("QUANT_CONFIG=") for w in c)]
    assert len(blocks) == 2
    for recipe, artifact, seed in (("llama2-70b-8x", "m8", blocks[1]), ("llama2-7b", "m2to1", blocks[0])):
        [cmd] = handoff(RECIPES / f"{recipe}.yaml", "--to", "tgi-gaudi", "-m", arts[artifact], tmp=tmp_path)
        ours, theirs = docker_parts(cmd), docker_parts(seed)
        assert sorted(ours[0]) == sorted(theirs[0])  # mounted at /data, /usr/src/quantization_config, /usr/src/hqt_output
        assert {k: v for k, v in ours[1].items() if k not in ("QUANT_CONFIG", "HUGGING_FACE_HUB_TOKEN")} == \
            {k: v for k, v in theirs[1].items() if k not in ("QUANT_CONFIG", "HUGGING_FACE_HUB_TOKEN")}
        assert ours[1]["QUANT_CONFIG"] == os.path.normpath("/usr/src/" + theirs[1]["QUANT_CONFIG"])
        assert ours[2:4] == theirs[2:4]  # flags, image

        def args(a):
            i = a.index("--model-id")
            return sorted(a[:i] + a[i + 2:])

        assert args(ours[4]) == args(theirs[4])
        raw = json.loads(host_of(ours[1]["QUANT_CONFIG"], ours[0]).read_text())
        assert raw["mode"] == json.loads((CFG / "maxabs_quant.json").read_text())["mode"]


def test_refusals(arts, tmp_path):
    def refused(args, message):
        r = run_cli("handoff", *args)
        assert r.exit_code in (2, 3), r.output  # usage/config or artifact
        assert message in r.stderr and "Traceback" not in r.output
        assert len(r.stderr.strip().splitlines()) == 1

    refused([tmp_path / "nope", "--to", "optimum-habana"], "does not exist")
    refused([arts["m2"], "--to", "gaudi-cloud"], "Unknown --to 'gaudi-cloud'")
    refused([arts["m2"], "--to", "tgi-gaudi", "-o", tmp_path], "not a directory")
    refused([arts["m2"], "--to", "tgi-gaudi", "--mode", "measure"], "TGI-Gaudi only serves")
    for port in ("0", "99999"):  # as serve's --port
        refused([arts["m2"], "--to", "tgi-gaudi", "--port", port, "--dir", tmp_path / "ports"],
                f"--port must be between 1 and 65535, not {port}")
    assert not (tmp_path / "ports").exists()
    refused([arts["m2"], "--to", "optimum-habana", "--world-size", "1"], "unify it first")
    refused([arts["m2"], "--to", "optimum-habana", "--mode", "bake"], "Unknown --mode")
    refused([RECIPES / "llama2-70b-8x.yaml", "--to", "optimum-habana"], "run `hqtflow measure --recipe")
    refused([arts["dump8"], "--to", "optimum-habana"], "import-hqt")
    # a rank's files missing (INC reads the .npz)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(arts["m8"], broken)
    (broken / "measure_hooks_maxabs_5_8.npz").unlink()
    refused([broken, "--to", "optimum-habana"], "rank(s) 5 are missing")
    # scale files made for the CPU are not for Gaudi
    r = run_cli("quantize", "-m", arts["m2to1"], "-o", tmp_path / "cpu", "--scales-only", "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    refused([tmp_path / "cpu", "--to", "tgi-gaudi"], "not Gaudi")
    # a recipe gaudi section without a script
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ngaudi:\n  measure: {args: --bf16}\n")
    refused([bad, "--to", "optimum-habana", "--mode", "measure"], "needs a `script`")
    assert not (Path.cwd() / "hqtflow-handoff").exists()  # a refusal writes nothing
    # a recorded model path not here (an older hqtflow recorded `../tiny` relative to where it ran) is no hub id to
    # pass on; a --model given is passed as it is (a path on the Gaudi host, or a hub id)
    import json

    old = tmp_path / "old"
    shutil.copytree(arts["m2to1"], old)
    manifest = json.loads((old / "hqtflow_manifest.json").read_text())
    manifest["data"]["model_path"] = "../no-such-tiny"
    (old / "hqtflow_manifest.json").write_text(json.dumps(manifest))
    r = run_cli("handoff", old, "--to", "tgi-gaudi", "--dir", tmp_path / "h")
    assert r.exit_code == 4 and "is a path that does not exist here" in r.stderr, r.output
    for given in ("org/model", "/data/llama-70b"):
        ok = run_cli("handoff", old, "--to", "tgi-gaudi", "--model", given, "--dir", tmp_path / "h")
        assert ok.exit_code == 0 and f"--model-id {given}" in ok.stdout, ok.output


def test_default_measure_names_run_lm_evals_output_and_fewer_cards_are_flagged(arts, tmp_path):
    """optimum-habana's run_lm_eval.py requires -o (its output file): the default measure command gives one. A recipe
    entry written for 8 cards, handed off for a measurement unified to 2, says its sizes are the 8-card ones."""
    [cmd] = handoff(RECIPES / "smollm2.yaml", "--to", "optimum-habana", "--mode", "measure", tmp=tmp_path)
    assert "run_lm_eval.py" in cmd and cmd[cmd.index("-o") + 1] == "acc_measure.txt", cmd
    handoff(RECIPES / "llama2-70b-8x.yaml", "-m", arts["m8to2"], "--to", "optimum-habana", tmp=tmp_path)
    assert "come from the recipe's 8-card run; on 2 card(s)" in (tmp_path / "run.sh").read_text()
    handoff(RECIPES / "llama2-70b-8x.yaml", "-m", arts["m8"], "--to", "optimum-habana", tmp=tmp_path)
    assert "card run" not in (tmp_path / "run.sh").read_text()


def test_inspect_per_rank_scales(arts):
    """Per-rank scales are of weight shards: no weight error, and no word of a source model it did not use."""
    r = run_cli("inspect", arts["s2"])
    assert r.exit_code == 0, r.output
    assert "(not computed: see the Note below)" in r.stdout
    assert "Note: weight error not computed: the scales of a 2-rank artifact are per weight shard" in r.stdout
    assert "weight error against" not in r.stdout and "unavailable" not in r.stdout


def test_recipe_and_measurement_must_share_the_model(arts, smollm2, wiki_text, tmp_path):
    """A recipe handed off with another model's measurement is refused in one sentence; with its own model's, a rank
    count other than the recipe's cards is noted, and the embedded model's name is written as its folder."""
    r = run_cli("handoff", RECIPES / "smollm2-3x.yaml", "-m", arts["m2"], "--to", "optimum-habana", "-o", tmp_path / "x.sh")
    assert r.exit_code == 3 and "not from recipe" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "x.sh").exists()
    m = tmp_path / "sm"
    r = run_cli("measure", "smollm2", "-o", m, "--text", wiki_text, "--limit", "1", "--max-length", "32")
    assert r.exit_code == 0, r.output
    [cmd] = handoff(RECIPES / "smollm2-3x.yaml", "-m", m, "--to", "optimum-habana", tmp=tmp_path)
    assert cmd[cmd.index("--model_name_or_path") + 1] == str(smollm2.resolve())
    assert "the artifact holds 1 rank(s), so this runs on 1 card(s); the recipe measures on 3" in (tmp_path / "run.sh").read_text()


def test_an_older_hqtflows_fingerprint_of_the_recipes_model_is_accepted(smollm2):
    """A measurement an hqtflow <= 0.4 made (its fingerprint sampled the weights: no scheme, no weights_sha256) is
    the recipe's model's when config and weight headers agree, as quantize accepts it; another model's is refused."""
    from types import SimpleNamespace

    from hqtflow import handoff, models
    from hqtflow.errors import ArtifactError

    current = models.fingerprint(smollm2)
    older = {k: v for k, v in current.items() if k not in ("scheme", "weights_sha256", "files_sha256")}
    handoff._check_measured_model(str(smollm2), SimpleNamespace(fingerprint=older, directory="m", model="x"), "r.yaml")
    other = dict(older, weights_header_sha256="0" * 64)
    with pytest.raises(ArtifactError, match="not from recipe r.yaml's model"):
        handoff._check_measured_model(str(smollm2), SimpleNamespace(fingerprint=other, directory="m", model="x"), "r.yaml")


def test_a_measurement_made_here_leaves_gaudi_attention_unquantized(arts, inc, tiny_llama, tmp_path):
    """hqtflow measures Hugging Face modeling code: Linear layers only. INC on Gaudi would replace optimum-habana's
    unmeasured attention modules (matmul_qk, k_cache ...) by ones that fail when called, so the QUANT_CONFIG handed
    off (and a scales artifact's own) sets ignore_modules_wo_measures; a Gaudi dump that measured them keeps the
    config's value."""
    from hqtflow.formats import measurement as mf

    for name in ("m1", "m2", "s2"):
        [cmd] = handoff(arts[name], "--to", "optimum-habana", tmp=tmp_path)
        raw = json.loads(Path(split_env(cmd)[0]["QUANT_CONFIG"]).read_text())
        assert raw["ignore_modules_wo_measures"] is True, name
        note = "# ignore_modules_wo_measures set true: the measurement has Linear layers only"
        assert (note in (tmp_path / "run.sh").read_text()) == (name != "s2")  # (s2's own config already sets it)
    assert json.loads((arts["s2"] / "quant_config.json").read_text())["ignore_modules_wo_measures"] is True
    one = mf.read_measurement(arts["m1"] / "measure_hooks_maxabs.json")
    q = one.nodes["model.layers.0.self_attn.q_proj"]
    nodes = {**one.nodes, "model.layers.0.self_attn.matmul_qk": q}  # as optimum-habana's Gaudi run names it
    dump = tmp_path / "dump"
    dump.mkdir()
    mf.write_measurement(dump, "measure_hooks_maxabs", nodes, local_rank=None, num_samples=one.num_samples)
    assert run_cli("import-hqt", dump, "-o", tmp_path / "gaudi", "--model", tiny_llama).exit_code == 0
    [cmd] = handoff(tmp_path / "gaudi", "--to", "optimum-habana", tmp=tmp_path)
    raw = check_config(Path(split_env(cmd)[0]["QUANT_CONFIG"]), inc, mode="QUANTIZE",
                       files_base=(tmp_path / "gaudi").resolve() / "measure", world=1)
    assert raw["ignore_modules_wo_measures"] is False
    assert "ignore_modules_wo_measures" not in (tmp_path / "run.sh").read_text()


def test_the_config_handed_to_inc_is_written_as_inc_reads_it(arts, inc, tiny_llama, wiki_text, tmp_path):
    """What hqtflow's reader takes kindly but INC does not: a mode or observer in another case (optimum-habana tests
    mode == "MEASURE"; INC names files after the observer as written), flags as text (INC tests them for truth),
    device_type (INC fails on text), an observer other than the measurement's, and scale methods INC lacks."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nname: r\nmodel: {tiny_llama}\ncards: 1\nconfig: m.json\nquant_config: q.json\n")
    (tmp_path / "m.json").write_text(json.dumps({"mode": "measure", "observer": "MAXABS", "device_type": "GAUDI2",
                                                 "seperate_measure_files": "false", "scale_method": "MAXABS_POW2"}))
    [cmd] = handoff(recipe, "--to", "optimum-habana", "--mode", "measure", tmp=tmp_path)
    raw = check_config(Path(split_env(cmd)[0]["QUANT_CONFIG"]), inc, mode="MEASURE", files_base=None, world=1)
    assert (raw["observer"], raw["scale_method"], raw["seperate_measure_files"]) == ("maxabs", "maxabs_pow2", False)
    assert "device_type" not in raw and "# device_type is detected by INC" in (tmp_path / "run.sh").read_text()

    pc = tmp_path / "pc"  # a per-channel measurement handed off with a QUANTIZE config whose observer is maxabs
    assert run_cli("measure", tiny_llama, "-o", pc, "-c", CFG / "maxabs_per_channel_measure.json",
                   *[wiki_text if a is None else a for a in COMMON]).exit_code == 0
    (tmp_path / "q.json").write_text(json.dumps({"mode": "QUANTIZE", "observer": "maxabs",
                                                 "scale_method": "act_maxabs_pow2_weights_pcs_opt_pow2"}))
    [cmd] = handoff(pc, "--recipe", recipe, "--to", "optimum-habana", tmp=tmp_path)
    raw = check_config(Path(split_env(cmd)[0]["QUANT_CONFIG"]), inc, mode="QUANTIZE",
                       files_base=pc.resolve() / "measure", world=1)
    assert raw["observer"] == "maxabs_per_channel"
    assert "# observer set to maxabs_per_channel, the measurement's" in (tmp_path / "run.sh").read_text()

    for method, why in (("fp8_dynamic", "is hqtflow's own"), ("smoothquant_opt", "Neural Compressor 3.10 does not have")):
        (tmp_path / "q.json").write_text(json.dumps({"mode": "QUANTIZE", "scale_method": method}))
        r = run_cli("handoff", arts["m1"], "--recipe", recipe, "--to", "optimum-habana", "-o", tmp_path / "x.sh")
        assert r.exit_code == 2 and why in r.stderr and "Traceback" not in r.output, r.output
        assert not (tmp_path / "x.sh").exists()
    (tmp_path / "m.json").write_text(json.dumps({"mode": "MEASURE", "scale_method": "fp8_dynamic"}))  # INC parses it
    r = run_cli("handoff", recipe, "--to", "optimum-habana", "--mode", "measure", "-o", tmp_path / "x.sh")
    assert r.exit_code == 2 and "fp8_dynamic is hqtflow's own" in r.stderr and not (tmp_path / "x.sh").exists()


def test_measure_handoff_of_a_measurement_keeps_its_own_config(tiny_llama, wiki_text, inc, tmp_path):
    """--mode measure of a measurement with no recipe hands off the MEASURE config it was made with (here per
    channel), not the bundled per-tensor one."""
    common = [wiki_text if a is None else a for a in COMMON]
    r = run_cli("measure", tiny_llama, "-o", tmp_path / "pc", "-c", CFG / "maxabs_per_channel_measure.json", *common)
    assert r.exit_code == 0, r.output
    [cmd] = handoff(tmp_path / "pc", "--to", "optimum-habana", "--mode", "measure", tmp=tmp_path)
    raw = check_config(Path(split_env(cmd)[0]["QUANT_CONFIG"]), inc, mode="MEASURE", files_base=None, world=1)
    assert raw["observer"] == "maxabs_per_channel"
