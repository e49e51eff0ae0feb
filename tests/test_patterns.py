"""One pattern dialect (dsv4lab.patterns) for hook filters and component patterns, and the
did-you-mean errors a typo gets instead of an empty result."""
import pytest
import torch

from dsv4lab.patterns import close_names, matches, name_matcher, unmatched
from dsv4lab.train.tiny_config import tiny_dsv4_config
from dsv4lab.workbench import random_model


@pytest.mark.parametrize("pattern,name,ok", [
    ("layers.*.attn.hook_probs", "layers.3.attn.hook_probs", True),
    ("layers.*.attn.hook_probs", "layers.3.attn.indexer.hook_probs", False),   # * is one segment
    ("**.hook_probs", "layers.3.attn.hook_probs", True),
    ("**.router.hook_ids", "layers.0.mlp.router.hook_ids", True),
    ("layers.*.mlp.experts.*", "layers.1.mlp.experts.3", True),
    ("layers.*.mlp.experts.*", "layers.1.mlp.experts.3.w1", False),           # not the linears
    ("**", "hook_logits", True),
    ("hook_logits", "hook_logits", True),
    ("layers.1*", "layers.12.attn", False),
])
def test_segment_dialect(pattern, name, ok):
    assert matches(pattern, name) is ok
    assert name_matcher(pattern)(name) is ok


def test_unmatched_and_suggestions():
    names = ["layers.0.attn.compressor.hook_weights", "layers.1.attn.compressor.hook_weights", "hook_logits"]
    assert unmatched(["layers.*.attn.compressor.hook_wieghts", "hook_logits"], names) == ["layers.*.attn.compressor.hook_wieghts"]
    assert close_names("layers.*.attn.compressor.hook_wieghts", names)[0] == "layers.*.attn.compressor.hook_weights"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(tiny_dsv4_config(256), seed=0)


def test_run_with_cache_typo_names_the_argument_and_suggests(model):
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(KeyError, match=r"names='layers\.\*\.attn\.compressor\.hook_wieghts' matches no hook point; "
                                       r"did you mean 'layers\.\*\.attn\.compressor\.hook_weights'"):
        model.run_with_cache(ids, names=["layers.*.attn.compressor.hook_wieghts"])
    with pytest.raises(KeyError, match="reduce="):
        model.run_with_cache(ids, names="hook_logits", reduce={"**.hook_prbs": lambda t: t})


def test_component_typo_suggests(model):
    with pytest.raises(KeyError, match=r"pattern='layers\.1\.attn\.compresor' matches no component; did you mean"):
        model.replace("layers.1.attn.compresor", lambda *a, **k: None)
