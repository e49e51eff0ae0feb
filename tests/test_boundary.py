"""Bad input at the library's public boundary fails with ONE error that names the argument, the
bad value and the fix (issue 20): ids for forward / prefill / generate / run_with_cache, token
counts, bug names, a CUDA read on a CPU-only box."""
from __future__ import annotations

import pytest
import torch

import dsv4lab
from dsv4lab.bugzoo import BUGS, UnknownBugError, inject
from dsv4lab.checkpoint import CheckpointError, CheckpointReader, DeviceUnavailableError
from dsv4lab.checkpoint.locate import resolve_path
from dsv4lab.checkpoint.synth import SynthError, preset_config
from dsv4lab.config import config_from_dict
from dsv4lab.model.validate import InputError, parse_dtype
from dsv4lab.workbench import random_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
            o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=8,
            layer_types=["sliding_attention", "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe"], hc_sinkhorn_iters=5, swiglu_limit=1.0, routed_scaling_factor=1.5)


@pytest.fixture(scope="module")
def model():
    return random_model(config_from_dict(TINY), seed=0)


BAD_IDS = {
    "empty prompt": (torch.zeros(1, 0, dtype=torch.long), "empty"),
    "1-D ids": (torch.arange(5), "unsqueeze(0)"),
    "float ids": (torch.ones(1, 4), ".long()"),
    "out-of-range id": (torch.tensor([[1, 2, 97]]), "97"),
    "negative id": (torch.tensor([[1, -1]]), "-1"),
    "not a tensor": ([[1, 2, 3]], "torch.Tensor"),
    "wrong device": (torch.ones(1, 3, dtype=torch.long, device="meta"), ".to(model.device)"),
}

ENTRY_POINTS = {
    "forward": lambda m, ids: m(ids),
    "prefill": lambda m, ids: m.prefill(ids, m.new_state(1, 8)),
    "generate": lambda m, ids: m.generate(ids, max_new_tokens=2),
    "run_with_cache": lambda m, ids: m.run_with_cache(ids),
    "hook_schema": lambda m, ids: m.hook_schema(ids),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(BAD_IDS))
def test_bad_ids(model, entry, case):
    ids, hint = BAD_IDS[case]
    with pytest.raises(InputError) as e:
        ENTRY_POINTS[entry](model, ids)
    msg = str(e.value)
    assert "input_ids" in msg and hint in msg, msg
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("n", [-1, 0, 2.5, "4", None, True])
def test_bad_max_new_tokens(model, n):
    with pytest.raises(InputError, match="max_new_tokens") as e:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=n)
    assert repr(n) in str(e.value) or str(n) in str(e.value)


def test_good_ids_still_work(model):
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    assert out.shape == (1, 5)
    assert model(torch.tensor([[1, 2, 3]], dtype=torch.int32)).shape == (1, 3, 97)


def test_unknown_bug_name(model):
    with pytest.raises(UnknownBugError) as e:
        inject(model, "sink_scald")
    msg = str(e.value)
    assert isinstance(e.value, KeyError)
    assert "bug='sink_scald'" in msg and "did you mean 'sink_scaled'" in msg and "--list" in msg
    assert "sink_scald" not in BUGS
    with pytest.raises(UnknownBugError, match="bug="):
        model.inject("nope")


def test_cuda_read_without_cuda_blames_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only box, also on a GPU machine
    reader = CheckpointReader(resolve_path(None))
    with pytest.raises(DeviceUnavailableError) as e:
        reader.tensor("embed.weight", "cuda")
    msg = str(e.value)
    assert "device='cuda'" in msg and "CUDA is not available" in msg and "pin_memory" not in msg
    with pytest.raises(DeviceUnavailableError, match="device='cuda'"):
        dsv4lab.load(device="cuda", progress=False)


@pytest.mark.parametrize("dtype, said", [("float17", "did you mean 'float16'"), ("bfloat", "'bfloat16'"),
                                         (torch.int32, "not allowed here (use one of float32, bfloat16, float16)"),
                                         ("fp8", "not allowed here")])
def test_load_bad_dtype_names_it(dtype, said):
    """A bad compute dtype fails before any weight is read, naming the argument (not torch's
    TypeError from a .to() deep inside materialize)."""
    with pytest.raises(InputError, match=r"dtype=") as e:
        dsv4lab.load(dtype=dtype, progress=False)
    assert said in str(e.value)


def test_load_dtype_by_name_is_the_dtype():
    """Notebook parameters arrive as strings: "bf16" loads what torch.bfloat16 loads."""
    assert parse_dtype("bf16") is parse_dtype("torch.bfloat16") is parse_dtype(torch.bfloat16) is torch.bfloat16
    m = dsv4lab.load(dtype="bf16", progress=False)
    assert m.embed.weight.dtype == torch.bfloat16


