"""rtrl/moe.py: a MoE model's routers are found by their contract, record_routes captures
what they chose, replay_routes makes them choose it again (with the router's gradient),
and routes survive a RolloutRecord's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rtrl.moe import pack_routes, record_routes, replay_routes, routers, unpack_routes
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import PolicyConfig, build_model
from rtrl.v1 import rollout_pb2

FAMILIES = {"qwen3_moe": (8, 2), "mixtral": (4, 2)}
"""MoE families of the tiny checkpoints: (experts per layer, experts per token)."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> PreTrainedModel:
    family = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(family) / "model", family, seed=0)
    model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32)
    return model.eval()


def tokens(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(0))


def test_the_routers_are_one_per_layer_in_layer_order(moe):
    experts, top_k = FAMILIES[moe.config.model_type]
    found = routers(moe)
    names = {id(module): name for name, module in moe.named_modules()}
    assert [names[id(r.module)] for r in found] == [
        f"model.layers.{i}.mlp.gate" for i in range(moe.config.num_hidden_layers)
    ]
    assert all((r.num_experts, r.top_k, r.renormalizes) == (experts, top_k, True) for r in found)


def test_a_dense_model_has_no_routers():
    assert routers(build_model(PolicyConfig(num_layers=1))) == []


def test_recorded_routes_are_the_routers_own_choice_per_token(moe):
    ids = tokens()
    with torch.no_grad(), record_routes(moe) as log:
        moe(input_ids=ids)
    _, top_k = FAMILIES[moe.config.model_type]
    layers = log.per_layer()
    assert len(layers) == moe.config.num_hidden_layers
    assert all(routes.shape == (ids.numel(), top_k) for routes in layers)
    assert log.stacked().shape == (ids.numel(), len(layers), top_k)
    assert all(len(set(row.tolist())) == top_k for routes in layers for row in routes)


def test_replaying_a_forwards_own_routes_changes_nothing(moe):
    ids = tokens()
    with torch.no_grad(), record_routes(moe) as log:
        plain = moe(input_ids=ids).logits
    with torch.no_grad(), replay_routes(moe, log.stacked()):
        replayed = moe(input_ids=ids).logits
    assert torch.equal(plain, replayed)


# Mixtral's router always renormalizes: Qwen3-MoE's is the one with the choice.
@pytest.mark.parametrize("moe", ["qwen3_moe"], indirect=True)
def test_a_router_that_does_not_renormalize_is_replayed_as_it_scores(moe, monkeypatch):
    assert hasattr(routers(moe)[0].module, "norm_topk_prob")
    for router in routers(moe):
        monkeypatch.setattr(router.module, "norm_topk_prob", False)
    assert not any(r.renormalizes for r in routers(moe))
    ids = tokens()
    with torch.no_grad(), record_routes(moe) as log:
        plain = moe(input_ids=ids).logits
    with torch.no_grad(), replay_routes(moe, log.stacked()):
        assert torch.equal(moe(input_ids=ids).logits, plain)


def test_replayed_routes_are_used_and_the_router_still_gets_a_gradient(moe):
    ids = tokens()
    experts, top_k = FAMILIES[moe.config.model_type]
    forced = torch.arange(experts - top_k, experts).expand(*ids.shape, len(routers(moe)), top_k)
    with replay_routes(moe, forced), record_routes(moe) as log:
        moe(input_ids=ids).logits.pow(2).mean().backward()
    assert torch.equal(log.stacked(), forced.flatten(0, 1))
    weights = [r.module.get_parameter("weight") for r in routers(moe)]
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in weights)
    moe.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        # one layer's routes for a two-layer model
        ((2, 9, 1, 2), "routes for 1 MoE layers; the model has 2"),
        # three experts per token for a top-2 router
        ((2, 9, 2, 3), r"layer 0: routes of shape \(18, 3\), expected \[tokens, 2\]"),
        # routes for fewer tokens than the forward routes
        ((2, 8, 2, 2), "layer 0: routes for 16 tokens, the forward routes 18"),
    ],
)
def test_routes_that_do_not_fit_the_model_or_the_forward_are_refused(moe, shape, error):
    with (
        pytest.raises(ValueError, match=error),
        replay_routes(moe, torch.zeros(shape, dtype=torch.long)),
    ):
        moe(input_ids=tokens())


def test_an_expert_id_the_router_does_not_have_is_refused(moe):
    experts, _ = FAMILIES[moe.config.model_type]
    routes = torch.full((18, 2, 2), experts)
    with pytest.raises(ValueError, match=f"expert ids outside \\[0, {experts}\\)"):
        with replay_routes(moe, routes):
            pass


@pytest.mark.parametrize(
    ("num_experts", "bytes_per_id"),
    [(8, 1), (256, 1), (257, 2), (65536, 2)],
)
def test_routes_survive_a_rollout_records_bytes(num_experts, bytes_per_id):
    routes = torch.randint(0, num_experts, (37, 3, 4), generator=torch.Generator().manual_seed(1))
    record = rollout_pb2.RolloutRecord(router_choices=pack_routes(routes, num_experts))
    parsed = rollout_pb2.RolloutRecord.FromString(record.SerializeToString())
    assert len(parsed.router_choices.expert_ids) == routes.numel() * bytes_per_id
    assert torch.equal(unpack_routes(parsed.router_choices).long(), routes)


@pytest.mark.parametrize(
    ("choices", "error"),
    [
        # seven bytes cannot be rows of 2 layers x 2 experts
        (
            rollout_pb2.RouterChoices(layers=2, top_k=2, num_experts=8, expert_ids=bytes(7)),
            "do not fill",
        ),
        # an id of 9 among 8 experts
        (
            rollout_pb2.RouterChoices(layers=1, top_k=1, num_experts=8, expert_ids=bytes([9])),
            "outside",
        ),
        # no layers at all
        (rollout_pb2.RouterChoices(layers=0, top_k=2, num_experts=8), "do not fill"),
    ],
)
def test_malformed_routes_are_refused(choices, error):
    with pytest.raises(ValueError, match=error):
        unpack_routes(choices)
