"""Every model shape the job-spec parser accepts builds a model that runs (property test, pure: no
servers). An odd head dimension passed the parser, and every forward pass of the job's members
then failed in the rotary embedding: replicas crashed and were replaced until ``max_restarts``,
the job's error naming no ``model`` field (an outside review). Now the parser refuses it, naming
the field; this checks the parser against the model itself, not against a restated rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from robustrl.config import JobSpec
from robustrl.errors import ConfigError
from robustrl.model.policy import build_policy
from robustrl.model.tokenizer import CharTokenizer

TOK = CharTokenizer.default()


@settings(max_examples=60, derandomize=True, deadline=None)
@given(hidden=st.integers(1, 48), heads=st.integers(1, 8), kv=st.integers(1, 8))
def test_a_model_shape_the_parser_accepts_runs_a_forward_pass(hidden: int, heads: int, kv: int) -> None:
    raw = {"model": {"hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv, "num_layers": 1,
                     "intermediate_size": 8, "max_positions": 32}}
    try:
        spec = JobSpec.parse(raw).model
    except ConfigError as exc:
        assert "model" in str(exc), exc
        return
    model = build_policy(spec, TOK, seed=0)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 4]]))
    logits = out.logits if hasattr(out, "logits") else out
    assert logits.shape[-1] == TOK.vocab_size


@pytest.mark.parametrize("raw,field", [
    ({"model": {"hidden_size": 9, "num_heads": 3, "num_kv_heads": 3}}, "model"),
    ({"weights": {"relays": "yes"}}, "weights.relays"),
    ({"weights": {"relays": 1}}, "weights.relays"),
])
def test_a_spec_no_member_could_run_is_refused_naming_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec.parse(raw)
    assert field in str(err.value), err.value
