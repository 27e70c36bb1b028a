"""The INC scale-file reader refuses a node unlike what `scale_entry` writes, naming the node and what is wrong."""

import re

import pytest

from hqtflow.errors import ArtifactError
from hqtflow.formats.scale_files import read_scale_file, write_scale_file


@pytest.mark.parametrize("node, problem", [
    ({"inputs": [0.5], "params": {"weight": 1.0}}, None),
    ({"inputs": [0.5], "params": {"weight": 1.0, "bias": 1.0}}, "has fields a scale file does not have"),
    ({"inputs": [0.5], "params": {"weight": 1.0}, "extra": 1}, "has fields a scale file does not have"),
])
def test_a_node_with_fields_a_scale_file_does_not_have_is_refused(tmp_path, node, problem):
    write_scale_file(tmp_path, "s", {"m.q": node}, local_rank=None)
    if problem is None:
        assert read_scale_file(tmp_path / "s.json") == {"m.q": node}
        return
    with pytest.raises(ArtifactError, match=f"^{re.escape(str(tmp_path / 's.json'))}: node 'm.q' {problem}; the file is corrupt.$"):
        read_scale_file(tmp_path / "s.json")
