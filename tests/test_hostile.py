"""Hostile inputs, table-driven, across every stage (issue #12).

Each case builds one hostile input in a fresh work directory from shared artifacts (a measurement and an FP8
checkpoint of the tiny random Llama, made once), runs the CLI, and asserts: a user-error exit code, one `Error: ...` sentence
on stderr containing the expected words, no traceback, no output directory, and the work directory (the output's
parent, which also holds every input the case made) exactly as it was: nothing written, nothing lost.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import struct

import numpy as np
import pytest
import torch

from conftest import run_cli
from hqtflow.errors import EXIT_CODES
from hqtflow.formats.artifact import MANIFEST, PARTIAL_MARKER, sha256_file

PID = os.getpid()  # partial dirs named after a live process: never cleaned away under a case's feet
STEM = "measure_hooks_maxabs"
NODE = "model.layers.0.self_attn.q_proj"
USER_EXIT_CODES = set(EXIT_CODES.values())
PROGRESS = re.compile(r"\d+%\|")


# ---- shared artifacts ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tiny_llama, wiki_text, tiny_kv, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    m, ck = tiny_kv  # shared with other modules: every case below damages a copy (Ctx.copy)
    f1, f2 = d / "f1", d / "f2"  # foreign (manifest-less) dumps: one rank, and the same statistics as two ranks
    f1.mkdir()
    f2.mkdir()
    shutil.copy(m / f"{STEM}.json", f1)
    raw = json.loads((m / f"{STEM}.json").read_text())
    for r in range(2):
        (f2 / f"{STEM}_{r}_2.json").write_text(json.dumps({**raw, "LocalRank": r}))
    for f in ("f1", "f2"):  # the same dumps brought in: what quantize and unify read
        r = run_cli("import-hqt", d / f, "-o", d / f"i{f[1]}", "--model", tiny_llama)
        assert r.exit_code == 0, r.output
    for out, target in (("s", "cpu"), ("g", "gaudi2")):  # scale files: for this machine, and for a Gaudi (handoff)
        r = run_cli("quantize", tiny_llama, "-m", m, "-o", d / out, "--scales-only", "--scales-for", target)
        assert r.exit_code == 0, r.output
    return {"model": tiny_llama, "text": wiki_text, "m": m, "ck": ck, "f1": f1, "f2": f2,
            "i1": d / "i1", "i2": d / "i2", "s": d / "s", "g": d / "g"}


class Ctx:
    def __init__(self, base, work):
        self.__dict__.update(base)
        self.w = work
        self.out = work / "out"
        self.keep = []

    def copy(self, key, name=None):
        dst = self.w / (name or key)
        shutil.copytree(getattr(self, key), dst)
        return dst

    def partial(self, key):
        return self.copy(key, f".{key}.partial-{PID}-x1")


# ---- helpers that make damage ------------------------------------------------------------------------------
def edit_json(path, fn):
    raw = json.loads(path.read_text())
    raw = fn(raw) or raw
    path.write_text(json.dumps(raw))


def rehash(d):
    """Rewrite the manifest's hashes, so the deeper checks (not the hash check) must catch the damage."""
    edit_json(d / MANIFEST, lambda m: m.update(files={k: sha256_file(d / k) for k in m["files"] if (d / k).is_file()}))
    return d


def edit_manifest(d, fn):
    edit_json(d / MANIFEST, fn)
    return d


def manifest(d, **changes):
    edit_json(d / MANIFEST, lambda m: m.update(changes))
    return d


def node(value, kind="inputs"):
    def fn(raw):
        n = raw["Nodes"][NODE]
        if kind == "params":
            n["params"]["weight"] = [[value]]
        else:
            n[kind] = [[[value]]]
    return fn


def stats(d, fn, name=f"{STEM}.json"):
    edit_json(d / name, fn)
    return d


def drop_node(raw):
    del raw["Nodes"][NODE]


def rename_node(raw, new="../../../../tmp/evil"):
    raw["Nodes"][new] = raw["Nodes"].pop(NODE)


DEEP = "[" * 200_000 + "]" * 200_000  # valid JSON (and YAML) nested past Python's recursion limit


def write(path, text):
    path.write_text(text)
    return path


