"""A measurement file's statistics are maxabs values kept in float32: `read_measurement` refuses any other number."""

import json
import re

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
