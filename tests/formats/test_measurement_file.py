"""A measurement file's statistics are maxabs values kept in float32: `read_measurement` refuses any other number."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from hqtflow.errors import ArtifactError
from hqtflow.formats.measurement import read_measurement


@pytest.mark.parametrize("value, problem", [
    (0.0, None),
    (-0.5, "has a negative input statistic (-0.5), which no maxabs can be; the file is corrupt."),
    (1e39, "holds the input statistic 1e+39, beyond float32's range (3.4e+38) and so any model dtype's; re-measure it."),
])
def test_a_statistic_no_maxabs_can_be_is_refused(tmp_path, value, problem):
    path = tmp_path / "m_hooks_maxabs.json"
    path.write_text(json.dumps({"Mode": "DynamicRange", "Nodes": {"q": {"inputs": [[[value]]]}}}))
    if problem is None:
        assert read_measurement(path).nodes["q"].inputs[0].tolist() == [[value]]
        return
    with pytest.raises(ArtifactError, match=f"^{re.escape(f'{path}: module q {problem}')}$"):
        read_measurement(path)


def test_macos_appledouble_twins_in_a_dump_are_not_measurements(tmp_path):
    """A dump copied from a Mac holds `._<name>` AppleDouble files beside INC's; they made scan_dump (import-hqt)
    see two measurements ("._measure_hooks_maxabs, measure_hooks_maxabs") and copy a `._` scale file."""
    from hqtflow.formats.measurement import read_dump, scan_dump

    raw = {"GlobalRank": None, "LocalRank": None, "Mode": "DynamicRange", "Nodes": {"q": {"inputs": [[[1.0]]]}}}
    (tmp_path / "measure_hooks_maxabs.json").write_text(json.dumps(raw))
    (tmp_path / "measure_hooks_maxabs_MAXABS_HW.json").write_text("{}")
    for name in ("._measure_hooks_maxabs.json", "._measure_hooks_maxabs_mod_list.json",
                 "._measure_hooks_maxabs_MAXABS_HW.json", ".DS_Store"):
        (tmp_path / name).write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")
    dump = scan_dump(tmp_path)
    assert list(dump.groups) == [("measure", "maxabs", 1)]
    assert dump.scale_files == [tmp_path / "measure_hooks_maxabs_MAXABS_HW.json"]
    assert read_dump(tmp_path).ranks[0].nodes["q"].inputs[0].tolist() == [[1.0]]


def test_load_measurement_hashes_each_file_once(tmp_path, monkeypatch):
    """The rank files were hashed by read_manifest and again by verified_bytes (which parses what it hashes): now
    every file the manifest lists is hashed once, the rank files as they are parsed."""
    from collections import Counter

    from hqtflow.formats import artifact, measurement
    from hqtflow.formats.measurement import NodeStats, load_measurement, write_artifact, write_measurement

    stems = [f"measure_hooks_maxabs_{r}_2" for r in range(2)]
    for r, stem in enumerate(stems):
        write_measurement(tmp_path, stem, {"q": NodeStats(inputs=[np.full((1, 1), r + 1.0)])}, local_rank=r,
                          num_samples=1)
    write_artifact(tmp_path, tmp_path, base="measure", inc_config={}, model=None, config={},
                   data={"world_size": 2, "ranks": [{"stem": s} for s in stems]})
    hashed = Counter()  # a file's name, each time its bytes are hashed (by path, or as read by verified_bytes)
    sha256_file, verified_bytes = artifact.sha256_file, artifact.verified_bytes
    monkeypatch.setattr(artifact, "sha256_file", lambda p, *a: hashed.update([Path(p).name]) or sha256_file(p, *a))
    monkeypatch.setattr(measurement, "verified_bytes", lambda m, rel: hashed.update([rel]) or verified_bytes(m, rel))
    loaded = load_measurement(tmp_path)
    assert [m.nodes["q"].inputs[0].item() for m in loaded.ranks] == [1.0, 2.0]
    assert hashed == Counter(list(loaded.manifest.files))  # each listed file once: 2 ranks x 3 twins + quant_config.json
