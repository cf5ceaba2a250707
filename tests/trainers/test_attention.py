"""The attention check (relay.trainers.verl_ppo.attention, verl_ppo's environment check): a verl_ppo spec that
needs flash-attn, where neither this host nor the cluster image's RELAY_IMAGE_ATTENTION has it, gets a warning in
`spec check` and `doctor`;
the shipped GPU spec (sdpa) and the shipped Ray image agree. No service, no verl import."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from relay.insights import doctor
from relay.runs.run import Run
from relay.spec.kinds import KINDS
from relay.spec.run_spec import spec_from_dict
from relay.trainers.verl_ppo import attention
from support.helpers import ROOT, relay_cli

GSM8K = ROOT / "include" / "runs" / "gsm8k_grpo.yaml"
SETTING = "trainer.settings.attn_implementation"
# The CLI tests check this host, whose venv is requirements.txt's: it has no flash-attn.


def verl_spec(checkpoint_dir="/nonexistent/relay-test", **settings):
    return spec_from_dict(
        {
            "name": "g",
            "trainer": {"kind": "verl_ppo", "settings": {"model_path": "/m", **settings}},
            "total_steps": 3,
            "chunk_steps": 1,
            "seed": 1,
            "threads": 1,
            "checkpoint_dir": checkpoint_dir,
            "data": {"train_files": ["/t.parquet"]},
        },
        check_environment=False,
    )


NO_FLASH_IMAGE = attention.ImageAttention(frozenset({"sdpa", "eager"}), "the image Relay builds")


def test_flash_attention_2_without_flash_attn_warns_and_sdpa_does_not():
    for settings in ({"attn_implementation": "flash_attention_2"}, {}):  # asked for, or verl's default
        found = attention.check(verl_spec(**settings), flash_attn_importable=False)  # the repo's own Dockerfile
        assert found is not None and not found.ok
        assert SETTING in found.detail and "flash_attention_2" in found.detail
        assert "fails at model load" in found.detail and "ImportError about flash_attn" in found.detail
        assert "this host" in found.detail and "need not be a Ray node" in found.detail
        assert "docker/ray.Dockerfile" in found.detail and "sdpa only" in found.detail
        assert f"{SETTING}: sdpa" in found.fix and "install flash-attn" in found.fix
    assert "verl's default" in attention.check(verl_spec()).detail
    for impl in ("sdpa", "eager"):
        found = attention.check(verl_spec(attn_implementation=impl), flash_attn_importable=False, image=NO_FLASH_IMAGE)
        assert found.ok and found.detail.startswith(impl)
    assert attention.check(verl_spec(device="cpu", rollout_name="hf")).ok  # sdpa on a CPU
    tiny = spec_from_dict(yaml.safe_load((ROOT / "include" / "runs" / "demo.yaml").read_text()), check_environment=False)
    assert KINDS["tiny_grpo"].check_environment(tiny) is None  # another trainer kind: no such check
    assert KINDS["verl_ppo"].check_environment(verl_spec()).detail == attention.check(verl_spec()).detail


def test_what_provides_flash_attn_silences_the_warning_and_an_unknown_image_is_said_to_be_unknown():
    spec = verl_spec(attn_implementation="flash_attention_2")
    assert attention.check(spec, flash_attn_importable=True, image=NO_FLASH_IMAGE).ok  # the check runs on a worker
    with_flash = attention.ImageAttention(frozenset({"sdpa", "flash_attention_2"}), "x")
    assert attention.check(spec, flash_attn_importable=False, image=with_flash).ok
    unknown = attention.check(spec, flash_attn_importable=False, image=attention.ImageAttention(None, "nothing says"))
    assert not unknown.ok and "cannot be known here (nothing says)" in unknown.detail
    # a critic (gae): verl 0.9.1 loads its value model with flash_attention_2 whatever the setting says
    gae = attention.check(
        verl_spec(attn_implementation="sdpa", adv_estimator="gae"), flash_attn_importable=False, image=NO_FLASH_IMAGE
    )
    assert not gae.ok and "critic" in gae.detail and "grpo" in gae.fix
    on_cpu = attention.check(
        verl_spec(attn_implementation="sdpa", adv_estimator="gae", device="cpu", rollout_name="hf"),
        flash_attn_importable=False,
        image=NO_FLASH_IMAGE,
    )  # Relay's CPU platform loads the value model with sdpa
    assert on_cpu.ok and "value model is loaded with sdpa" in on_cpu.detail


def test_the_image_marker_comes_from_the_environment_else_the_dockerfile(tmp_path):
    assert attention.image_attention(environ={}, root=ROOT).backends == {"sdpa", "eager"}
    on_a_node = attention.image_attention(environ={"RELAY_IMAGE_ATTENTION": "sdpa flash_attention_2"}, root=tmp_path)
    assert on_a_node.backends == {"sdpa", "flash_attention_2"} and "this host" in on_a_node.where
    assert attention.image_attention(environ={}, root=tmp_path).backends is None  # no docker/ray.Dockerfile
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "ray.Dockerfile").write_text("FROM x\nENV RELAY_IMAGE_ATTENTION=flash_attention_2\n")
    assert attention.image_attention(environ={}, root=tmp_path).backends == {"flash_attention_2"}


def test_the_shipped_gpu_spec_asks_for_what_the_shipped_image_provides():
    spec = spec_from_dict(yaml.safe_load(GSM8K.read_text()), check_environment=False, resolve=False)
    assert spec.settings.attention == "sdpa"
    assert spec.settings.attention in attention.image_attention(environ={}, root=ROOT).backends
    assert attention.check(spec).ok


@pytest.fixture
def shared(tmp_path):
    """RELAY_SHARED for the GPU spec: GSM8K-sized parquet files (7473 train rows) where the spec looks."""
    folder = tmp_path / "shared" / "data" / "gsm8k"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"i": list(range(7473))}), folder / "train.parquet")
    pq.write_table(pa.table({"i": list(range(10))}), folder / "test.parquet")
    return tmp_path / "shared"


def test_spec_check_of_the_gpu_spec_passes_without_the_warning_and_a_flash_variant_warns(shared, tmp_path):
    env = {"RELAY_SHARED": str(shared)}
    r = relay_cli("spec", "check", str(GSM8K), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "valid" in r.stdout and "warning" not in r.stdout + r.stderr and "flash" not in r.stdout + r.stderr
    flash = tmp_path / "flash.yaml"
    flash.write_text(GSM8K.read_text().replace("attn_implementation: sdpa ", "attn_implementation: flash_attention_2"))
    r = relay_cli("spec", "check", str(flash), env=env)
    assert r.returncode == 0, r.stdout + r.stderr  # a warning, not a failure
    assert "warning: attention:" in r.stderr and SETTING in r.stderr and "fix:" in r.stderr


def test_doctor_shows_the_warning_among_its_findings(shared, tmp_path):
    env = {"RELAY_SHARED": str(shared)}
    r = relay_cli("doctor", str(GSM8K), "--offline", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "✔ attention: sdpa" in r.stdout and "⚠" not in r.stdout and "a resume is safe\n" in r.stdout
    flash = tmp_path / "flash.yaml"
    flash.write_text(GSM8K.read_text().replace("attn_implementation: sdpa ", "attn_implementation: flash_attention_2"))
    r = relay_cli("doctor", str(flash), "--offline", env=env)
    assert r.returncode == 0, r.stdout + r.stderr  # a resume is still safe: the warning fails nothing
    assert "⚠ attention: trainer.settings.attn_implementation is flash_attention_2" in r.stdout
    assert "    fix: set trainer.settings.attn_implementation: sdpa" in r.stdout
    assert "a resume is safe (1 warning(s) above)" in r.stdout
    spec = verl_spec(checkpoint_dir=str(tmp_path / "ckpt"), attn_implementation="flash_attention_2")
    found = {f.name: f for f in doctor.diagnose(Run.of(spec, "r"))}
    assert found["attention"].ok and found["attention"].warning  # in --json too: {"ok": true, "warning": true}