def scale_node(d, value, key="inputs"):
    """Set the input scale (or with key="weight", the weight scale) of NODE in a scales artifact's scale file."""
    [f] = [p for p in d.glob(f"{STEM}_MAXABS_*.json")]
    edit_json(f, lambda r: r["Nodes"][NODE]["params"].update(weight=value) if key == "weight" else r["Nodes"][NODE].update(inputs=value))
    return d


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def tensors(d, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


def set_weight(value):
    def fn(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = value
    return fn


def set_last_weight(value):
    """The last element of a weight: past the bytes an older hqtflow's fingerprint sampled (its first 4 KB)."""
    def fn(t):
        t["model.layers.0.mlp.up_proj.weight"][-1, -1] = value
    return fn


def measured_on(c, model):
    """A copy of the measurement whose manifest records `model`'s fingerprint, as one made on it would."""
    from hqtflow.models import fingerprint

    return manifest(c.copy("m"), model=fingerprint(model))


def quantize_nan_model(c):
    model = tensors(c.copy("model"), set_last_weight(float("nan")))
    return ["quantize", model, "-m", measured_on(c, model), "-o", c.out]


def killed_quantize(c, name):
    """What a kill -9 during quantize leaves: weights and config, no tokenizer, no manifest."""
    d = c.copy("ck", name)
    for p in d.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens")) or p.name == MANIFEST:
            p.unlink()
    return d


def marked(d):
    (d / PARTIAL_MARKER).write_text("pid 1\n")
    return d


def npz(c, obj):
    d = c.w / "pk"
    d.mkdir()
    np.savez(d / f"{STEM}.npz", obj)
    return d


def wider_config(d):
    edit_json(d / "config.json", lambda cfg: cfg.update(intermediate_size=256))
    return d


def busy_port(c):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    c.keep.append(s)
    return s.getsockname()[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the cases: id -> (build(ctx) -> argv, expected words) --------------------------------------------------
def measure(model, c, *extra):
    return ["measure", model, "--text", c.text, "--limit", "2", "--max-length", "16", "-o", c.out, *extra]


def quantize(c, m, *extra):
    return ["quantize", c.model, "-m", m, "-o", c.out, *extra]


def unify(c, m, groups="01", *extra):
    return ["unify", "-g", groups, "-m", m, "-o", c.out, *extra]


def gen(ck):
    return ["generate", ck, "--max-new-tokens", "1"]


def bench(ck):
    return ["bench", ck, "--batch-sizes", "1", "--prompt-length", "4", "--decode-length", "2", "--runs", "1", "--warmup", "0"]


def serve(target, *extra):
    return ["serve", "fp8", target, "--port", str(free_port()), *extra]


CASES = {
    # measure
    "measure/nan weights": (lambda c: measure(tensors(c.copy("model"), set_weight(float("nan"))), c), "NaN or inf"),
    "measure/inf weights": (lambda c: measure(tensors(c.copy("model"), set_weight(float("inf"))), c), "NaN or inf"),
    "measure/truncated weights": (lambda c: (truncate(c.copy("model") / "model.safetensors"), measure(c.w / "model", c))[1],
                                  "is truncated"),
    "measure/garbage pickle weights": (lambda c: ((c.copy("model") / "model.safetensors").unlink(),
                                                  (c.w / "model" / "pytorch_model.bin").write_bytes(b"\xce" * 1000),
                                                  measure(c.w / "model", c) + ["--trust-pickle"])[2], "Cannot load the model"),
    "measure/garbage weights": (lambda c: ((c.copy("model") / "model.safetensors").write_bytes(b"\xff" * 64),
                                           measure(c.w / "model", c))[1], "not a readable safetensors file"),
    "measure/garbage weights, header offsets overlap": (lambda c: measure(overlapping_offsets(c.copy("model")), c),
                                                        "not a valid safetensors file"),
    "measure/-o is the model": (lambda c: measure(c.copy("model"), c)[:-1] + [c.w / "model", "--overwrite"],
                                "is the input"),
    "measure/-o inside the model": (lambda c: measure(c.copy("model"), c)[:-1] + [c.w / "model" / "sub"], "lies inside"),
    "measure/-o contains the model": (lambda c: measure(c.copy("model", "p/model"), c)[:-1] + [c.w / "p", "--overwrite"],
                                      "contains"),
    "measure/-o is the text": (lambda c: (shutil.copy(c.text, c.w / "t.txt"),
                                          ["measure", c.model, "--text", c.w / "t.txt", "-o", c.w / "t.txt", "--overwrite"])[1],
                               "is the input"),
    "measure/model is a partial dir": (lambda c: measure(c.partial("model"), c), "unfinished output"),
    "measure/model holds the partial marker": (lambda c: measure(marked(c.copy("model")), c), "unfinished output"),
    "measure/binary config.json": (lambda c: ((c.copy("model") / "config.json").write_bytes(b"\xff\xfe\x00"),
                                              measure(c.w / "model", c))[1], "Cannot read"),
    "measure/config.json a list": (lambda c: ((c.copy("model") / "config.json").write_text("[]"),
                                              measure(c.w / "model", c))[1], "not a JSON object"),
    "measure/generation_config.json not JSON": (lambda c: measure(bad_generation_config(c.copy("model")), c),
                                                "generation_config.json (JSONDecodeError)"),
    "measure/config field of the wrong type": (lambda c: measure(config(c.copy("model"), num_hidden_layers="two"), c),
                                               "num_hidden_layers is 'two'; it must be a positive integer"),
    "measure/num_hidden_layers 1e9": (  # refused before a billion layers are built (that ran for minutes, memory growing)
        lambda c: measure(config(c.copy("model"), num_hidden_layers=10**9), c), "num_hidden_layers is 1000000000"),
    "measure/config NaN": (lambda c: measure(config(c.copy("model"), rms_norm_eps=float("nan")), c),
                           "rms_norm_eps is not a finite number"),
    "measure/config infinity, nested": (lambda c: measure(config(c.copy("model"), rope_scaling={"factor": float("inf")}), c),
                                        "rope_scaling.factor is not a finite number"),
    "generate/config.json gone from an FP8 checkpoint": (lambda c: ((c.copy("ck") / "config.json").unlink(), gen(c.w / "ck"))[1],
                                                         "is incomplete: its config.json is missing"),
    "export/config.json gone from an FP8 checkpoint": (lambda c: ((c.copy("ck") / "config.json").unlink(), export(c, c.w / "ck"))[1],
                                                       "is incomplete: its config.json is missing"),
    "generate/config NaN, hashes rewritten": (lambda c: gen(rehash(config(c.copy("ck"), rms_norm_eps=float("nan")))),
                                              "rms_norm_eps is not a finite number"),
    "inspect/the artifact a symlink loop": (lambda c: (os.symlink("loop", c.w / "loop"), ["inspect", c.w / "loop"])[1],
                                            "is a symlink loop"),
    "generate/the checkpoint a symlink loop": (lambda c: (os.symlink("loop", c.w / "loop"), gen(c.w / "loop"))[1],
                                               "is a symlink loop"),
    "inspect/a file of the measurement a symlink loop": (lambda c: ["inspect", self_link(c.copy("m") / f"{STEM}.json")],
                                                         "symlink loop"),
    "quantize/a file of the measurement a symlink loop": (lambda c: quantize(c, self_link(c.copy("m") / f"{STEM}.json")),
                                                          "symlink loop"),
    "measure/num_attention_heads 0": (lambda c: measure(config(c.copy("model"), num_attention_heads=0), c),
                                      "num_attention_heads is 0; it must be a positive integer"),
    "measure/hidden_size a float": (lambda c: measure(config(c.copy("model"), hidden_size=64.5), c),
                                    "hidden_size is 64.5; it must be a positive integer"),
    "measure/binary text": (lambda c: ((c.w / "b.txt").write_bytes(b"\xff\xfe\x00\x81"),
                                       ["measure", c.model, "--text", c.w / "b.txt", "-o", c.out])[1], "not UTF-8"),
    "measure/--text a directory": (lambda c: ((c.w / "texts").mkdir(),
                                           ["measure", c.model, "--text", c.w / "texts", "-o", c.out])[1], "is a directory"),
    "measure/--text /dev/null": (lambda c: ["measure", c.model, "--text", "/dev/null", "-o", c.out], "not a regular file"),
    "measure/jsonl text not a string": (lambda c: ((c.w / "n.jsonl").write_text('{"text": 5}\n'),
                                                   ["measure", c.model, "--text", c.w / "n.jsonl", "-o", c.out])[1],
                                        "field 'text' is not a string"),
    "measure/--data-dir task file not JSON lines": (lambda c: measure(c.model, c, "--tasks", "piqa_local", "--data-dir",
                                                                      data_dir(c, "piqa.jsonl", "garbage\n")),
                                                    "line 1 is not a JSON object"),
    "measure/--text is a device": (lambda c: ["measure", c.model, "--text", "/dev/zero", "--limit", "2", "-o", c.out],
                                   "not a regular file"),
    "measure/dump_stats_path with a NUL byte": (lambda c: measure(c.model, c, "-c", write(c.w / "c.json", json.dumps(
        {"mode": "MEASURE", "observer": "maxabs", "dump_stats_path": "./x/a\u0000b"}))), "no NUL byte"),
    "measure/dump_stats_path too long": (lambda c: measure(c.model, c, "-c", write(c.w / "c.json", json.dumps(
        {"mode": "MEASURE", "observer": "maxabs", "dump_stats_path": "./x/" + "a" * 260}))), "at most 200 bytes"),
    "unify/-o a symlink loop": (lambda c: (os.symlink("loop", c.w / "loop"), unify(c, c.i2)[:-1] + [c.w / "loop" / "x"])[1],
                                "symlink loop"),
    "measure/--data-dir task file empty": (lambda c: measure(c.model, c, "--tasks", "piqa_local", "--data-dir",
                                                             data_dir(c, "piqa.jsonl", "")), "is empty"),
    # quantize
    "measure/config has a layer the weights lack": (
        lambda c: measure(edit_json_dir(c.copy("model"), lambda cfg: cfg.update(num_hidden_layers=cfg["num_hidden_layers"] + 1)), c),
        "but its weights hold 2 layer(s)"),
    "measure/config has fewer layers than the weights": (
        lambda c: measure(edit_json_dir(c.copy("model"), lambda cfg: cfg.update(num_hidden_layers=cfg["num_hidden_layers"] - 1)), c),
        "its config.json has no place for"),
    "measure/config's vocabulary disagrees with the weights": (
        lambda c: measure(edit_json_dir(c.copy("model"), lambda cfg: cfg.update(vocab_size=cfg["vocab_size"] - 8)), c),
        "config.json gives other shapes to"),
    "measure/config's rope type unknown": (
        lambda c: measure(config(c.copy("model"), rope_scaling={"rope_type": "nope", "factor": 2.0}), c), "KeyError"),
    "measure/seperate_measure_files false with --tp 2": (lambda c: measure(c.model, c, "--tp", "2", "-c", write(
        c.w / "s.json", json.dumps({"mode": "MEASURE", "seperate_measure_files": False}))), "makes INC read one unsuffixed file"),
    "quantize/--scales-only of 2 ranks, seperate_measure_files false": (lambda c: quantize(c, c.i2, "--scales-only", "-c", write(
        c.w / "s.json", json.dumps({"mode": "QUANTIZE", "seperate_measure_files": False}))), "this 2-rank run writes one file per rank"),
    "quantize/model fingerprint of a newer scheme": (
        lambda c: quantize(c, edit_manifest(c.copy("m"), lambda m: m["model"].update(scheme=99))),
        "fingerprint in scheme 99, which this hqtflow (scheme 2) cannot compare; upgrade hqtflow"),
    "quantize/negative statistic": (lambda c: quantize(c, rehash(stats(c.copy("i1"), node(-4.0)))), "negative input statistic"),
    "quantize/nan statistic": (lambda c: quantize(c, rehash(stats(c.copy("i1"), node(float("nan"))))), "non-finite input"),
    "quantize/inf weight statistic": (lambda c: quantize(c, rehash(stats(c.copy("i1"), node(float("inf"), "params")))),
                                      "non-finite weight"),
    "quantize/node path traversal": (lambda c: quantize(c, rehash(stats(c.copy("i1"), rename_node))), "not a module name"),
    "quantize/negative, hashes rewritten": (lambda c: quantize(c, rehash(stats(c.copy("m"), node(-0.03)))), "negative"),
    "quantize/manifest version 0": (lambda c: quantize(c, manifest(c.copy("m"), _version=0)), "schema version 0"),
    "quantize/manifest version '1'": (lambda c: quantize(c, manifest(c.copy("m"), _version="1")), "schema version '1'"),
    "quantize/manifest version 3": (lambda c: quantize(c, manifest(c.copy("m"), _version=3)), "newer hqtflow"),
    "quantize/manifest file outside": (lambda c: ((c.w / "x.json").write_text("{}"),
                                                  quantize(c, manifest(c.copy("m"), files={"../x.json": "0"})))[1],
                                       "outside itself"),
    "quantize/manifest stem outside": (lambda c: quantize(c, rehash_stem(c.copy("m"), "../../outside_dir/x")),
                                       "outside itself"),
    "quantize/manifest without files": (
        lambda c: quantize(c, edit_manifest(c.copy("m"), lambda m: {k: v for k, v in m.items() if k != "files"})), "corrupt"),
    "quantize/manifest lists no files": (lambda c: quantize(c, manifest(c.copy("m"), files={})), "corrupt"),
    "quantize/manifest data not an object": (lambda c: quantize(c, manifest(c.copy("m"), data=[])), "corrupt"),
    "quantize/ranks disagree with world size": (lambda c: quantize(c, edit_data(c.copy("m"), world_size=2)),
                                                "1 rank(s) for world size 2"),
    "quantize/-o is the measurement": (lambda c: quantize(c, c.copy("m"))[:-1] + [c.w / "m", "--overwrite"],
                                       "is the input"),
    "quantize/-o inside the measurement": (lambda c: quantize(c, c.copy("m"))[:-1] + [c.w / "m" / "x"], "lies inside"),
    "quantize/-o is the model": (lambda c: ["quantize", c.copy("model"), "-m", c.m, "-o", c.w / "model", "--overwrite"],
                                 "is the input"),
    "quantize/-o a dangling symlink": (lambda c: (os.symlink(c.w / "gone", c.w / "link"),
                                                  [*quantize(c, c.m)[:-1], c.w / "link"])[1], "already exists"),
    "quantize/measurement is a partial dir": (lambda c: quantize(c, c.partial("m")), "unfinished output"),
    "quantize/measurement holds the marker": (lambda c: quantize(c, marked(c.copy("m"))), "unfinished output"),
    "quantize/foreign partial dir": (lambda c: quantize(c, c.partial("f1")), "unfinished output"),
    "quantize/foreign dump": (lambda c: quantize(c, c.copy("f1")), "bring them in first with `hqtflow import-hqt"),
    "quantize/pickle-only dump": (lambda c: quantize(c, npz(c, {"x": 1})), "`hqtflow import-hqt"),
    "quantize/kv negative": (lambda c: quantize(c, rehash(kv(c.copy("m"), -1.0)), "--kv-cache", "fp8"), "negative"),
    "quantize/kv nan": (lambda c: quantize(c, rehash(kv(c.copy("m"), float("nan"))), "--kv-cache", "fp8"), "not finite"),
    "quantize/kv overflows float32": (lambda c: quantize(c, rehash(kv(c.copy("m"), 1e39)), "--kv-cache", "fp8"),
                                      "not finite float32"),
    "quantize/kv gives a scale no reader takes": (lambda c: quantize(c, rehash(kv(c.copy("m"), 1e38)), "--kv-cache", "fp8"),
                                                  "a reader takes at most 5.93e+33"),
    "quantize/kv lacks a layer": (lambda c: quantize(c, rehash(kv_drop(c.copy("m"), "model.layers.1.self_attn")),
                                                     "--kv-cache", "fp8"), "lack 1 attention module"),
    "quantize/statistic a string": (lambda c: quantize(c, rehash(stats(c.copy("i1"), node("3.4")))), "other than numbers"),
    "quantize/statistic a boolean": (lambda c: quantize(c, rehash(stats(c.copy("i1"), node(True)))), "other than numbers"),
    "quantize/NumSamples negative": (lambda c: quantize(c, rehash(stats(c.copy("i1"), lambda r: r.update(NumSamples=-5)))),
                                     "cannot be negative"),
    "quantize/kv version 2": (lambda c: quantize(c, rehash(kv_file(c.copy("m"), version=2)), "--kv-cache", "fp8"),
                              "not a KV-cache statistics file"),
    "quantize/scale-mode file": (lambda c: quantize(c, rehash(stats(c.copy("i1"), lambda r: r.update(Mode="Scale")))),
                                 "Mode 'Scale'"),
    "quantize/truncated json": (lambda c: (truncate(c.copy("i1") / f"{STEM}.json"), quantize(c, rehash(c.w / "i1")))[1],
                                "not an HQT measurement file"),
    "quantize/NumSamples not a number": (lambda c: quantize(c, rehash(stats(c.copy("i1"), lambda r: r.update(NumSamples="many")))),
                                         "not a whole number"),
    "quantize/manifest nested too deep": (lambda c: quantize(c, (write(c.copy("m") / MANIFEST, DEEP), c.w / "m")[1]),
                                          "corrupt"),
    "quantize/statistics nested too deep, hashes rewritten": (
        lambda c: quantize(c, rehash((write(c.copy("m") / f"{STEM}.json", '{"Nodes": ' + DEEP + "}"), c.w / "m")[1])),
        "not an HQT measurement file"),
    "quantize/QUANT_CONFIG nested too deep": (lambda c: quantize(c, c.m, "-c", write(c.w / "c.json",
                                                                                   '{"mode": "QUANTIZE", "x": ' + DEEP + "}")),
                                              "is not valid JSON"),
    "quantize/QUANT_CONFIG key twice": (lambda c: quantize(c, c.m, "-c", write(c.w / "c.json",
                                        '{"mode": "QUANTIZE", "scale_method": "maxabs_pow2", "scale_method": "unit_scale"}')),
                                        "gives key 'scale_method' twice"),
    "quantize/statistic overflows float32": (lambda c: quantize(c, rehash(stats(c.copy("i1"), node(1e39)))),
                                             f"module {NODE} holds the input statistic 1e+39, beyond float32's range"),
    "quantize/statistic gives a scale no reader takes": (lambda c: quantize(c, rehash(stats(c.copy("m"), node(1e38)))),
                                                         "the statistics are corrupt"),
    "quantize/statistic of another layer's length": (lambda c: quantize(c, rehash(stats(c.copy("m"), lambda r: r["Nodes"][NODE].update(
                                                         inputs=[[[1.0, 2.0, 3.0]]])))),
                                                     "have 3 values, but the layer has 64 inputs"),
    "quantize/model weight changed past the fingerprint's old sample": (
        lambda c: ["quantize", tensors(c.copy("model"), set_last_weight(0.5)), "-m", c.m, "-o", c.out],
        "was made on a different model, or on this one before its config or weights changed"),
    "quantize/model weight NaN, the measurement's fingerprint its own": (quantize_nan_model, "holds 1 NaN or infinite values"),
    "quantize/QUANT_CONFIG selects nothing": (lambda c: quantize(c, c.m, "-c", write(c.w / "c.json", json.dumps(
        {"mode": "QUANTIZE", "allowlist": {"types": [], "names": ["no_such_layer"]}}))), "quantizes no Linear layer"),
    "quantize/manifest fingerprint removed": (lambda c: quantize(c, manifest(c.copy("m"), model=None)),
                                              "holds no fingerprint of it; the manifest is corrupt"),
    "quantize/manifest fingerprint emptied": (lambda c: quantize(c, manifest(c.copy("m"), model={})),
                                              "holds no fingerprint of it; the manifest is corrupt"),
    "quantize/manifest model not an object": (lambda c: quantize(c, manifest(c.copy("m"), model="x")), "corrupt"),
    # unify
    "unify/mode Scale beside DynamicRange": (lambda c: unify(c, rehash(stats(c.copy("i2"), lambda r: r.update(Mode="Scale"),
                                                                             f"{STEM}_1_2.json"))), "rank 1) has Mode 'Scale'"),
    "unify/NumSamples 7 vs 100": (lambda c: unify(c, rehash(numsamples(c.copy("i2"), 7, 100))), "NumSamples 100 differs"),
    "unify/foreign dump": (lambda c: unify(c, c.copy("f2")), "bring them in first with `hqtflow import-hqt"),
    "unify/different node sets": (lambda c: unify(c, rehash(stats(c.copy("i2"), drop_node, f"{STEM}_1_2.json"))),
                                  "nodes differ"),
    "unify/rank from another model": (lambda c: unify(c, rehash(stats(c.copy("i2"), other_model, f"{STEM}_1_2.json"))),
                                      "nodes differ"),
    "unify/LocalRank wrong": (lambda c: unify(c, rehash(stats(c.copy("i2"), lambda r: r.update(LocalRank=0), f"{STEM}_1_2.json"))),
                              "says it is rank 0"),
    "unify/node path traversal": (lambda c: unify(c, rehash(stats(c.copy("i2"), rename_node, f"{STEM}_0_2.json"))),
                                  "not a module name"),
    "unify/negative statistic": (lambda c: unify(c, rehash(stats(c.copy("i2"), node(-1.0), f"{STEM}_1_2.json"))), "negative"),
    "unify/nan statistic": (lambda c: unify(c, rehash(stats(c.copy("i2"), node(float("nan")), f"{STEM}_0_2.json"))), "non-finite"),
    "unify/-o is the source": (lambda c: unify(c, c.copy("i2"))[:-1] + [c.w / "i2", "--overwrite"], "is the input"),
    "unify/-o inside the source": (lambda c: unify(c, c.copy("i2"))[:-1] + [c.w / "i2" / "u"], "lies inside"),
    "unify/source is a partial dir": (lambda c: unify(c, c.partial("i2")), "unfinished output"),
    "unify/foreign partial dir": (lambda c: unify(c, c.partial("f2")), "unfinished output"),
    "unify/manifest version 0": (lambda c: unify(c, manifest(c.copy("m"), _version=0), "0"), "schema version 0"),
    "unify/manifest stem outside": (lambda c: unify(c, rehash_stem(c.copy("m"), "../elsewhere/x"), "0"), "outside itself"),
    "unify/huge rank range": (lambda c: unify(c, c.i2, "0-99999999999999999999"), "do not exist in this 2-rank measurement"),
    "unify/--parallel-plan bad regex": (lambda c: unify(c, c.i2, "01", "--parallel-plan",
                                                        write(c.w / "p.json", '{"(": "column"}')), "has an invalid regex '('"),
    "unify/--parallel-plan nested too deep": (lambda c: unify(c, c.i2, "01", "--parallel-plan", write(c.w / "p.json", DEEP)),
                                              "cannot be read as JSON"),
    "unify/--parallel-plan regex repeat beyond any count": (lambda c: unify(c, c.i2, "01", "--parallel-plan", write(
        c.w / "p.json", '{"a{1000000000000}": "column"}')), "has an invalid regex"),
    "measure/allowlist regex repeat beyond any count": (lambda c: measure(c.model, c, "-c", write(c.w / "c.json", json.dumps(
        {"mode": "MEASURE", "allowlist": {"names": ["a{1000000000000}"]}}))), "has an invalid regex"),
    "measure/scale_params not an object": (lambda c: measure(c.model, c, "-c", write(c.w / "c.json", json.dumps(
        {"mode": "MEASURE", "scale_params": "garbage"}))), "key 'scale_params' has value 'garbage'; it must be an object"),
    "measure/world_size negative": (lambda c: measure(c.model, c, "-c", write(c.w / "c.json", json.dumps(
        {"mode": "MEASURE", "world_size": -2}))), "key 'world_size' has value -2"),
    "measure/-o with a name beyond 255 bytes": (lambda c: measure(c.model, c)[:-1] + [c.w / ("o" * 300) / "m"],
                                               "is too long for this file system"),
    "import-hqt/legacy and current key in one node": (lambda c: ["import-hqt", stats(c.copy("f1"), lambda r: r["Nodes"][NODE]
        .update(input=r["Nodes"][NODE]["inputs"])), "-o", c.out], "has both 'input' and its current spelling 'inputs'"),
    "import-hqt/unknown node key": (lambda c: ["import-hqt", stats(c.copy("f1"), lambda r: r["Nodes"][NODE].update(
        scales=[1.0])), "-o", c.out], "unknown key(s) 'scales'"),
    # import-hqt
    "import-hqt/json nested too deep": (lambda c: ["import-hqt", (write(c.copy("f1") / f"{STEM}.json", DEEP), c.w / "f1")[1],
                                                   "-o", c.out], "not an HQT measurement file"),
    "import-hqt/--world-size 0": (lambda c: ["import-hqt", c.f2, "-o", c.out, "--world-size", "0"],
                                  "--world-size must be at least 1"),
    "import-hqt/--dtype int4": (lambda c: ["import-hqt", c.f1, "-o", c.out, "--dtype", "int4"], "--dtype must be bf16, fp16 or fp32, not 'int4'."),
    "import-hqt/pickle not a dict": (lambda c: ["import-hqt", npz(c, np.arange(3)), "-o", c.out, "--trust-pickle"],
                                     "is not an INC measurement .npz"),
    "import-hqt/pickle dict without Nodes": (lambda c: ["import-hqt", npz(c, {"x": 1}), "-o", c.out, "--trust-pickle"],
                                             "is not an INC measurement .npz"),
    "import-hqt/pickle refused without opt-in": (lambda c: ["import-hqt", npz(c, {"x": 1}), "-o", c.out], "--trust-pickle"),
    "import-hqt/world size not there": (lambda c: ["import-hqt", c.copy("f2"), "-o", c.out, "--world-size", "4"],
                                        "rank(s) 0, 1, 2, 3 are missing"),
    "import-hqt/node path traversal": (lambda c: ["import-hqt", stats(c.copy("f1"), rename_node), "-o", c.out],
                                       "not a module name"),
    "import-hqt/mode Scale": (lambda c: ["import-hqt", stats(c.copy("f1"), lambda r: r.update(Mode="Scale")), "-o", c.out],
                              "Mode 'Scale'"),
    "import-hqt/NumSamples differ": (lambda c: ["import-hqt", numsamples(c.copy("f2"), 7, 100), "-o", c.out],
                                     "NumSamples 100 differs"),
    "import-hqt/node sets differ": (lambda c: ["import-hqt", stats(c.copy("f2"), other_model, f"{STEM}_1_2.json"),
                                               "-o", c.out], "nodes differ"),
    "import-hqt/negative statistic": (lambda c: ["import-hqt", stats(c.copy("f1"), node(-2.0)), "-o", c.out], "negative"),
    "import-hqt/nan statistic": (lambda c: ["import-hqt", stats(c.copy("f1"), node(float("nan"), "params")), "-o", c.out],
                                 "non-finite weight"),
    "import-hqt/-o is the directory": (lambda c: ["import-hqt", c.copy("f1"), "-o", c.w / "f1", "--overwrite"],
                                       "is the input"),
    "import-hqt/-o inside the directory": (lambda c: ["import-hqt", c.copy("f1"), "-o", c.w / "f1" / "o"], "lies inside"),
    "import-hqt/directory is a partial dir": (lambda c: ["import-hqt", c.partial("f1"), "-o", c.out], "unfinished output"),
    "import-hqt/truncated json": (lambda c: (truncate(c.copy("f1") / f"{STEM}.json"), ["import-hqt", c.w / "f1", "-o", c.out])[1],
                                  "not an HQT measurement file"),
    "import-hqt/Nodes not an object": (lambda c: ["import-hqt", stats(c.copy("f1"), lambda r: r.update(Nodes=[])), "-o", c.out],
                                       "not an HQT measurement file"),
    "import-hqt/NumSamples not a number": (lambda c: ["import-hqt", stats(c.copy("f1"), lambda r: r.update(NumSamples=[1])),
                                                      "-o", c.out], "not a whole number"),
    # export
    "export/truncated weights, hashes rewritten": (lambda c: export(c, rehash(trunc_ck(c))), "is truncated"),
    "export/truncated weights": (lambda c: export(c, trunc_ck(c)), "modified after it was written"),
    "export/killed quantize (partial dir)": (lambda c: export(c, killed_quantize(c, f".ck.partial-{PID}-k")), "unfinished output"),
    "export/killed quantize, renamed": (lambda c: export(c, marked(killed_quantize(c, "ck2"))), "unfinished output"),
    "export/manifest version 0": (lambda c: export(c, manifest(c.copy("ck"), _version=0)), "schema version 0"),
    "export/manifest file outside": (lambda c: export(c, manifest(c.copy("ck"), files={"/etc/passwd": "0"})),
                                     "outside itself"),
    "export/-o is the checkpoint": (lambda c: export(c, c.copy("ck"))[:-1] + [c.w / "ck", "--overwrite"], "is the input"),
    "export/-o inside the checkpoint": (lambda c: export(c, c.copy("ck"))[:-1] + [c.w / "ck" / "e"], "lies inside"),
    "export/binary config.json, hashes rewritten": (lambda c: export(c, rehash(binary_config(c.copy("ck")))), "Cannot read"),
    "export/garbage weights, hashes rewritten": (lambda c: export(c, rehash(garbage_weights(c.copy("ck")))),
                                                 "not a readable safetensors file"),
    "export/zero input_scale, hashes rewritten": (lambda c: export(c, rehash(zero_scale(c.copy("ck")))), "cannot be right"),
    "export/quantization_config a list, hashes rewritten": (lambda c: export(c, rehash(config(c.copy("ck"), quantization_config=[1]))),
                                                            "quantization_config is not an object"),
    "export/config field of the wrong type, hashes rewritten": (
        lambda c: export(c, rehash(config(c.copy("ck"), num_hidden_layers="two"))),
        "num_hidden_layers is 'two'; it must be a positive integer"),
    "export/scale of the wrong shape, hashes rewritten": (
        lambda c: export(c, rehash(tensors(c.copy("ck"), lambda t: t.update({f"{NODE}.weight_scale": t[f"{NODE}.weight_scale"].reshape(-1).repeat(3)})))),
        "weight_scale has shape [3]"),
    "export/weight_scale missing, hashes rewritten": (
        lambda c: export(c, rehash(tensors(c.copy("ck"), lambda t: t.pop(f"{NODE}.weight_scale")))), "has no weight_scale"),
    "export/weight not FP8, hashes rewritten": (
        lambda c: export(c, rehash(tensors(c.copy("ck"), lambda t: t.update({f"{NODE}.weight": t[f"{NODE}.weight"].float()})))),
        "does not match its config"),
    "export/weight of the wrong shape, hashes rewritten": (
        lambda c: export(c, rehash(tensors(c.copy("ck"), lambda t: t.update({f"{NODE}.weight": t[f"{NODE}.weight"][:32].contiguous()})))),
        "does not match its config.json"),
    "export/vocab_size 1e12, hashes rewritten": (  # refused before anything of that size is allocated
        lambda c: export(c, rehash(config(c.copy("ck"), vocab_size=10**12))), "more values than all its weights together"),
    "export/num_hidden_layers 1e9, hashes rewritten": (  # refused before a billion layers are built
        lambda c: export(c, rehash(config(c.copy("ck"), num_hidden_layers=10**9))), "num_hidden_layers is 1000000000"),
    "export/num_hidden_layers -1, hashes rewritten": (
        lambda c: export(c, rehash(config(c.copy("ck"), num_hidden_layers=-1))), "num_hidden_layers is -1; it must be a positive integer"),
    "export/model_type of another model, hashes rewritten": (
        lambda c: export(c, rehash(config(c.copy("ck"), model_type="bert"))), "belongs to no layer of the model"),
    # inspect
    "inspect/source_measurement not a string": (lambda c: ["inspect", edit_data(c.copy("ck"), source_measurement=[1])],
                                                 "its data field 'source_measurement' is not a string"),
    "inspect/manifest version 10**400": (lambda c: ["inspect", manifest(c.copy("m"), _version=10**400)],
                                         "schema version 100000000000000000...0000000000000000000, which no hqtflow writes"),
    "quantize/model_dtype not a string": (lambda c: quantize(c, edit_data(c.copy("m"), model_dtype=16)),
                                          "its data field 'model_dtype' is not a string"),
    "quantize/-m a file": (lambda c: quantize(c, write(c.w / "m.json", "{}")), "is not a directory"),
    "inspect/manifest nested too deep": (lambda c: ["inspect", (write(c.copy("m") / MANIFEST, DEEP), c.w / "m")[1]], "corrupt"),
    "inspect/manifest model not an object": (lambda c: ["inspect", manifest(c.copy("m"), model=[1])], "corrupt"),
    "inspect/string scale, hashes rewritten": (lambda c: ["inspect", rehash(scale_node(c.copy("s"), "x"))],
                                               "not a number or a list of numbers"),
    "inspect/nan scale, hashes rewritten": (lambda c: ["inspect", rehash(scale_node(c.copy("s"), [float("nan")]))],
                                            "has a scale of nan"),
    "inspect/partial dir": (lambda c: ["inspect", c.partial("m")], "unfinished output"),
    "inspect/manifest version 0": (lambda c: ["inspect", manifest(c.copy("m"), _version=0)], "schema version 0"),
    "inspect/manifest file outside": (lambda c: ["inspect", manifest(c.copy("m"), files={"../../outside_dir/x.json": "0"})],
                                      "outside itself"),
    "inspect/manifest stem outside": (lambda c: ["inspect", rehash_stem(c.copy("m"), "../outside_dir/x")], "outside itself"),
    "inspect/--json over a file that is not a report": (lambda c: ["inspect", c.m, "--json", write(c.w / "notes.json", "{}")],
                                                         "not an earlier hqtflow inspect report"),
    "inspect/--html over the model's weights": (lambda c: ["inspect", c.ck, "--html", c.copy("model") / "model.safetensors"],
                                                "not an earlier hqtflow inspect report"),
    "generate/float64 scale, hashes rewritten": (lambda c: gen(rehash(tensors(c.copy("ck"), lambda t: t.update(
        {f"{NODE}.weight_scale": t[f"{NODE}.weight_scale"].double()})))), "is a float64 tensor; scales are float32"),
    "generate/int32 input_scale, hashes rewritten": (lambda c: gen(rehash(tensors(c.copy("ck"), lambda t: t.update(
        {f"{NODE}.input_scale": t[f"{NODE}.input_scale"].int()})))), "is a int32 tensor; scales are float32"),
    "measure/config's vocabulary far beyond the weights": (
        lambda c: measure(edit_json_dir(c.copy("model"), lambda cfg: cfg.update(vocab_size=8_000_000)), c),
        "more values than all its weights together"),
    "measure/weights a FIFO": (lambda c: ((c.copy("model") / "model.safetensors").unlink(),
                                          os.mkfifo(c.w / "model" / "model.safetensors"), measure(c.w / "model", c))[2],
                               "is not a regular file"),
    "inspect/--json inside the artifact": (lambda c: ["inspect", c.copy("m"), "--json", c.w / "m" / "r.json"], "lies inside"),
    "inspect/--html inside the artifact": (lambda c: ["inspect", c.copy("ck"), "--html", c.w / "ck" / "r.html"], "lies inside"),
    "inspect/nan statistic, hashes rewritten": (lambda c: ["inspect", rehash(stats(c.copy("m"), node(float("nan"))))],
                                                "non-finite"),
    "inspect/node path traversal, hashes rewritten": (lambda c: ["inspect", rehash(stats(c.copy("m"), rename_node))],
                                                      "not a module name"),
    "inspect/truncated checkpoint, hashes rewritten": (lambda c: ["inspect", rehash(trunc_ck(c))], "is truncated"),
    # generate
    "generate/killed quantize (partial dir)": (lambda c: gen(killed_quantize(c, f".ck.partial-{PID}-k")), "unfinished output"),
    "generate/killed quantize, renamed": (lambda c: gen(marked(killed_quantize(c, "ck2"))), "unfinished output"),
    "generate/loser's hidden copy": (lambda c: gen(c.copy("ck", f".ck.partial-{PID}-loser")), "unfinished output"),
    "generate/truncated weights, hashes rewritten": (lambda c: gen(rehash(trunc_ck(c))), "is truncated"),
    "generate/truncated weights": (lambda c: gen(trunc_ck(c)), "is truncated"),
    "generate/shape disagrees with config, hashes rewritten": (lambda c: gen(rehash(wider_config(c.copy("ck")))),
                                                               "does not match its config.json"),
    "generate/foreign checkpoint, shape disagrees": (lambda c: gen(wider_config(foreign_ck(c))),
                                                     "does not match its config.json"),
    "generate/zero input_scale, hashes rewritten": (lambda c: gen(rehash(zero_scale(c.copy("ck")))), "cannot be right"),
    "generate/negative k_scale, foreign": (lambda c: gen(kv_scale(foreign_ck(c), -0.5)), "cannot be right"),
    "generate/manifest version 0": (lambda c: gen(manifest(c.copy("ck"), _version=0)), "schema version 0"),
    "generate/garbage weights, foreign": (lambda c: gen(garbage_weights(foreign_ck(c))), "not a readable safetensors file"),
    "generate/garbage weights, header offsets overlap": (lambda c: gen(rehash(overlapping_offsets(c.copy("ck")))),
                                                         "not a valid safetensors file"),
    "generate/quantization_config a list, hashes rewritten": (lambda c: gen(rehash(config(c.copy("ck"), quantization_config=[1]))),
                                                              "quantization_config is not an object"),
    "generate/quantization_config a list, foreign": (lambda c: gen(config(foreign_ck(c), quantization_config=[1])),
                                                     "quantization_config is not an object"),
    "generate/config field of the wrong type, hashes rewritten": (
        lambda c: gen(rehash(config(c.copy("ck"), num_hidden_layers="two"))),
        "num_hidden_layers is 'two'; it must be a positive integer"),
    "generate/num_key_value_heads 0, hashes rewritten": (
        lambda c: gen(rehash(config(c.copy("ck"), num_key_value_heads=0))), "num_key_value_heads is 0; it must be a positive integer"),
    "generate/generation_config.json not JSON, hashes rewritten": (
        lambda c: gen(rehash(bad_generation_config(c.copy("ck")))), "generation_config.json (JSONDecodeError)"),
    "generate/empty prompt": (lambda c: [*gen(c.ck), "-p", ""], "The prompt is empty"),
    "generate/--device hpu without --engine inc": (lambda c: [*gen(c.ck), "--device", "hpu"], "hpu: with --engine inc"),
    "generate/--chat without a chat template": (lambda c: [*gen(c.ck), "--chat"], "has no chat template"),
    # eval
    "eval/binary --ppl-file": (lambda c: ((c.w / "b.txt").write_bytes(bytes(range(256))),
                                          ["eval", c.ck, "--no-baseline", "--ppl-file", c.w / "b.txt"])[1], "not UTF-8"),
    "eval/empty --ppl-file": (lambda c: ((c.w / "e.txt").write_text(" \n"),
                                         ["eval", c.ck, "--no-baseline", "--ppl-file", c.w / "e.txt"])[1], "is empty"),
    "eval/--data-dir task record without a field": (lambda c: ["eval", c.ck, "--no-baseline", "--tasks", "piqa_local",
                                                               "--data-dir", data_dir(c, "piqa.jsonl", '{"goal": 1}\n')],
                                                      "line 1 has no field 'choices'"),
    "eval/--data-dir task record's gold out of range": (
        lambda c: ["eval", c.ck, "--no-baseline", "--tasks", "piqa_local", "--data-dir",
                   data_dir(c, "piqa.jsonl", '{"query": "x", "choices": ["a", "b"], "gold": 7}\n')],
        "has gold 7, not the index of one of its 2 choices"),
    "eval/--data-dir task record's gold a string": (
        lambda c: ["eval", c.ck, "--no-baseline", "--tasks", "piqa_local", "--data-dir",
                   data_dir(c, "piqa.jsonl", '{"query": "x", "choices": ["a", "b"], "gold": "0"}\n')], "has gold '0'"),
    "eval/--data-dir task record without choices": (
        lambda c: ["eval", c.ck, "--no-baseline", "--tasks", "piqa_local", "--data-dir",
                   data_dir(c, "piqa.jsonl", '{"query": "x", "choices": [], "gold": 0}\n')], "not a non-empty list"),
    "eval/--ppl-windows 0": (lambda c: ["eval", c.ck, "--no-baseline", "--ppl-file", c.text, "--ppl-windows", "0"],
                             "--ppl-windows must be at least 1, not 0"),
    "eval/--device a typo": (lambda c: ["eval", c.ck, "--no-baseline", "--ppl-file", c.text, "--device", "gpu"],
                             "valid values are auto, cpu, cuda"),
    "eval/--batch-size 0": (lambda c: ["eval", c.ck, "--no-baseline", "--ppl-file", c.text, "--batch-size", "0"],
                            "--batch-size must be at least 1, not 0"),
    "eval/--baseline with --no-baseline": (lambda c: ["eval", c.ck, "--no-baseline", "--baseline", c.model, "--ppl-file",
                                                      c.text], "contradict each other"),
    "eval/partial checkpoint": (lambda c: ["eval", c.partial("ck"), "--no-baseline", "--ppl-file", c.text],
                                "unfinished output"),
    "eval/truncated checkpoint, hashes rewritten": (lambda c: ["eval", rehash(trunc_ck(c)), "--no-baseline",
                                                               "--ppl-file", c.text], "is truncated"),
    "eval/garbage manifest": (lambda c: ["eval", write(c.copy("ck") / MANIFEST, "{broken").parent, "--ppl-file", c.text],
                              "is corrupt"),
    "eval/--report inside the checkpoint": (lambda c: ["eval", c.copy("ck"), "--no-baseline", "--ppl-file", c.text,
                                                       "--report", c.w / "ck" / "r.json"], "lies inside"),
    # serve
    "serve/port 99999": (lambda c: ["serve", "fp8", c.ck, "--port", "99999"], "between 1 and 65535"),
    "serve/port 0": (lambda c: ["serve", "fp8", c.ck, "--port", "0"], "between 1 and 65535"),
    "serve/port -1": (lambda c: ["serve", "fp8", c.ck, "--port=-1"], "between 1 and 65535"),
    "serve/port in use": (lambda c: ["serve", "fp8", c.ck, "--port", str(busy_port(c))], "Cannot listen on 127.0.0.1"),
    "serve/partial checkpoint": (lambda c: serve(c.partial("ck")), "unfinished output"),
    "serve/truncated checkpoint, hashes rewritten": (lambda c: serve(rehash(trunc_ck(c))), "is truncated"),
    "serve/shape disagrees with config, hashes rewritten": (lambda c: serve(rehash(wider_config(c.copy("ck")))),
                                                            "does not match its config.json"),
    "serve/-m with a nan statistic": (lambda c: serve(c.model, "-m", rehash(stats(c.copy("i1"), node(float("nan"))))), "non-finite"),
    "serve/-m a partial measurement": (lambda c: serve(c.model, "-m", c.partial("m")), "unfinished output"),
    "serve/--device hpu without --engine inc": (lambda c: serve(c.ck, "--device", "hpu"), "hpu: with --engine inc"),
    "serve/--device a typo": (lambda c: serve(c.ck, "--device", "gpu"), "valid values are auto, cpu, cuda"),
    "serve/--compile on a CPU": (lambda c: serve(c.ck, "--device", "cpu", "--compile"), "needs hqtflow's engine on a CUDA GPU"),
    "serve/--max-batch-size -1": (lambda c: serve(c.ck, "--max-batch-size", "-1"), "--max-batch-size must be at least 0, not -1"),
    "serve/--max-stop-sequences -1": (lambda c: serve(c.ck, "--max-stop-sequences", "-1"), "--max-stop-sequences must be at least 0"),
    "serve/--max-input-tokens -5": (lambda c: serve(c.ck, "--max-input-tokens", "-5"), "--max-input-tokens must be at least 1"),
    "serve/--max-concurrent-requests 0": (lambda c: serve(c.ck, "--max-concurrent-requests", "0"),
                                          "--max-concurrent-requests must be at least 1, not 0"),
    "serve/--batch-bucket-size 0": (lambda c: serve(c.ck, "--batch-bucket-size", "0"), "--batch-bucket-size must be at least 1"),
    # bench
    "bench/garbage manifest": (lambda c: bench(write(c.copy("ck") / MANIFEST, "{broken").parent), "is corrupt"),
    "bench/--json inside the checkpoint": (lambda c: [*bench(c.copy("ck")), "--json", c.w / "ck" / "b.json"], "lies inside"),
    "bench/--json under a file": (lambda c: [*bench(c.ck), "--json", write(c.w / "f", "x") / "b.json"],
                                  "Cannot create the parent directory"),
    "bench/--device hpu": (lambda c: [*bench(c.ck), "--device", "hpu"], "on Gaudi (hpu) use serve, generate or eval"),
    "bench/--device a typo": (lambda c: [*bench(c.ck), "--device", "tpu"],  # no hint of --engine, which bench lacks
                              "Unknown --device 'tpu'; valid values are auto, cpu, cuda."),
    # handoff
    "handoff/-o over a file that is not a hand-off script": (
        lambda c: ["handoff", c.m, "--to", "tgi-gaudi", "-o", write(c.w / "run.sh", "echo mine\n")],
        "not an earlier hqtflow hand-off script"),
    "handoff/--dir a file": (lambda c: ["handoff", c.m, "--to", "tgi-gaudi", "--dir", write(c.w / "f", "x")],
                             "Cannot write the hand-off directory"),
    "handoff/--dir inside the artifact": (lambda c: ["handoff", c.copy("m"), "--to", "tgi-gaudi", "--dir", c.w / "m" / "h"],
                                          "lies inside the artifact"),
    "handoff/-o inside the artifact": (lambda c: ["handoff", c.copy("m"), "--to", "tgi-gaudi", "-o", c.w / "m" / "run.sh"],
                                       "lies inside the artifact"),
    # run (recipes)
    "run/recipe with a key twice": (lambda c: ["run", write(c.w / "r.yaml", "name: a\nmeasure:\n  limit: 2\nmeasure:\n  limit: 4\n")],
                                    "gives the key 'measure' twice (again at line 4)"),
    "run/eval.ppl_file missing (checked before measure runs)": (
        lambda c: ["run", recipe(c, f"eval:\n  ppl_file: {c.w / 'nowhere.txt'}\n")], "eval.ppl_file"),
    "run/recipe nested too deep": (lambda c: ["run", write(c.w / "r.yaml", "x: " + DEEP + "\n")], "is not valid YAML"),
    "run/a foreign fp8 dir where the checkpoint goes": (lambda c: (foreign_dir(c.w / "fp8"), ["run", recipe(c)])[1],
                                                       "is not an hqtflow checkpoint artifact"),
    "run/eval.json not a report of run": (lambda c: (write(c.w / "eval.json", "my notes"),
                                                     ["run", recipe(c, f"eval:\n  ppl_file: {c.text}\n")])[1],
                                          "is not a report of `hqtflow run`"),
    "run/-o a foreign dir": (lambda c: ["run", recipe(c), "-o", foreign_dir(c.w / "mine")],
                             "is not an hqtflow measurement artifact"),
    "run/recipe not UTF-8": (lambda c: ((c.w / "r.yaml").write_bytes(b"\xff\xfe\x00\x01"), ["run", c.w / "r.yaml"])[1],
                             "is not valid YAML"),
    # from fuzzing the readers (stop 48): huge integers, Infinity where a count goes, wrong nested types, odd scales
    "import-hqt/a file name claiming 10**20 ranks": (lambda c: ["import-hqt", renamed(c.copy("f1"), f"{STEM}.json",
                                                                                     f"{STEM}_3_{10**20}.json"),
                                                               "-o", c.out, "--model", c.model], "and 99999999999999999991 more"),
    "inspect/measurement with a 5000-digit integer": (lambda c: ["inspect", rehash(big_int(c.copy("m"), f"{STEM}.json", "NumSamples"))],
                                                      "not an HQT measurement file"),
    "inspect/manifest with a 5000-digit integer": (lambda c: ["inspect", big_int(c.copy("m"), MANIFEST, "_version")], "corrupt"),
    "quantize/QUANT_CONFIG with a 5000-digit integer": (lambda c: quantize(c, c.m, "-c", write(
        c.w / "c.json", '{"mode": "QUANTIZE", "fake_quant": ' + "1" * 5000 + "}")), "an integer of more than 4300 digits"),
    "run/recipe with a 5000-digit integer": (lambda c: ["run", write(c.w / "r.yaml", "version: " + "1" * 5000 + "\n")],
                                             "an integer of more than 4300 digits"),
    "inspect/manifest world_size Infinity": (lambda c: ["inspect", edit_manifest(c.copy("m"), lambda m: m["data"].update(
        world_size=float("inf")))], "not a whole number"),
    "unify/NumSamples Infinity": (lambda c: unify(c, rehash(stats(c.copy("i2"), lambda r: r.update(NumSamples=float("inf")),
                                                                  f"{STEM}_1_2.json"))), "not a whole number"),
    "unify/manifest layer record a list": (lambda c: unify(c, edit_manifest(c.copy("m"), lambda m: m["data"]["ranks"][0].update(
        layers={NODE: ["column"]})), "0"), "malformed layer record"),
    "generate/quantization_config config_groups a number": (lambda c: gen(rehash(edit_config(c.copy("ck"), lambda cfg: cfg[
        "quantization_config"].update(config_groups=5)))), "quantization_config is malformed"),
    "generate/quantization_config ignore a number": (lambda c: gen(rehash(edit_config(c.copy("ck"), lambda cfg: cfg[
        "quantization_config"].update(ignore=0.5)))), "must be a list of module names"),
    "generate/config.json dtype a path": (lambda c: gen(rehash(config(c.copy("ck"), dtype="../../etc/passwd"))),
                                          "is not a valid model config"),
    "generate/config.json model_type a list": (lambda c: gen(rehash(config(c.copy("ck"), model_type=["llama"]))),
                                               "is not a valid model config"),
    "generate/KV scale of 64 values": (lambda c: gen(rehash(tensors(c.copy("ck"), set_tensor(
        "model.layers.1.self_attn.k_scale", torch.ones(64))))), "KV-cache scales are per tensor"),
    "generate/weight scale 3e38": (lambda c: gen(rehash(tensors(c.copy("ck"), set_tensor(
        "model.layers.0.mlp.gate_proj.weight_scale", torch.full((1,), 3e38))))), "overflows float32"),
    "inspect/per-channel weight scale of the wrong length": (lambda c: ["inspect", rehash(tensors(c.copy("ck"), set_tensor(
        f"{NODE}.weight_scale", torch.ones(128, 1))))], "inspect reads per-tensor and per-channel scales"),
    "run/recipe output with a NUL byte": (lambda c: ["run", write(c.w / "r.yaml", f"model: {c.model}\ncalibration:\n  text: "
                                                                  f"{c.text}\noutput: \"out\\0dir\"\n")], "'output' holds a NUL character"),
    # from fuzzing the scale-file readers (stop 49): scales as strings, out of range, wrong-typed manifest fields
    "inspect/per-channel weight scale of strings, hashes rewritten": (lambda c: ["inspect", rehash(scale_node(
        c.copy("s"), {"0": ["0.1"] * 64, "1": [1.0] * 64}, "weight"))], "not a number or a list of numbers"),
    "inspect/negative weight scale, hashes rewritten": (lambda c: ["inspect", rehash(scale_node(c.copy("s"), -1.0, "weight"))],
                                                        "has a scale of -1.0"),
    "inspect/weight scale 1e-45, hashes rewritten": (lambda c: ["inspect", rehash(scale_node(c.copy("s"), 1e-45, "weight"))],
                                                     "no scale method makes one"),
    "inspect/scales manifest skipped a number": (lambda c: ["inspect", edit_manifest(c.copy("s"), lambda m: m["data"].update(
        skipped=1.5))], "'skipped' is not an object"),
    "inspect/scales manifest files of numbers": (lambda c: ["inspect", edit_manifest(c.copy("s"), lambda m: m["data"].update(
        files=[7]))], "'files' is not a list of file names"),
    "inspect/manifest with a lone surrogate": (lambda c: ["inspect", write(c.copy("s") / MANIFEST, (c.s / MANIFEST).read_text()
                                                                            .replace('"target": "cpu"', '"target": "x\\ud800"'))
                                                .parent], "corrupt"),
    "handoff/scales world_size 10**9": (lambda c: ["handoff", edit_manifest(c.copy("g"), lambda m: m["data"].update(
        world_size=10**9)), "--to", "optimum-habana", "--dir", c.w / "h"], "no valid ranks"),
    "handoff/nan in a Gaudi scale file, hashes rewritten": (lambda c: ["handoff", rehash(scale_node(c.copy("g"), [float("nan")])),
                                                            "--to", "optimum-habana", "--dir", c.w / "h"], "has a scale of nan"),
    "run/recipe output with a lone surrogate": (lambda c: ["run", write(c.w / "r.yaml", f"model: {c.model}\ncalibration:\n  "
                                                                        f"text: {c.text}\noutput: \"out\\ud800dir\"\n")],
                                                "must be valid text"),
    # a model path recorded relative to where an older hqtflow ran: the refusal says so and how to pass the model
    "quantize/measurement's recorded model path relative": (
        lambda c: ["quantize", "-m", edit_data(c.copy("m"), model_path="../tiny"), "-o", c.out],
        "/m's manifest records does not exist (a relative path, as older hqtflow versions recorded it); pass the model "
        "explicitly: `hqtflow quantize MODEL -m"),
    "eval/checkpoint's recorded model path relative": (
        lambda c: ["eval", edit_data(c.copy("ck"), model_path="../tiny"), "--ppl-file", c.text],
        "manifest records does not exist (a relative path, as older hqtflow versions recorded it); pass the model "
        "explicitly: `hqtflow eval"),
    # a quantization_config hqtflow cannot run: every reader of the checkpoint refuses it alike
    **{f"{stage}/config.json weights {key} {value}, hashes rewritten": (
        lambda c, stage=stage, key=key, value=value: ARGV[stage](c, rehash(edit_config(c.copy("ck"), lambda cfg: cfg[
            "quantization_config"]["config_groups"]["group_0"]["weights"].update({key: value})))),
        f"Unsupported weight scheme {'float4' if key == 'num_bits' else value}")
       for stage in ("inspect", "generate", "export") for key, value in (("num_bits", 4), ("type", "mxfp8"))},
    # an enumerated manifest field of a value this hqtflow does not know (a newer one's): every stage refuses it alike
    **{f"{stage}/{key} {field} {value!r}, value unknown": (
        lambda c, stage=stage, key=key, field=field, value=value: ARGV[stage](c, edit_field(c.copy(key), field, value)),
        f"records {field} {value!r}, which this hqtflow does not know")
       for stage, key, field, value in [
           ("inspect", "ck", "scale_method", "maxabs_future"), ("generate", "ck", "fp8", "E3M4"),
           ("export", "ck", "fp8", "E3M4"), ("inspect", "ck", "fp8", "E3M4"), ("inspect", "s", "fp8", "E3M4"),
           ("handoff", "g", "scale_method", "maxabs_future"), ("handoff", "g", "fp8", "E3M4"),
           ("quantize", "m", "model_dtype", "bf32"), ("inspect", "m", "model_dtype", "bf32"),
           ("quantize", "m", "observer", "kl"), ("quantize", "m", "config.observer", "kl"),
           ("inspect", "s", "weight_rounding", "stochastic"), ("handoff", "g", "weight_rounding", "stochastic"),
           ("generate", "ck", "config.fp8_config", "E3M4"), ("eval", "ck", "mode", "w4a4")]},
}


def renamed(d, name, new):
    (d / name).rename(d / new)
    return d


def big_int(d, name, key):
    """`key` of the JSON file set to an integer of 5000 digits (json.dumps cannot write one: Python's limit is 4300)."""
    edit_json(d / name, lambda raw: raw.update({key: "BIG"}))
    write(d / name, (d / name).read_text().replace('"BIG"', "1" * 5000))
    return d


def edit_config(d, fn):
    edit_json(d / "config.json", fn)
    return d


def set_tensor(key, value):
    def fn(t):
        t[key] = value.to(t[key].dtype) if key in t else value
    return fn


def data_dir(c, name, text):
    """A --data-dir holding one task file with `text`."""
    d = c.w / "data"
    d.mkdir()
    write(d / name, text)
    return d


def recipe(c, extra=""):
    """A small recipe for the tiny model whose outputs go into the work dir (measurement `meas`, checkpoint `fp8`)."""
    return write(c.w / "r.yaml", f"model: {c.model}\ncalibration:\n  text: {c.text}\n  limit: 1\n"
                                 f"max_length: 16\noutput: {c.w / 'meas'}\n{extra}")


def foreign_dir(d):
    """A directory of the user's own that happens to sit where an output goes."""
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    return d


def edit_json_dir(d, fn):
    edit_json(d / "config.json", fn)
    return d


def self_link(path):
    """`path` replaced by a symlink to itself (a loop); returns the artifact folder for inspect, the path's parent."""
    path.unlink()
    path.symlink_to(path.name)
    return path.parent


def config(d, **changes):
    edit_json(d / "config.json", lambda cfg: cfg.update(changes))
    return d


def export(c, ck):
    return ["export", ck, "-f", "fp8", "-o", c.out]


def edit_field(d, field, value):
    """A manifest's data field (or `config.<key>`, its QUANT_CONFIG's) set to `value`."""
    section, _, key = field.rpartition(".")
    edit_json(d / MANIFEST, lambda m: m[section or "data"].update({key: value}))
    return d


ARGV = {"inspect": lambda c, d: ["inspect", d], "generate": lambda c, d: gen(d), "export": export,
        "quantize": lambda c, d: quantize(c, d), "eval": lambda c, d: ["eval", d, "--no-baseline", "--ppl-file", c.text],
        "handoff": lambda c, d: ["handoff", d, "--to", "optimum-habana", "--dir", c.w / "h"]}


def trunc_ck(c):
    d = c.copy("ck")
    truncate(d / "model.safetensors", 0.7)
    return d


def foreign_ck(c):
    d = c.copy("ck", "foreign")
    (d / MANIFEST).unlink()
    return d


def binary_config(d):
    (d / "config.json").write_bytes(b"\x00\xff\xfe")
    return d


def bad_generation_config(d):
    (d / "generation_config.json").write_text("{bad json")
    return d


def garbage_weights(d):
    (d / "model.safetensors").write_bytes(b"\xff" * 100)
    return d


def overlapping_offsets(d):
    """Rewrite model.safetensors' header so that its second tensor starts inside the first (same length, same data)."""
    from hqtflow.formats.safetensors_files import safetensors_header

    f = d / "model.safetensors"
    data = f.read_bytes()
    start, header = safetensors_header(f)
    n = start - 8
    first, second = [k for k in header if k != "__metadata__"][:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 2, end - 2]
    raw = json.dumps(header, separators=(",", ":")).encode()
    f.write_bytes(struct.pack("<Q", n) + raw.ljust(n) + data[8 + n :])
    return d


def zero_scale(d):
    return tensors(d, lambda t: t[f"{NODE}.input_scale"].zero_())


def kv_scale(d, value):
    return tensors(d, lambda t: t["model.layers.0.self_attn.k_scale"].fill_(value))


def kv(d, value):
    edit_json(d / "kv_cache_maxabs.json", lambda k: k["layers"]["model.layers.0.self_attn"].update(k=value))
    return d


def kv_drop(d, name):
    edit_json(d / "kv_cache_maxabs.json", lambda k: k["layers"].pop(name) and None)
    return d


def kv_file(d, **changes):
    edit_json(d / "kv_cache_maxabs.json", lambda k: k.update(changes))
    return d


def rehash_stem(d, stem):
    edit_json(d / MANIFEST, lambda m: m["data"]["ranks"][0].update(stem=stem))
    return d


def edit_data(d, **changes):
    edit_json(d / MANIFEST, lambda m: m["data"].update(changes))
    return d


def numsamples(d, a, b):
    stats(d, lambda r: r.update(NumSamples=a), f"{STEM}_0_2.json")
    return stats(d, lambda r: r.update(NumSamples=b), f"{STEM}_1_2.json")


def other_model(raw):
    raw["Nodes"] = {f"model.layers.{i}.mlp.up_proj": raw["Nodes"][NODE] for i in range(30)}


def snapshot(d):
    return {str(p.relative_to(d)): (p.is_dir(), p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns)
            for p in d.rglob("*")}


# A model a stage reads (or a foreign checkpoint) is not an artifact: its damage is a model error (exit 4), damage to
# one of hqtflow's artifacts is exit 3.
MODEL_CASES = {"measure/nan weights", "measure/inf weights", "measure/truncated weights", "measure/garbage weights",
               "measure/garbage weights, header offsets overlap",
               "measure/config has a layer the weights lack", "measure/config has fewer layers than the weights",
               "measure/config's vocabulary disagrees with the weights", "measure/config's rope type unknown",
               "measure/generation_config.json not JSON", "generate/generation_config.json not JSON, hashes rewritten",
               "measure/num_hidden_layers 1e9", "measure/config NaN", "measure/config infinity, nested",
               "measure/garbage pickle weights", "generate/garbage weights, foreign",
               "quantize/model weight NaN, the measurement's fingerprint its own", "quantize/measurement's recorded model path relative",
               "eval/checkpoint's recorded model path relative"}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_hostile(base, tmp_path, case):
    build, words = CASES[case]
    c = Ctx(base, tmp_path / "work")
    c.w.mkdir()
    try:
        argv = build(c)
        before = snapshot(c.w)
        r = run_cli(*argv)
    finally:
        for s in c.keep:
            s.close()
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not PROGRESS.search(ln)]  # tqdm bars aside
    assert r.exit_code in USER_EXIT_CODES, r.output  # the code of its kind (tests/test_cli.py checks each kind)
    assert case not in MODEL_CASES or r.exit_code == EXIT_CODES["model"], r.output
    assert not any(w in case for w in ("truncated", "garbage", "value unknown")) or case in MODEL_CASES or \
        r.exit_code == EXIT_CODES["artifact"], r.output
    assert "Traceback" not in r.output and "Traceback" not in r.stderr
    assert len(err) == 1 and err[0].startswith("Error: "), r.stderr
    err = err[0]
    assert words in err, err
    assert not c.out.exists()
    assert snapshot(c.w) == before, "the output's parent (holding the inputs) must be exactly as it was"


def test_a_file_it_may_not_read_is_one_sentence(base, monkeypatch):
    """A file the user may not read (mode 000 for a non-root user; root reads anything, so the OS's refusal is
    simulated where every artifact file is read) is one sentence naming it, exit 3, not a traceback."""
    import errno

    from hqtflow.formats import artifact

    def denied(path, *a, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(artifact, "sha256_file", denied)
    r = run_cli("inspect", base["m"])
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == EXIT_CODES["artifact"] and "Traceback" not in r.output, r.output
    assert len(err) == 1 and err[0].startswith(f"Error: cannot use {base['m']}") and "(permission denied)" in err[0], err


def test_cases_cover_every_stage():
    per_stage = {}
    for case in CASES:
        per_stage[case.split("/")[0]] = per_stage.get(case.split("/")[0], 0) + 1
    assert set(per_stage) == {"measure", "quantize", "unify", "import-hqt", "export", "inspect", "generate", "eval", "serve",
                              "bench", "handoff", "run"}
    assert sum(per_stage.values()) >= 80, per_stage


# ---- what must be accepted, and what must be left behind -----------------------------------------------------
def test_stale_partials_of_dead_processes_are_removed(base, tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".u.partial-{dead.pid}-abc"
    old = tmp_path / f".x.old-{dead.pid}-123"  # replaced by the output `x` beside it
    orphan = tmp_path / f".z.old-{dead.pid}-456"  # killed between the commit's renames: no `z`
    live = tmp_path / f".v.partial-{PID}-abc"
    # the user's own directories that only look like leftovers (no staging marker, no manifest) are never removed
    users = [tmp_path / ".photos.old-2023-summer", tmp_path / f".notes.partial-{dead.pid}-abc", tmp_path / f".y.old-{dead.pid}-9"]
    for d in (stale, old, orphan, live, tmp_path / "x", *users):
        d.mkdir()
        (d / "big.bin").write_bytes(b"0" * 1000)
    for d in (stale, live):
        (d / PARTIAL_MARKER).write_text("pid\n")
    for d in (old, orphan, tmp_path / "x"):
        (d / MANIFEST).write_text(json.dumps({"files": {"big.bin": "..."}}))
    r = run_cli("unify", "-g", "01", "-m", base["i2"], "-o", tmp_path / "u")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "u", "x", "z", *(d.name for d in users)])
    assert all((d / "big.bin").read_bytes() == b"0" * 1000 for d in (*users, tmp_path / "z"))  # the orphan put back


def test_overwrite_replaces_only_hqtflow_outputs(base, tmp_path):
    """--overwrite replaces an earlier artifact or an empty directory; a directory of the user's (no manifest) is
    refused in one sentence and left as it was."""
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    r = run_cli("unify", "-g", "01", "-m", base["i2"], "-o", mine, "--overwrite")
    assert r.exit_code == EXIT_CODES["artifact"] and "is not an hqtflow artifact" in r.output, r.output
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"] and (mine / "thesis.tex").read_text() == "years of work"
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, empty):  # an empty directory, then the artifact written there
        r = run_cli("unify", "-g", "01", "-m", base["i2"], "-o", out, "--overwrite")
        assert r.exit_code == 0 and (out / MANIFEST).is_file(), r.output


def test_a_checkpoint_replaced_while_it_loads_is_refused(base, tmp_path, monkeypatch):
    """serve/generate/eval check a checkpoint's hashes, then load it by path: another run's --overwrite replacing it
    in between (B, a valid checkpoint of its own) is refused in one sentence, never served unchecked."""
    from hqtflow import api
    from hqtflow.errors import ArtifactError
    from hqtflow.formats import checkpoint

    a, b = tmp_path / "ck", tmp_path / "B"
    shutil.copytree(base["ck"], a)
    shutil.copytree(base["ck"], b)
    edit_json(b / "config.json", lambda cfg: cfg.update(hqtflow_test="B"))
    rehash(b)
    real = checkpoint.load_checkpoint

    def replaced_then_loaded(path, **kwargs):
        a.rename(tmp_path / "ck.old")
        b.rename(a)  # as StagingDir.commit replaces an output
        return real(path, **kwargs)

    monkeypatch.setattr(checkpoint, "load_checkpoint", replaced_then_loaded)
    with pytest.raises(ArtifactError, match="changed while it was being loaded"):
        api.load(a)


def test_overwriting_a_symlinked_output_leaves_no_backup(base, tmp_path):
    """--overwrite of an output that is a symlink replaces the link; the linked directory and its files stay as they were,
    and no `.out.old-*` link is left behind."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (tmp_path / "u").symlink_to(target)
    r = run_cli("unify", "-g", "01", "-m", base["i2"], "-o", tmp_path / "u", "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target", "u"]
    assert not (tmp_path / "u").is_symlink() and [p.name for p in target.iterdir()] == ["notes.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_tp_launcher_alone_stops_the_ranks(tiny_llama, wiki_text, tmp_path, sig):
    """`kill -INT` or `kill` (SIGTERM: systemd, Slurm) of `measure --tp 2` itself (not Ctrl-C's whole process group):
    exit 128 + the signal, said once (not by every rank), and no rank runs on to write the output afterwards."""
    import signal
    import subprocess
    import sys

    import psutil

    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "hqtflow", "measure", str(tiny_llama), "-o", str(out), "--tp", "2", "--text",
           str(wiki_text), "--limit", "2000", "--max-length", "128", "--batch-size", "1"]
    # SIGINT as a terminal gives it: a shell's background job (`... &`, as CI may run) ignores it, so reset it and
    # exec (the same pid). Not with preexec_fn: that makes subprocess fork() this big test process, which the
    # kernel can refuse (ENOMEM), where it otherwise uses vfork.
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
    p = subprocess.Popen([sys.executable, "-c", reset, *cmd], stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = ""
    while "sample/s" not in seen:  # the ranks are calibrating
        ch = p.stderr.read(1)
        assert ch, seen
        seen += ch
    ranks = psutil.Process(p.pid).children(recursive=True)  # torchrun and its ranks
    assert len(ranks) >= 3, ranks
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=120)
    _, alive = psutil.wait_procs(ranks, timeout=60)  # an orphaned rank would run on and write the output
    assert not alive, alive
    assert p.returncode == 128 + getattr(signal, sig), (seen + err)[-3000:]
    assert (seen + err).count("nothing was written") == 1, (seen + err)[-3000:]
    assert not list(tmp_path.iterdir()), sorted(x.name for x in tmp_path.iterdir())


def test_losing_writer_leaves_nothing(tmp_path):
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.artifact import StagingDir, staged_output

    out = tmp_path / "o"
    with pytest.raises(ArtifactError, match="appeared while this run was writing"):
        with staged_output(out) as tmp:
            (tmp / "a").write_text("x")
            out.mkdir()  # the other writer won
            (out / "theirs").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and [p.name for p in out.iterdir()] == ["theirs"]
    stage = StagingDir(tmp_path / "p")
    stage.create()
    assert (stage.path / PARTIAL_MARKER).exists()
    stage.commit()
    assert not (tmp_path / "p" / PARTIAL_MARKER).exists()


def test_files_follow_the_umask(base):
    mode = 0o666 & ~(lambda u: (os.umask(u), u)[1])(os.umask(0))
    for p in base["ck"].iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == mode, p.name


def test_zero_statistics_get_the_floor(base, tmp_path):
    from safetensors.torch import load_file

    m = tmp_path / "m"
    shutil.copytree(base["m"], m)
    stats(m, node(0.0))
    kv(m, 0.0)
    rehash(m)
    r = run_cli("quantize", base["model"], "-m", m, "-o", tmp_path / "ck", "--kv-cache", "fp8")
    assert r.exit_code == 0, r.output
    t = load_file(tmp_path / "ck" / "model.safetensors")
    # the smallest normal number of the scale's dtype: never zero or denormal
    assert t[f"{NODE}.input_scale"].dtype == torch.bfloat16 and t["model.layers.0.self_attn.k_scale"].dtype == torch.float32
    assert float(t[f"{NODE}.input_scale"]) == float(t["model.layers.0.self_attn.k_scale"]) == 2.0**-126
    assert all(float(v.float().min()) >= torch.finfo(v.dtype).tiny for k, v in t.items() if k.endswith("_scale"))


def test_weight_only_needs_no_input_statistics(base, tmp_path):
    """A measurement without input statistics (measure_exclude INPUT) still has its weights' statistics:
    --weight-only (in memory and --disk-offload) quantizes from it; static activations are refused."""
    from safetensors.torch import load_file

    m = tmp_path / "m"
    shutil.copytree(base["m"], m)
    stats(m, lambda raw: [n.update(inputs=[]) for n in raw["Nodes"].values()] and None)
    rehash(m)
    r = run_cli("quantize", base["model"], "-m", m, "-o", tmp_path / "w8a8")
    assert r.exit_code == 3 and "has no input statistics" in r.stderr, r.output
    for out, extra in (("wo", ()), ("wo_offload", ("--disk-offload",))):
        r = run_cli("quantize", base["model"], "-m", m, "-o", tmp_path / out, "--weight-only", *extra)
        assert r.exit_code == 0, r.output
        t = load_file(tmp_path / out / "model.safetensors")
        assert f"{NODE}.weight_scale" in t and not any(k.endswith("input_scale") for k in t)


def test_foreign_measurement_enters_through_import_hqt(base, tmp_path):
    r = run_cli("quantize", base["model"], "-m", base["f1"], "-o", tmp_path / "ck")
    assert r.exit_code == 3 and f"`hqtflow import-hqt {base['f1']} -o OUT" in r.stderr, r.output
    r = run_cli("quantize", "-m", base["i1"], "-o", tmp_path / "ck")  # the model recorded by import-hqt --model
    assert r.exit_code == 0 and "Warning" not in r.stderr, r.output
    assert json.loads((tmp_path / "ck" / MANIFEST).read_text())["data"]["provenance_known"] is False


def test_import_hqt_writes_its_own_npz(base, tmp_path):
    """A foreign .npz is a pickle: without --trust-pickle it is not copied but written afresh from the checked JSON
    (as it is for a rank that came without one)."""
    d = tmp_path / "f2"
    shutil.copytree(base["f2"], d)
    np.savez(d / f"{STEM}_1_2.npz", np.array([print], dtype=object))  # stands for a hostile pickle
    r = run_cli("import-hqt", d, "-o", tmp_path / "i")
    assert r.exit_code == 0, r.output
    ours = tmp_path / "i" / f"{STEM}_1_2.npz"
    assert ours.read_bytes() != (d / f"{STEM}_1_2.npz").read_bytes()
    nodes = np.load(ours, allow_pickle=True)["arr_0"].item()["Nodes"]  # our own file: safe to open here
    raw = json.loads((d / f"{STEM}_1_2.json").read_text())["Nodes"]
    assert set(nodes) == set(raw)
    np.testing.assert_array_equal(nodes[NODE]["inputs"][0], np.asarray(raw[NODE]["inputs"][0], dtype=np.float32))
    # rank 0's dump has no .npz: INC's is written all the same, and its module list, so the artifact is whole
    assert {f"{STEM}_0_2{s}" for s in (".npz", "_mod_list.json")} <= {p.name for p in (tmp_path / "i").iterdir()}
    r = run_cli("import-hqt", d, "-o", tmp_path / "t", "--trust-pickle")  # the user's word: copied as it is
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t" / f"{STEM}_1_2.npz").read_bytes() == (d / f"{STEM}_1_2.npz").read_bytes()


def test_import_hqt_keeps_gaudi_only_attention_nodes(base, tmp_path):
    """optimum-habana's attention nodes (matmul_qk, k_cache, ...) are no module of the HF model: --model accepts them
    inside one of its modules, the artifact keeps them, and import and quantize say in one note they are unused."""
    d = tmp_path / "g"
    shutil.copytree(base["f1"], d)
    attn = "model.layers.0.self_attn"
    stats(d, lambda r: r["Nodes"].update({f"{attn}.matmul_qk": {"inputs": [[[2.0]], [[3.0]]]},
                                          f"{attn}.k_cache": {"inputs": [[[1.5]]]}}))
    r = run_cli("import-hqt", d, "-o", tmp_path / "i", "--model", base["model"])
    note = "Note: 2 Gaudi-only node(s) (matmul_qk, k_cache) are kept for INC on Gaudi but not used by hqtflow's runtime."
    assert r.exit_code == 0 and note in r.stdout, r.output
    assert f"{attn}.matmul_qk" in json.loads((tmp_path / "i" / f"{STEM}.json").read_text())["Nodes"]
    r = run_cli("quantize", "-m", tmp_path / "i", "-o", tmp_path / "ck")
    assert r.exit_code == 0 and note in r.stdout, r.output
    for bad in (f"{attn}.bogus", "model.nowhere.matmul_qk"):  # neither a module nor a Gaudi node of one: refused
        stats(d, lambda r: r["Nodes"].update({bad: {"inputs": [[[1.0]]]}}))
        r = run_cli("import-hqt", d, "-o", tmp_path / "x", "--model", base["model"])
        assert r.exit_code == 3 and "is not a module of" in r.stderr, r.output
        stats(d, lambda r: r["Nodes"].pop(bad) and None)


def test_force_says_what_it_overrides(base, tmp_path):
    d = tmp_path / "f2"
    shutil.copytree(base["f2"], d)
    numsamples(d, 7, 100)
    r = run_cli("import-hqt", d, "-o", tmp_path / "i", "--force")
    assert r.exit_code == 0, r.output
    assert "--force: merging rank 1 although NumSamples 100 differs from rank 0's 7" in r.stderr
    assert json.loads((tmp_path / "i" / MANIFEST).read_text())["data"]["forced"] == ["rank 1: NumSamples 100 differs from rank 0's 7"]
    assert run_cli("unify", "-g", "01", "-m", tmp_path / "i", "-o", tmp_path / "u").exit_code == 3  # said again, or refused
    r = run_cli("unify", "-g", "01", "-m", tmp_path / "i", "-o", tmp_path / "u", "--force")
    assert r.exit_code == 0, r.output
    assert "--force: merging rank 1 although NumSamples 100 differs from rank 0's 7" in r.stderr
    forced = json.loads((tmp_path / "u" / MANIFEST).read_text())["data"]["forced"]
    assert forced == ["rank 1: NumSamples 100 differs from rank 0's 7"]


def test_chunked_body_limit_holds_while_streaming(tiny_llama):
    """A chunked body (no content-length) gets its 413 once it passes the limit, not after the client finished."""
    from conftest import running
    from hqtflow import models
    from hqtflow.runtime.server import ServeSettings, create_app

    settings = ServeSettings(max_input_tokens=32, max_total_tokens=64)
    app = create_app(models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama), settings)
    with running(app) as url:
        host, port = url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * (64 << 10)
            for _ in range((settings.payload_limit * 3 // 2) // len(chunk)):  # 1.5x the limit, and the body never ends
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            assert s.recv(64).startswith(b"HTTP/1.1 413")


def test_inspect_reads_a_manifest_with_odd_shapes(base, tmp_path):
    """Manifest fields inspect only reports (calibration, per-rank layers) of an unexpected type are left out, not a
    traceback: the files the manifest hashes are what inspect checks."""
    m = tmp_path / "m"
    shutil.copytree(base["m"], m)
    edit_manifest(m, lambda raw: raw["data"].update(calibration="x"))
    r = run_cli("inspect", m)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
