"""maxabs observers against plain numpy references, with padding excluded."""

import numpy as np
import torch

from hqtflow.measure.observers import MaxAbs, MaxAbsPerChannel, weight_stat


def test_per_tensor_running_max_float32():
    torch.manual_seed(0)
    xs = [torch.randn(2, 5, 8, dtype=torch.bfloat16) * s for s in (1.0, 3.0, 0.5)]
    obs = MaxAbs()
    for x in xs:
        obs.update(x)
    ref = max(np.abs(x.float().numpy()).max() for x in xs)
    assert obs.state.dtype == torch.float32 and obs.state.shape == (1, 1)
    assert obs.state.item() == ref  # exact: a max of bf16 values is a bf16 value


def test_padding_is_not_observed():
    x = torch.ones(2, 4, 3)
    x[1, 3] = 100.0  # a padding position holding a huge value
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    obs = MaxAbs()
    obs.update(x, mask)
    assert obs.state.item() == 1.0
    pc = MaxAbsPerChannel(-1)
    pc.update(x, mask)
    assert pc.state.flatten().tolist() == [1.0, 1.0, 1.0]
    # flattened tokens (MoE blocks) use the same mask
    flat = MaxAbs()
    flat.update(x.reshape(8, 3), mask)
    assert flat.state.item() == 1.0


def test_all_padding_leaves_state_unused():
    obs = MaxAbs()
    obs.update(torch.ones(1, 2, 3), torch.zeros(1, 2, dtype=torch.bool))
    assert not obs.used and obs.state.item() == 0.0


def test_per_channel_activation_and_weight():
    torch.manual_seed(1)
    x = torch.randn(3, 7, 6)
    pc = MaxAbsPerChannel(-1)
    pc.update(x)
    pc.update(x * 2)
    np.testing.assert_array_equal(pc.state.numpy()[:, 0], np.abs(x.numpy() * 2).reshape(-1, 6).max(0))
    w = torch.randn(5, 4)
    np.testing.assert_array_equal(weight_stat(w, True).numpy()[:, 0], np.abs(w.numpy()).max(1))
    assert weight_stat(w, False).item() == np.abs(w.numpy()).max()


def test_right_padding_prefix_path_equals_mask_path():
    torch.manual_seed(2)
    x = torch.randn(3, 6, 4, dtype=torch.bfloat16)
    x[0, 4:] = 50.0
    x[2, 1:] = -70.0
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    a, b = MaxAbs(), MaxAbs()
    a.update(x, mask)
    b.update(x, mask, lengths=[4, 6, 1])
    ref = np.abs(x.float().numpy()[mask.numpy()]).max()
    assert a.state.item() == b.state.item() == ref


def test_observers_accept_tensors_that_require_grad():
    x = torch.randn(2, 3, 4, requires_grad=True) * 2
    for obs in (MaxAbs(), MaxAbsPerChannel(-1)):
        obs.update(x)
        obs.update(x)
        assert obs.used
