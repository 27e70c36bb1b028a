"""The HPU adapter (`hqtflow.engines.hpu`) on CPU: TGI-Gaudi-style bucketing, the refusal when the Gaudi stack is
absent, and each wrapper calling the Habana API it is named after (a stand-in `habana_frameworks` records the calls;
the real stack is never available here)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from hqtflow.engines import hpu, resolve
from hqtflow.errors import ConfigError


def test_round_up_and_bucketed_shape():
    assert [hpu.round_up(n, 16) for n in (0, 1, 15, 16, 17, 33)] == [0, 16, 16, 16, 32, 48]
    assert hpu.round_up(7, 1) == 7
    assert hpu.bucketed_shape(3, 70, batch_bucket=4, pad_to_multiple=64) == (4, 128)
    assert hpu.bucketed_shape(8, 64, batch_bucket=4, pad_to_multiple=64) == (8, 64)
    assert hpu.bucketed_shape(1, 100, pad_to_multiple=128, max_length=112) == (1, 112)  # capped, not past the limit
    with pytest.raises(ConfigError, match="longer than the maximum 112"):
        hpu.bucketed_shape(1, 113, max_length=112)
    with pytest.raises(ValueError):
        hpu.round_up(3, 0)


def test_pad_to_bucket_left_pads():
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    pids, pmask = hpu.pad_to_bucket(ids, mask, pad_id=0, batch_bucket=4, pad_to_multiple=4)
    assert pids.shape == pmask.shape == (4, 4)
    assert pids.tolist() == [[0, 5, 6, 7], [0, 0, 8, 9], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert pmask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert pids.dtype == ids.dtype and pmask.dtype == mask.dtype


def test_absent_stack_is_refused_in_one_sentence():
    if hpu.available():  # pragma: no cover - a Gaudi machine
        pytest.skip("habana_frameworks is installed here")
    with pytest.raises(ConfigError, match=r"needs the Intel Gaudi software stack \(habana_frameworks.torch\)"):
        hpu.import_habana()
    for call in (hpu.mark_step, lambda: hpu.wrap_in_hpu_graph(torch.nn.Linear(2, 2)), lambda: hpu.to_hpu(torch.ones(1))):
        with pytest.raises(ConfigError, match="habana_frameworks"):
            call()
    assert resolve("inc", None) == "cpu"  # the default device off Gaudi
    with pytest.raises(ConfigError, match="use --device cpu"):
        resolve("inc", "hpu")
    with pytest.raises(ConfigError, match="valid values are cpu, hpu"):
        resolve("inc", "cuda")
    assert resolve("hqtflow", None) is None


@pytest.fixture
def fake_habana(monkeypatch):
    """A stand-in `habana_frameworks.torch` (+ `.core`, `.hpu`) that records what the adapter calls."""
    calls = []

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    module("habana_frameworks")
    module("habana_frameworks.torch")
    module("habana_frameworks.torch.core", mark_step=lambda: calls.append("mark_step"))
    module("habana_frameworks.torch.hpu", wrap_in_hpu_graph=lambda model: calls.append("wrap_in_hpu_graph") or ("graphed", model))
    return calls


def test_wrappers_call_the_habana_api(fake_habana):
    assert hpu.available() and resolve("inc", None) == "hpu"  # the default device on Gaudi
    hpu.mark_step()
    model = torch.nn.Linear(2, 2)
    assert hpu.wrap_in_hpu_graph(model) == ("graphed", model)
    assert fake_habana == ["mark_step", "wrap_in_hpu_graph"]

    class Movable:
        def to(self, device):
            return device

    assert hpu.to_hpu(Movable()) == "hpu"
