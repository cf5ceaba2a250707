"""A Hugging Face export (verl's model merger) verified tensor by tensor against its checkpoint, whatever the world
size it was saved at and whether it has a certificate (relay.s3.publication.verify_export): real verl checkpoints at
world size 2, FSDP2 and FSDP1 (tests/support/verl_checkpoint.py), without certificates."""

import pytest

from support import verl_checkpoint

pytestmark = pytest.mark.processes  # verl's checkpoints in gloo processes, verl's merger in a process of its own


@pytest.mark.parametrize("fsdp", [2, 1])
def test_a_sharded_uncertified_export_is_verified_against_the_checkpoints_own_weights(tmp_path, fsdp):
    from safetensors.torch import load_file, save_file

    from relay.checkpoints.gate import admit_dir
    from relay.common.errors import CertificateError
    from relay.s3.publication import export_hf, verify_export

    [step_dir] = verl_checkpoint.make_many([{"run_dir": tmp_path / "run", "world_size": 2, "fsdp": fsdp}])
    run_dir = step_dir.parent
    assert admit_dir(run_dir, 1).ok  # verl's merger reads only files the gate has proven
    export = export_hf(run_dir, 1)
    verified = verify_export(export, step_dir, 0.02)
    assert verified.startswith("reproduces the weights of global_step_1: ") and "no certificate" in verified, verified
    assert "tensors are the checkpoint's, cast to" in verified

    [weights] = export.glob("*.safetensors")
    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[key] = tensors[key].flip(0).contiguous()  # the same values, rows in another order
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CertificateError) as refused:
        verify_export(export, step_dir, 0.02)
    assert f"exported tensors that are not the checkpoint's: {key}" in refused.value.what