def test_embedded_name_misspelt_suggests_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # no file of that name here
    with pytest.raises(CheckpointError, match=r"'tiny-nvfp': no such checkpoint.*did you mean 'tiny-nvfp4'"):
        dsv4lab.load("tiny-nvfp", progress=False)
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory$"):
        dsv4lab.load("elsewhere", progress=False)   # not close to a bundled name: the path's own error


IDS = torch.tensor([[1, 2, 3]])

# (call, error type, what the message must say): each a bad argument at a public entry point that
# used to surface as an AttributeError / IndexError / torch error from deep inside, or ran on
BAD_ARGUMENTS = {
    "generate state not a state": (lambda m: m.generate(IDS, 2, state="abc"), InputError,
                                   "state must be a DecodeState"),
    "generate state too short": (lambda m: m.generate(IDS, 5, state=m.new_state(1, 4)), InputError,
                                 "need 7 (use model.new_state(1, 7)"),
    "generate state other batch": (lambda m: m.generate(IDS, 2, state=m.new_state(2, 8)), InputError,
                                   "holds 2 sequences but input_ids has 1"),
    "generate graph state": (lambda m: m.generate(IDS, 2, state=[], decode="graph"), InputError,
                             "state must be a DecodeState"),
    "generate eos not an id": (lambda m: m.generate(IDS, 2, eos_token_id="x"), InputError,
                               "eos_token_id must be one int"),
    "generate eos outside vocab": (lambda m: m.generate(IDS, 2, eos_token_id=97), InputError, "outside the vocabulary"),
    "cache reduce a name": (lambda m: m.run_with_cache(IDS, reduce="maen"), InputError,
                            "did you mean cache.mean(...)?"),
    "cache reduce dict value": (lambda m: m.run_with_cache(IDS, reduce={"**": 3}), InputError, "reduce['**']=3"),
    "cache device": (lambda m: m.run_with_cache(IDS, device="gpu"), InputError, "device='gpu' is not a device"),
    "cache keep": (lambda m: m.run_with_cache(IDS, keep="lst"), ValueError, "did you mean 'last'?"),
    "cache on_overflow": (lambda m: m.run_with_cache(IDS, on_overflow="rase"), ValueError, "did you mean 'raise'?"),
    "cache generate": (lambda m: m.run_with_cache(IDS, generate=-1), InputError, "generate must be an int >= 0"),
    "compare other": (lambda m: m.compare("x", IDS), InputError,
                      "must be a DSV4 model or (model, intervention), got str"),
    "compare tol": (lambda m: m.compare(m, IDS, tol=-1), InputError, "tol must be a number >= 0"),
    "inject layer out of range": (lambda m: m.inject("compressor_ape_on_kv", layers=[99]), InputError,
                                  "99 is no layer index of this model (use ints in 0..1"),
    "inject layer a string": (lambda m: m.inject("compressor_ape_on_kv", layers=["1"]), InputError, "'1' is no layer"),
    "precision floor threshold": (lambda m: m.precision_floor(IDS, threshold=-1), InputError, "threshold must be"),
    "precision floor max_steps": (lambda m: m.precision_floor(IDS, threshold=0.1, max_steps=-2), InputError,
                                  "max_steps must be"),
    "plan context": (lambda m: dsv4lab.plan("v4-pro", context=-5), ValueError, "context must be an int >= 1"),
    "plan batch": (lambda m: dsv4lab.plan("v4-pro", batch=0), ValueError, "batch must be an int >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_named_at_the_boundary(model, case):
    call, err, said = BAD_ARGUMENTS[case]
    with pytest.raises(err) as e:
        call(model)
    assert said in str(e.value), str(e.value)


def test_state_with_room_exactly_is_enough(model):
    """S + max_new_tokens - 1 positions: the last new token is never fed back."""
    out = model.generate(IDS, 3, state=model.new_state(1, 5))
    assert out.shape == (1, 6)
    assert torch.equal(out, model.generate(IDS, 3))


def test_prompt_mode_and_device_named():
    """A misspelt prompt mode or device fails naming the argument, with did-you-mean / the forms
    a device takes (was: a ValueError about thinking_mode; torch's device-string RuntimeError)."""
    from dsv4lab.text import encode_prompt
    with pytest.raises(ValueError, match=r"mode='chatt' is not a prompt mode; did you mean 'chat'\?"):
        encode_prompt("hi", mode="chatt")
    with pytest.raises(ValueError, match=r"device='gpu' is not a device \(use 'cpu', 'cuda'"):
        dsv4lab.load(device="gpu", progress=False)
    with pytest.raises(ValueError, match=r"device_map\[1\]='cpuu' is not a device"):
        dsv4lab.load(device_map=["cpu", "cpuu"] + ["cpu"] * 4, progress=False)


def test_misspelt_preset_suggests_the_listed_name_not_an_alias():
    """The hint names what the error lists ('v4-pro'), not one of its aliases ('v4_pro')."""
    with pytest.raises(SynthError) as err:
        preset_config("v4-prp")
    msg = str(err.value)
    assert "did you mean 'v4-pro'?" in msg and "v4_pro" not in msg, msg
