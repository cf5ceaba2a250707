"""The certificate's pieces (relay.checkpoints.certificate): digests that do not depend on sharding but do on
where each value sits, and the comparison a resume makes."""

from dataclasses import replace

import torch

from relay.checkpoints import certificate
from relay.checkpoints.certificate import Certificate, compare, tensor_sum


def test_a_tensors_digest_is_the_sum_of_its_pieces_digests_wherever_it_is_cut():
    t = torch.randn(67, 24)
    whole = tensor_sum(t, 0)
    for cuts in ([34], [23, 46], [17, 34, 51]):
        pieces = torch.tensor_split(t, cuts)
        offsets = [0, *[c * 24 for c in cuts]]
        assert sum(tensor_sum(p, o) for p, o in zip(pieces, offsets, strict=True)) % 2**64 == whole
    assert tensor_sum(t.to(torch.bfloat16), 0) != tensor_sum(t.to(torch.bfloat16)[[1, 0, *range(2, 67)]], 0)


def test_moving_values_changes_the_digest_though_every_value_stays():
    t = torch.randn(16, 8)
    swapped = t.clone()
    swapped[[3, 5]] = swapped[[5, 3]]
    rotated = torch.roll(t, 1, dims=0)
    assert len({tensor_sum(t, 0), tensor_sum(swapped, 0), tensor_sum(rotated, 0), tensor_sum(t, 8)}) == 4
    assert tensor_sum(t, 0) == tensor_sum(t.clone(), 0)


def test_parameter_digests_skip_wrapper_prefixes_and_non_persistent_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].register_buffer("scratch", torch.zeros(3), persistent=False)
    names = set(certificate.param_digests(model))
    assert names == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}


def cert(**kw) -> Certificate:
    base = Certificate(
        step=6,
        world_size=1,
        device="cpu",
        probe_ids=[[1, 2, 3]],
        logprobs=[[-0.5, -1.25]],
        params={"w": "00000000000000aa"},
        optimizer_step=6,
        lr=0.003,
        data="d",
        rng="r",
    )
    return replace(base, **kw)


def test_the_probe_is_exact_at_the_same_world_size_and_within_tolerance_after_a_reshard():
    saved = cert()
    assert compare(saved, cert(), 1e-3).ok
    off = cert(logprobs=[[-0.5, -1.2500001]])
    c = compare(saved, off, 1e-3)
    assert not c.ok and "log-probs differ" in c.detail()
    resharded = cert(logprobs=[[-0.5, -1.2500001]], world_size=2, rng="other")  # RNG states are per rank
    c = compare(saved, resharded, 1e-3)
    assert c.ok and not c.exact and "within 0.001" in c.detail()
    assert not compare(saved, cert(logprobs=[[-0.5, -1.3]], world_size=2), 1e-3).ok
    assert not compare(saved, cert(logprobs=[[-0.5, float("nan")]], world_size=2), 1e-3).ok


def test_every_other_piece_is_exact_and_named():
    saved = cert()
    for changed, words in (
        (cert(params={"w": "00000000000000ab"}), "1 of 1 parameters hold other values than saved: w"),
        (cert(optimizer_step=5), "the optimizer's step is 5, saved 6"),
        (cert(lr=0.002), "the learning rate"),
        (cert(data="e"), "the dataloader's state"),
        (cert(rng="s"), "the RNG states differ"),
        (cert(probe_ids=[[1, 2, 4]]), "the probe is not the one saved"),
    ):
        c = compare(saved, changed, 1.0)
        assert not c.ok and words in c.detail(), c.detail()


def test_the_critics_state_is_exact_and_named_where_it_was_saved():
    """verl's value model, where the algorithm has one: its parameters and optimizer moments are certified as the
    actor's are; a certificate saved without them (before version 3) holds a resume that has them."""
    critic = {"critic": {"v.weight": "0000000000000001"}, "critic_optimizer": {"v.weight.exp_avg": "02"}}
    saved = cert(**critic)
    assert compare(saved, cert(**critic), 1.0).ok
    c = compare(saved, cert(critic={"v.weight": "0000000000000009"}, critic_optimizer=critic["critic_optimizer"]), 1.0)
    assert not c.ok and "1 of 1 critic parameters hold other values than saved: v.weight" in c.detail(), c.detail()
    c = compare(saved, cert(critic=critic["critic"]), 1.0)  # the critic's moments not restored
    assert not c.ok and "1 of 1 critic optimizer moments hold other values than saved: v.weight.exp_avg" in c.detail()
    assert compare(cert(), cert(**critic), 1.0).ok
    assert "the critic's 1 parameter and 1 moment digests" in saved.summary()


def test_a_certificate_reads_back_as_written(tmp_path):
    c = cert(probe_seconds=0.004)
    c.write(tmp_path)
    assert certificate.read(tmp_path) == c
    assert certificate.read(tmp_path / "nothing") is None
    assert "probe of 1 sequences (2 log-probs), 1 parameter digests" in c.summary()


def test_fsdp1_flat_parameter_digests_compare_only_at_their_world_size():
    saved = cert(portable=False)
    after_reshard = cert(portable=False, world_size=2, params={"w": "00000000000000bb"}, rng="other")
    assert compare(saved, after_reshard, 1e-3).ok, "flat parameters are cut by world size: only the probe compares"
    c = compare(saved, cert(portable=False, params={"w": "00000000000000bb"}), 1e-3)
    assert not c.ok and "parameters hold other values" in c.detail()
    assert certificate.portable(torch.nn.Linear(2, 2)), "a plain module's digests are portable"
