"""Every registered family, enumerated from the registry: Hugging Face parity both ways (from the family's
tiny HF configs), its parallel plan against its debug model, incremental decoding through the inner
attention (what generators override), and the registration checks. A new family is tested here by
registering it; no table in this file names a family."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from tm_reference import build, load_hf, rel_err, save_hf
from torch import nn

import titan_models as tm
from titan_models import registry
from titan_models.components.sinks import eager_attention
from titan_models.parallel_plan import TP_STYLES

FAMILIES = [f.name for f in tm.families()]
HF_CASES = [(f.name, case) for f in tm.families() for case in f.tiny_hf_configs]
HF_IDS = [f"{f}-{case}" for f, case in HF_CASES]
DEBUG = [(f.name, n) for f in tm.families() for n in f.flavors if n.startswith("debug")]
DEBUG_IDS = [f"{f}-{n}" for f, n in DEBUG]
GENERATING = [(f, n) for f, n in DEBUG if tm.family(f).kv_cache_generation]
SEQ = 80  # longer than 64, past the tiny configs' original RoPE context


def _tokens(vocab: int, *, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))


def _hf_config(case: tm.TinyHFCase) -> transformers.PretrainedConfig:
    fields = dict(case.config)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def test_the_registry_lists_families_with_their_flavors():
    assert FAMILIES == sorted(FAMILIES) and {"llama3", "qwen3", "deepseek_v3"} <= set(FAMILIES)
    for record in tm.families():
        assert tm.flavors(record.name) == list(record.flavors)
        assert tm.family_of(tm.flavor(record.name, "debug")) is record
        if record.config_type.__module__.startswith("titan_models.models."):
            assert getattr(tm, record.name).__name__ == f"titan_models.models.{record.name}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_with_a_converter_has_tiny_hf_configs(family):
    record = tm.family(family)
    if record.hf is not None:
        assert record.tiny_hf_configs, f"{family} has a converter but no tiny_hf_configs for the parity tests"
        covered = {a for c in record.tiny_hf_configs.values() for a in c.config["architectures"]}
        left_out = set(record.hf_architectures) - covered
        assert not left_out, f"{family}: the parity cases leave out {sorted(left_out)}"


@pytest.mark.parametrize(("family", "case"), HF_CASES, ids=HF_IDS)
def test_from_hf_matches_transformers(tmp_path, family, case):
    tiny = tm.family(family).tiny_hf_configs[case]
    reference = save_hf(_hf_config(tiny), tmp_path, auto_class=tiny.auto_class, prepare=tiny.prepare)
    assert type(reference).__name__ in tm.family(family).hf_architectures
    model = tm.from_hf(tmp_path)
    assert tm.family_of(model.config).name == family
    tokens = _tokens(model.config.vocab_size)
    positions = torch.arange(SEQ).expand(2, SEQ) + torch.tensor([[0], [37]])  # a later window for row 1
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5
        if tiny.shifted_positions:
            assert rel_err(model(tokens, positions=positions),
                           reference(tokens, position_ids=positions).logits) < 1e-5
        model.norm.weight.copy_(model.norm.weight.flip(0))  # control: one wrong tensor is far outside the tolerance
        assert rel_err(model(tokens), reference(tokens).logits) > 1e-3


@pytest.mark.parametrize(("family", "case"), HF_CASES, ids=HF_IDS)
def test_to_hf_loads_in_transformers_with_the_same_logits(tmp_path, family, case):
    record = tm.family(family)
    tiny = record.tiny_hf_configs[case]
    config = record.hf.config_from_hf(dict(tiny.config), set())
    model = build(config, seed=5)
    with torch.no_grad():  # init_weights sets norms to one, which would hide a swapped norm
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    tm.to_hf(model, tmp_path)
    written_as = tiny.written_as or tiny.config["architectures"][0]
    reference = load_hf(tmp_path, auto_class="AutoModelForCausalLM" if tiny.written_as else tiny.auto_class)
    assert type(reference).__name__ == written_as
    tokens = _tokens(config.vocab_size)
    with torch.no_grad():
        assert rel_err(reference(tokens).logits, model(tokens)) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(tokens), model(tokens))  # and back, bitwise


def _hf_tensor_names(converter, model: nn.Module) -> set[str]:
    """The tensor names `to_hf` would write for `model` (a meta model: names only)."""
    names = {n for name in model.state_dict() if not (model.config.tie_embeddings and name == "output.weight")
             for n in converter.hf_names(model.config, name)}
    return names | {n for n, _ in converter.extra_tensors(model)}


def test_every_flavor_survives_the_hf_config_round_trip():
    for record in tm.families():
        if record.hf is None:
            continue
        for name, config in record.flavors.items():
            with torch.device("meta"):
                model = config.build()
            hf = record.hf.config_to_hf(config)
            again = record.hf.config_from_hf(hf, _hf_tensor_names(record.hf, model))
            assert record.hf.config_to_hf(again) == hf, (record.name, name)
            assert tm.count_params(again) == tm.count_params(model), (record.name, name)


def _matching(model: nn.Module, pattern: str) -> list[str]:
    parts = pattern.split(".")
    return [n for n, _ in model.named_modules() if len(n.split(".")) == len(parts) and
            all(p in ("*", q) for p, q in zip(parts, n.split(".")))]


_TP_MODULES = {"colwise": nn.Linear, "rowwise": nn.Linear, "output": nn.Linear, "embedding": nn.Embedding}


@pytest.mark.parametrize(("family", "name"), DEBUG, ids=DEBUG_IDS)
def test_parallel_plan_names_modules_of_the_debug_model(family, name):
    config = tm.flavor(family, name)
    with torch.device("meta"):
        model = config.build()
    plan = model.parallel_plan
    assert plan == config.parallel_plan()
    for pattern, style in plan.tensor_parallel.items():
        names = _matching(model, pattern)
        assert names, f"tensor-parallel pattern {pattern!r} matches no module"
        assert style in TP_STYLES
        for module_name in names:
            module = model.get_submodule(module_name)
            assert isinstance(module, _TP_MODULES.get(style, nn.Module)), (pattern, style, type(module))
    for pattern in (*plan.experts, *plan.moe, *plan.pipeline_cut_points, plan.activation_checkpoint_unit):
        assert _matching(model, pattern), f"plan pattern {pattern!r} matches no module"
    assert len(_matching(model, "layers.*")) == config.num_layers
    moe_layers = {str(i) for i in range(config.num_layers) if config.is_moe_layer(i)}
    assert {n.split(".")[1] for p in plan.moe for n in _matching(model, p)} == moe_layers
    if not plan.tensor_parallel:  # a family without tensor parallelism must refuse every degree > 1
        with pytest.raises(ValueError, match="tensor parallel degree 2"):
            plan.check_tensor_parallel(2)
        return
    # every parameter is split by the plan, or lies in routed experts (expert parallelism's business)
    covered = [n for p in (*plan.tensor_parallel, *plan.experts) for n in _matching(model, p)]
    for param in dict(model.named_parameters()):
        assert any(param.startswith(c + ".") for c in covered), f"{param} has no place in the parallel plan"


class _CachedInner(nn.Module):
    """Keeps the keys and values of earlier calls and attends from the new queries over all of them:
    the minimal KV cache a generator installs through `override` (with the base's sliding window, and
    the sinks the attention passes, gpt-oss)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.scale = base.scale
        self.window = getattr(base, "sliding_window", None)
        self.k = self.v = None

    def forward(self, q, k, v, *, context=None, sinks=None):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        new, total = q.shape[1], self.k.shape[1]
        mask = torch.ones(new, total, dtype=torch.bool).tril(total - new)
        if self.window is not None:  # query i sits at position total - new + i
            mask &= ~torch.ones(new, total, dtype=torch.bool).tril(total - new - self.window)
        if sinks is not None:
            return eager_attention(q, self.k, self.v, scale=self.scale, mask=mask, sinks=sinks)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, self.k, self.v))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                             enable_gqa=qh.shape[1] != kh.shape[1])
        return out.transpose(1, 2)


