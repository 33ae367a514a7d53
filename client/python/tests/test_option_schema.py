"""The options' defaults, ranges and algorithms come from the daemon (DescribeOptions), once per
connection: diond.options keeps only their spelling (betas, use_polar_express, ...)."""
import pytest
import torch

import diond
import diond.torch
from diond.client import pb

# The reference constructors' defaults (ALGORITHMS.md §5.1, §6.1, §7.1, §8.1, §9.1, §13).
REFERENCE_DEFAULTS = dict(
    algorithm="muon", lr=0.01, mu=0.95, betas=(0.9, 0.95), weight_decay=0.01, epsilon=1e-8,
    nesterov=False, cautious_wd=False, adjust_lr="spectral_norm", flatten=False,
    use_polar_express=True, muon_beta2=0.95, rank_fraction=1.0, rank_multiple_of=1,
    fraction=0.25, ef_decay=0.95, num_heads=None, split_sizes=None, precision="fp32", seed=0,
    qr_method="rcqr", cqr_warmup_steps=150, oversample=1.25, bf16_matmul="auto",
)
_COMMON = {"lr", "weight_decay", "precision"}
MEGA = {"epsilon", "adjust_lr", "flatten", "use_polar_express", "num_heads", "bf16_matmul"}
APPLIES = {
    "muon": _COMMON | MEGA | {"mu", "nesterov", "cautious_wd", "split_sizes"},
    "normuon": _COMMON | MEGA | {"mu", "nesterov", "cautious_wd", "split_sizes", "muon_beta2"},
    "dion": _COMMON | {"mu", "epsilon", "rank_fraction", "rank_multiple_of", "seed",
                       "qr_method", "cqr_warmup_steps", "oversample"},
    "dion2": _COMMON | MEGA | {"fraction", "ef_decay"},
    "dion3": _COMMON | MEGA | {"fraction", "mu", "muon_beta2"},
    "adamw": _COMMON | {"betas", "epsilon", "cautious_wd"},
    "lion": _COMMON | {"betas", "cautious_wd"},
}
APPLIES["nordion2"] = APPLIES["dion3"]


def test_the_schema_is_the_daemons(daemon):
    client = diond.Client(daemon.target)
    schema = client.option_schema()
    assert client.option_schema() is schema  # one DescribeOptions per connection
    assert schema.defaults == REFERENCE_DEFAULTS
    assert schema.applies == APPLIES
    served = client.describe_options()
    assert [o.name for o in served.options] == [
        f.name for f in pb.Hyperparameters.DESCRIPTOR.fields]
    client.close()


def test_ranges_are_the_daemons(daemon):
    # The daemon bounds lr to [0, 1e4] (no fp32 update can overflow); the client now says so
    # itself, before a session exists.
    w = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match=r"lr = 20000.0 is out of range \[0, 10000\]"):
        diond.torch.Optimizer([w], target=daemon.target, algorithm="muon", lr=2e4)
    with pytest.raises(ValueError, match="rank_multiple_of must be an int >= 1"):
        diond.torch.Optimizer([w], target=daemon.target, algorithm="dion", rank_multiple_of=0)
    assert diond.Client(daemon.target).list_sessions() == []


def test_a_given_client_keeps_its_schema(daemon):
    client = diond.Client(daemon.target)
    w = torch.nn.Parameter(torch.zeros(8, 4))
    with diond.torch.Optimizer([w], target=client, algorithm="muon") as opt:
        assert opt.option_schema is client.option_schema()
        assert opt.defaults["betas"] == (0.9, 0.95)
        assert opt.param_groups[0]["mu"] == 0.95
    client.close()
