"""A gated MLP's FP8 down_proj with its input made inside the kernel (`fp8_linear_gated`, `gated_mlp.py`) is bit for
bit the unfused `down_proj(act_fn(gate) * up)`: on every build of the kernel, every M of the sweep, odd K and N,
W8A8 and weight-only; and in a model, where only activations that pass `act_table`'s check are fused."""

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from hqtflow.quantize.fp8_linear import FP8Linear, set_backend

MS = [1, 2, 7, 9, 16, 33, 64, 65, 256, 512]
HP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _variants():
    """This machine's build, the AVX2-only twin, the one-lane build, and on AMX machines the build without tiles."""
    from hqtflow.hardware import cpu_flags

    return ["native", "avx2", "scalar"] + (["bf16dot"] if "amx_bf16" in cpu_flags() else [])


@pytest.fixture(scope="module", params=_variants())
def ops(request, cpu_kernel_loaded):
    from conftest import need

    variant = request.param
    need(cpu_kernel_loaded.load(variant), f"the {variant} kernel could not be built: {cpu_kernel_loaded.build_error(variant)}")
    return cpu_kernel_loaded.ops(variant)


def _down(k, n, hp, mode):
    torch.manual_seed(k + n)
    lin = torch.nn.Linear(k, n, bias=mode == "bias").to(hp)
    per_channel = mode == "per-channel"
    ws = (lin.weight.abs().amax(1) if per_channel else lin.weight.abs().max()) / 224
    s_x = None if mode == "weight-only" else torch.tensor(0.0123, dtype=hp)
    return FP8Linear.from_linear(lin, ws.to(hp), s_x)


@pytest.mark.parametrize("k,n", [(100, 37), (1537, 67), (1536, 576)])
@pytest.mark.parametrize("hp", list(HP))
@pytest.mark.parametrize("mode", ["w8a8", "weight-only", "per-channel", "bias"])
def test_gated_down_is_the_unfused_one_bit_for_bit(ops, k, n, hp, mode):
    """fp8_linear_gated(gate, up, act) == fp8_linear(act(gate) * up) on every row, whatever M (so a row's result does
    not depend on its neighbours either: the unfused op's rows do not)."""
    from hqtflow.quantize.gated_mlp import act_table

    dt = HP[hp]
    down = _down(k, n, dt, mode)
    table = act_table(F.silu, dt)
    gate, up = (torch.randn(max(MS), k) * 4).to(dt), (torch.randn(max(MS), k) * 2).to(dt)
    args = (down.weight, down.weight_scale, down.input_scale, down.bias)
    whole = ops.fp8_linear_gated(gate, up, table, *args)
    assert torch.equal(whole, ops.fp8_linear(F.silu(gate) * up, *args))
    for m in MS[:-1]:
        assert torch.equal(ops.fp8_linear_gated(gate[-m:], up[-m:], table, *args), whole[-m:]), m


def test_act_table_is_the_activation_where_position_does_not_matter(cpu_kernel_loaded):
    """SiLU and ReLU: the table is the activation of every bit pattern (and a lookup gives the activation of any
    tensor); tanh-GELU, whose torch value of an input depends on the loop that computes it, and functions that are not
    element-wise, get no table."""
    from hqtflow.quantize.gated_mlp import act_table

    for dt in HP.values():
        values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dt)
        for name in ("silu", "relu"):
            table = act_table(ACT2FN[name], dt)
            assert table.shape == (65537,) and table.dtype == dt
            want = ACT2FN[name](values)
            assert torch.equal(table[:65536].view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
            x = (torch.randn(3, 37) * 5).to(dt)
            looked_up = table[x.view(torch.int16).long() & 0xFFFF]
            assert torch.equal(looked_up, ACT2FN[name](x))
        assert act_table(ACT2FN["gelu_pytorch_tanh"], dt) is None
        assert act_table(lambda t: t.softmax(0), dt) is None
        assert act_table(lambda t: t.float(), dt) is None


def test_gated_op_refuses_what_it_cannot_compute(cpu_kernel_loaded):
    from hqtflow.quantize.gated_mlp import act_table

    down = _down(64, 8, torch.bfloat16, "w8a8")
    args = (down.weight, down.weight_scale, down.input_scale, down.bias)
    g = torch.randn(2, 64, dtype=torch.bfloat16)
    table = act_table(F.silu, torch.bfloat16)
    with pytest.raises(RuntimeError, match="gate must be bfloat16 or float16"):
        torch.ops.hqtflow.fp8_linear_gated(g.float(), g.float(), table, *args)
    with pytest.raises(RuntimeError, match="up must have gate's shape"):
        torch.ops.hqtflow.fp8_linear_gated(g, g[:1], table, *args)
    with pytest.raises(RuntimeError, match="65537-entry table"):
        torch.ops.hqtflow.fp8_linear_gated(g, g, table[:65536], *args)
    with pytest.raises(RuntimeError, match="65537-entry table"):
        torch.ops.hqtflow.fp8_linear_gated(g, g, act_table(F.silu, torch.float16), *args)


def _fp8_llama(dt):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(dt).eval()
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(layer.mlp, name)
            setattr(layer.mlp, name, FP8Linear.from_linear(lin, lin.weight.abs().max() / 448, torch.tensor(0.02, dtype=dt)))
    layer = model.model.layers[2]  # a Gemma-style activation here: not fused
    layer.mlp.act_fn = ACT2FN["gelu_pytorch_tanh"]
    return model


@pytest.mark.parametrize("hp", list(HP))
def test_model_mlps_are_fused_on_the_cpu_backend_and_give_the_same_logits(cpu_kernel_loaded, hp):
    """set_backend("cpu") fuses the SiLU MLPs (not the tanh-GELU one), the logits are the unfused model's bit for bit
    and a row's logits do not depend on the batch; another backend gives every MLP its own forward back."""
    from hqtflow.quantize import gated_mlp

    model = _fp8_llama(HP[hp])
    keys = list(model.state_dict())
    ids = torch.randint(0, 300, (4, 21))
    with torch.inference_mode():
        set_backend(model, "cpu")
        fused = ["forward" in layer.mlp.__dict__ for layer in model.model.layers]
        assert fused == [True, True, False] and list(model.state_dict()) == keys
        got = model(ids).logits
        assert gated_mlp.use_kernel(model, False) == 0 and not any("forward" in l.mlp.__dict__ for l in model.model.layers)
        assert torch.equal(model(ids).logits, got)
        assert gated_mlp.use_kernel(model, True) == 2
        assert torch.equal(model(ids[1:2]).logits, got[1:2])
        set_backend(model, "qdq")
        assert not any("forward" in layer.mlp.__dict__ for layer in model.model.layers)