@pytest.mark.parametrize(("family", "name"), GENERATING, ids=[f"{f}-{n}" for f, n in GENERATING])
def test_incremental_decoding_through_the_inner_attention_matches_the_full_forward(family, name):
    config = tm.transforms.num_layers(2)(tm.flavor(family, name))
    model = build(config, seed=1)
    tokens = _tokens(config.vocab_size)
    prefill = SEQ - 8
    states: dict = {}  # recurrent layers' state (linear attention), carried as a generator carries it
    with torch.no_grad():
        full = model(tokens)
        if any(n.endswith(".attention.inner") for n, _ in model.named_modules()):
            tm.override(model, "layers.*.attention.inner", lambda fqn, old: _CachedInner(old))
        steps = [model(tokens[:, :prefill], positions=torch.arange(prefill).expand(2, prefill),
                       context=tm.AttentionContext(recurrent_states=states))]
        for t in range(prefill, SEQ):
            steps.append(model(tokens[:, t:t + 1], positions=torch.full((2, 1), t),
                               context=tm.AttentionContext(recurrent_states=states)))
    assert rel_err(torch.cat(steps, dim=1), full) < 1e-5


# --- registration checks ---------------------------------------------------------------------------

@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations in a test do not outlive it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@dataclasses.dataclass(kw_only=True)
class _TinyConfig(tm.llama3.Llama3Config):
    family = "tiny_test"


def test_a_registered_family_is_found_everywhere(scratch_registry):
    debug = _TinyConfig(**{f.name: getattr(tm.flavor("llama3", "debug"), f.name)
                           for f in dataclasses.fields(tm.llama3.Llama3Config)})
    tm.register(tm.Family(name="tiny_test", config_type=_TinyConfig, flavors={"debug": debug}))
    assert "tiny_test" in [f.name for f in tm.families()]
    assert tm.flavor("tiny_test", "debug") == debug and tm.flavor("tiny_test", "debug") is not debug
    assert tm.family_of(debug).name == "tiny_test"
    with pytest.raises(ValueError, match="already registered"):
        tm.register(tm.Family(name="tiny_test", config_type=_TinyConfig, flavors={"debug": debug}))


@dataclasses.dataclass(kw_only=True)
class _NoKVHeads:
    family = "no_kv_heads"
    vocab_size: int = 64
    dim: int = 32
    num_layers: int = 1
    num_heads: int = 2
    qk_head_dim: int = 16
    v_head_dim: int = 16
    ffn_dim: int = 64
    moe: None = None
    max_seq_len: int = 128
    tie_embeddings: bool = False
    attention: str = "sdpa"
    dtype: torch.dtype = torch.float32

    def is_moe_layer(self, i):
        return False

    def with_num_layers(self, n):
        return dataclasses.replace(self, num_layers=n)

    def parallel_plan(self):
        return tm.ParallelPlan()

    def build(self):
        raise NotImplementedError


@dataclasses.dataclass(kw_only=True)
class _Complete(_NoKVHeads):
    num_kv_heads: int = 2


def test_a_family_lacking_a_contract_field_fails_at_registration_naming_it():
    with pytest.raises(ValueError, match="lacks num_kv_heads"):
        tm.Family(name="no_kv_heads", config_type=_NoKVHeads, flavors={"debug": _NoKVHeads()})
    tm.check_model_config(_Complete())  # control: the same config with the member passes
    tm.check_model_config(tm.flavor("qwen3", "debug"))
    with pytest.raises(TypeError, match="dataclass instance"):
        tm.check_model_config(SimpleNamespace(**{f.name: getattr(_Complete(), f.name)
                                                 for f in dataclasses.fields(_Complete)}))


def test_registration_rejects_wrong_types_and_missing_debug_flavor():
    bad = dataclasses.replace(tm.flavor("llama3", "debug"), num_heads=4.0)
    with pytest.raises(TypeError, match="num_heads must be int"):
        tm.check_model_config(bad)
    with pytest.raises(ValueError, match="no 'debug' flavor"):
        tm.Family(name="llama3", config_type=tm.llama3.Llama3Config, flavors={"8B": tm.flavor("llama3", "8B")})
    with pytest.raises(ValueError, match="family must be"):
        tm.Family(name="other", config_type=tm.llama3.Llama3Config, flavors={"debug": tm.flavor("llama3", "debug")})


class _TinyConverter(type(tm.llama3.FAMILY.hf)):
    config_type = _TinyConfig


def test_architectures_belong_to_one_family(scratch_registry):
    debug = _TinyConfig(**{f.name: getattr(tm.flavor("llama3", "debug"), f.name)
                           for f in dataclasses.fields(tm.llama3.Llama3Config)})
    with pytest.raises(ValueError, match="belong to 'llama3'"):
        tm.register(tm.Family(name="tiny_test", config_type=_TinyConfig, flavors={"debug": debug},
                              vllm_architectures={"TitanLlamaForCausalLM": "LlamaForCausalLM"},
                              hf=_TinyConverter()))
