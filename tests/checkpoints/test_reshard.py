"""`relay checkpoint reshard` (relay/checkpoints/reshard.py) on checkpoints that verl's own FSDPCheckpointManager
wrote (tests/support/verl_checkpoint.py: gloo processes, FSDP1 wrapped as verl wraps it, FSDP2) at world sizes
1 to 3 (and 4, made by a reshard that verl loads), a model whose dimensions do not all divide by 2, 3 or 4:

- K -> M -> K gives every model and optimizer tensor of the original back, bit for bit;
- the tensors gathered from the output equal those gathered from the input;
- every shard's boundaries are those of the files verl itself writes at world size M (1 to 3);
- verl loads the output at world size M (4 among them), and what it saves from it is the output again;
- the output passes the gate at every level, in place (the original kept in .relay/resharded/) or --out;
- a world size change is accepted by the gate only through a reshard record; bad input is refused clearly."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from relay.checkpoints import manifest
from relay.checkpoints.gate import admit_dir
from relay.checkpoints.reshard import RECORD, reshard
from relay.checkpoints.safeload import load
from relay.checkpoints.validate import validate_checkpoint
from relay.common.errors import CheckpointError, RelayError
from relay.runs import layout
from support import verl_checkpoint
from support.helpers import relay_cli

pytestmark = pytest.mark.processes  # verl's checkpoints written and loaded by torch.distributed ranks: not in the fast lane

SIZES = (1, 2, 3, 4)
VERL_WROTE = (1, 2, 3)
SHAPE = {"hidden": 24, "layers": 2, "vocab": 67}  # 67 rows: cut unevenly at 2, 3 and 4 (34/33, 23/23/21, 17x3/16)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{(fsdp, world size): run folder} of global_step_1 written by verl at world sizes 1 to 3 (each world size is
    as many processes importing torch and verl: 4 is left to the load tests below), and at 4 by a reshard of 2."""
    root = tmp_path_factory.mktemp("reshard")
    kinds = [(f, w) for f in (1, 2) for w in VERL_WROTE]
    made = verl_checkpoint.make_many(
        [{"run_dir": root / f"fsdp{f}_ws{w}", "world_size": w, "fsdp": f, **SHAPE} for f, w in kinds]
    )
    runs = {k: step.parent for k, step in zip(kinds, made, strict=True)}
    for f in (1, 2):
        runs[(f, 4)] = reshard(runs[(f, 2)], 4, out=root / f"fsdp{f}_ws4").step_dir.parent
    return runs


def shards(run_dir: Path, kind: str) -> list[dict]:
    step = layout.step_dir(run_dir, 1) / "actor"
    ws = json.loads((step / "fsdp_config.json").read_text())["world_size"]
    return [load(step / layout.shard_name(kind, ws, r)) for r in range(ws)]


def local(v):
    return v.to_local() if hasattr(v, "to_local") else v


def entries(sd: dict, kind: str) -> dict:
    """{name: tensor or value} of a model shard, or of an optimizer shard's state."""
    if kind == "model":
        return sd
    return {f"{i}.{k}": v for i, state in sd["state"].items() for k, v in state.items()}


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def assert_same_shards(a: Path, b: Path, *, values: bool = True):
    """Every rank's model and optimizer entries: the same local shapes (and values, if asked)."""
    for kind in ("model", "optim"):
        sa, sb = shards(a, kind), shards(b, kind)
        assert len(sa) == len(sb)
        for r, (x, y) in enumerate(zip(sa, sb, strict=False)):
            ex, ey = entries(x, kind), entries(y, kind)
            assert list(ex) == list(ey), (kind, r)
            for name in ex:
                assert hasattr(ex[name], "_spec") == hasattr(ey[name], "_spec"), f"{kind} rank {r}: {name}'s type"
                la, lb = local(ex[name]), local(ey[name])
                assert getattr(la, "shape", None) == getattr(lb, "shape", None), (kind, r, name)
                if values:
                    assert equal(la, lb), f"{kind} rank {r}: {name} differs"
            if kind == "optim":
                assert x["param_groups"] == y["param_groups"]


def gathered(run_dir: Path) -> dict:
    """The full model tensors, and the full FSDP2 optimizer states, gathered across ranks."""
    out = {}
    for kind in ("model", "optim"):
        per_rank = [entries(sd, kind) for sd in shards(run_dir, kind)]
        for name, v in per_rank[0].items():
            if hasattr(v, "_spec") and v._spec.placements[0].is_shard():
                out[f"{kind}:{name}"] = torch.cat([local(e[name]) for e in per_rank], v._spec.placements[0].dim)
            elif kind == "model" and isinstance(v, torch.Tensor):  # FSDP1 at world size 1: the whole tensor
                out[f"{kind}:{name}"] = v
    return out


@pytest.mark.parametrize("fsdp", (1, 2), ids=("FSDP1", "FSDP2"))
def test_k_to_m_to_k_is_bitwise_and_cuts_like_verl(written, tmp_path, fsdp):
    for k in SIZES:
        for m in SIZES:
            if m == k:
                continue
            there, back = tmp_path / f"{k}to{m}", tmp_path / f"{k}to{m}to{k}"
            reshard(written[(fsdp, k)], m, out=there)
            # verl's own boundaries at M (at 4: test_verl_loads_the_output_at_the_new_world_size_and_saves_it_again)
            assert_same_shards(there, written[(fsdp, m)], values=False)
            full_in, full_out = gathered(written[(fsdp, k)]), gathered(there)
            assert full_in.keys() == full_out.keys() and all(torch.equal(full_in[n], full_out[n]) for n in full_in)
            reshard(there, k, out=back)
            assert_same_shards(back, written[(fsdp, k)])  # bit for bit, the optimizer's Adam moments included
            for r in range(k):  # the rule for RNG states: rank r takes rank r % K's (through M: r % M first)
                source = layout.shard_name("extra_state", k, (r % m) % k)
                assert (layout.step_dir(back, 1) / "actor" / layout.shard_name("extra_state", k, r)).read_bytes() == (
                    layout.step_dir(written[(fsdp, k)], 1) / "actor" / source
                ).read_bytes()


RELOADS = [(1, 1, 4), (2, 2, 4), (2, 3, 1), (1, 3, 2)]  # (FSDP version, K, M)


@pytest.fixture(scope="module")
def reloaded(written, tmp_path_factory):
    """{(fsdp, K, M): (the reshard K -> M, what verl saved after loading it at M)}, verl's loads and saves in one
    interpreter."""
    root = tmp_path_factory.mktemp("reloaded")
    outs = {key: root / "-".join(map(str, key)) for key in RELOADS}
    for (fsdp, k, m), out in outs.items():
        reshard(written[(fsdp, k)], m, out=out / "out")
    made = verl_checkpoint.make_many(
        [
            {"run_dir": out / "resaved", "world_size": m, "fsdp": fsdp, "load_from": out / "out", **SHAPE}
            for (fsdp, _, m), out in outs.items()
        ]
    )
    return {key: (outs[key] / "out", step.parent) for key, step in zip(RELOADS, made, strict=True)}


@pytest.mark.parametrize("fsdp,k,m", RELOADS, ids=[f"FSDP{f}-{k}to{m}" for f, k, m in RELOADS])
def test_verl_loads_the_output_at_the_new_world_size_and_saves_it_again(reloaded, fsdp, k, m):
    out, resaved = reloaded[(fsdp, k, m)]
    assert_same_shards(resaved, out)


def test_in_place_keeps_the_original_and_the_gate_accepts_the_change_only_through_the_record(written, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(written[(2, 2)], run)
    assert admit_dir(run).ok
    original = manifest.read(layout.step_dir(run, 1))
    result = reshard(run, 3)
    assert result.step_dir == layout.step_dir(run, 1) and result.original.parent == layout.relay_dir(run, "resharded")
    assert (result.original / "actor" / "model_world_size_2_rank_0.pt").is_file(), "the original is kept"
    assert layout.read_tracker(run) == 1
    admission = admit_dir(run)
    assert admission.ok, admission.explain()
    m = manifest.read(layout.step_dir(run, 1))
    assert m.version == manifest.VERSION and m.world_size == 3
    assert m.resharded_from["world_size"] == 2
    assert m.resharded_from["manifest_sha256"] == hashlib.sha256((result.original / manifest.NAME).read_bytes()).hexdigest()
    assert original.world_size == 2

    # A later step at world size 3 after a world-size-2 one: refused without the record, accepted with it.
    later = tmp_path / "later"
    shutil.copytree(written[(2, 2)], later)
    shutil.copytree(written[(2, 3)] / "global_step_1", later / "global_step_2")
    layout.write_tracker(later, 2)
    report = validate_checkpoint(later)
    assert (
        not report.ok and "world size 3, but the run's earlier checkpoint (step 1) has world size 2" in report.failed.detail
    )
    shutil.copy(layout.step_dir(run, 1) / RECORD, later / "global_step_2" / RECORD)
    report = validate_checkpoint(later)
    assert report.ok and "resharded from world size 2" in report.summary()


def test_the_cli_reshards_and_refuses_bad_input(written, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(written[(1, 2)], run)
    r = relay_cli("checkpoint", "reshard", str(run), "--world-size", "4", "--out", str(tmp_path / "o"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["to_world_size"] == 4
    assert validate_checkpoint(tmp_path / "o").ok
    assert not layout.relay_dir(run, "resharded").exists(), "--out touches nothing of the source"

    r = relay_cli("checkpoint", "reshard", str(run), "--world-size", "0")
    assert r.returncode == 2 and "at least 1" in r.stderr
    r = relay_cli("checkpoint", "reshard", str(run), "--world-size", "2")
    assert r.returncode == 2 and "already at world size 2" in r.stderr
    (layout.step_dir(run, 1) / "actor" / "optim_world_size_2_rank_1.pt").unlink()
    r = relay_cli("checkpoint", "reshard", str(run), "--world-size", "4")
    assert r.returncode == 1 and "not a valid checkpoint" in r.stderr and "optim_world_size_2_rank_1.pt" in r.stderr
    assert layout.step_dir(run, 1).is_dir(), "nothing of the refused checkpoint was moved"


def test_a_critic_without_its_shards_is_refused(written, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(written[(2, 2)], run)
    critic = layout.step_dir(run, 1) / "critic"
    critic.mkdir()
    shutil.copy(layout.step_dir(run, 1) / "actor" / "fsdp_config.json", critic)
    with pytest.raises(CheckpointError, match="critic/"):
        reshard(run, 1)


# ------------------------------------------------------------------- the DAG's reshard (on_world_size_change)


def verl_spec(folder: Path, policy: str, n_gpus: int = 1, s3_uri: str | None = None):
    """The shipped verl spec (world size nnodes x n_gpus_per_node) with its runs under folder."""
    import yaml

    from relay.spec.run_spec import load_spec
    from support.verl_jobs import SPEC

    d = yaml.safe_load(SPEC.read_text())
    d["checkpoint_dir"] = str(folder)
    d["checkpoints"]["on_world_size_change"] = policy
    d["checkpoints"]["smoke"] = False  # verl_checkpoint.py writes no tokenizer in huggingface/
    d["trainer"]["settings"]["n_gpus_per_node"] = n_gpus
    if s3_uri:
        d["s3"] = {"uri": s3_uri}
    path = folder / f"spec-{policy}-{n_gpus}.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return load_spec(path, check_environment=False)


def test_before_a_chunk_the_latest_checkpoint_is_resharded_to_the_specs_world_size(written, tmp_path):
    from relay.insights import doctor
    from relay.preflight import guard
    from relay.preflight.world_size import to_spec_world_size
    from relay.runs.run import Run

    at_two = Run.of(verl_spec(tmp_path, "reshard", n_gpus=2), "r")
    shutil.copytree(written[(2, 2)], at_two.dir)
    assert admit_dir(at_two.dir).ok
    guard.record(at_two)  # the run's settings, recorded at world size 2
    assert to_spec_world_size(at_two) is None, "the spec's world size is the checkpoint's: nothing to do"

    refuse = Run.of(verl_spec(tmp_path, "refuse"), "r")
    with pytest.raises(guard.DriftError, match="n_gpus_per_node: 2 -> 1"):
        guard.check(refuse, persist=False)
    finding = doctor.parallelism(refuse)
    assert not finding.ok and f"python -m relay checkpoint reshard {refuse.dir} --world-size 1" in finding.fix

    run = Run.of(verl_spec(tmp_path, "reshard"), "r")
    assert doctor.parallelism(run).ok and doctor.parallelism(run).warning
    changes = guard.check(run, by="test")  # accepted through the policy, without allow_drift, and recorded
    assert {c.key for c in changes} == {"trainer.settings.n_gpus_per_node", "resolved.world_size"}
    from relay.runs.record import read_record

    assert read_record(run.dir)["drift"][-1]["allowed"] == [guard.RESHARD_POLICY]

    result = to_spec_world_size(run)
    assert (result.from_world_size, result.to_world_size, result.step) == (2, 1, 1)
    m = manifest.read(layout.step_dir(run.dir, 1))
    assert m.world_size == 1 and m.resharded_from["world_size"] == 2, "validated by the gate, its manifest says how"
    assert doctor.parallelism(run).ok and not doctor.parallelism(run).warning
    assert to_spec_world_size(run) is None, "once is enough"


def test_relay_train_reshards_before_its_job_and_an_unreachable_s3_only_warns(written, tmp_path, monkeypatch):
    """`relay train` (checkpoints.on_world_size_change: reshard) reshards the latest step before its job, as the DAG's
    reshard task does; S3 not answering leaves the resharded step in place and says how to publish it later (the
    DAG's task fails instead: its chunk does not start on a step S3 does not hold)."""
    from relay.common.errors import StoreError
    from relay.ops.reshard_run import reshard_to_spec
    from relay.runs.run import Run
    from relay.s3.store import store_for_spec

    run = Run.of(verl_spec(tmp_path, "reshard", s3_uri="s3://relay/test-reshard"), "r")
    shutil.copytree(written[(2, 2)], run.dir)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    done = reshard_to_spec(run, store_for_spec(run.spec))
    assert done is not None and "resharded step 1 (FSDP2) from world size 2 to 1 in place" in done.done, done
    assert "S3's copy of step 1 is still the world-size-2 one" in done.warning
    assert f"relay checkpoint publish {run.dir} s3://relay/test-reshard --step 1" in done.warning
    assert manifest.read(layout.step_dir(run.dir, 1)).world_size == 1 and admit_dir(run.dir, 1).ok

    again = Run.of(verl_spec(tmp_path, "reshard", s3_uri="s3://relay/test-reshard"), "dag")
    shutil.copytree(written[(2, 2)], again.dir)
    with pytest.raises(StoreError):
        reshard_to_spec(again, store_for_spec(again.spec), publish_or_fail=True)
    assert manifest.read(layout.step_dir(again.dir, 1)).world_size == 1, "the local step is resharded all the same"


# ------------------------------------------------------------------- a reshard in place, killed anywhere


def tree(folder: Path) -> dict:
    """{relative path: sha256} of every file of a folder."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def originals(run: Path, want: dict) -> list[Path]:
    """The folders under the run's .relay/ that hold the original step, byte for byte."""
    return [p for p in layout.relay_dir(run).rglob("global_step_1*") if p.is_dir() and tree(p) == want]


@pytest.mark.parametrize(
    "point,refuse",
    [
        ("reshard_staged", ""),
        ("swap_journaled", ""),
        ("swap_exchanged", ""),
        ("swap_journaled", "rename_exchange"),
        ("swap_original_aside", "rename_exchange"),
    ],
    ids=["staged", "journaled", "exchanged", "journaled-no-exchange", "between-two-renames"],
)
def test_a_reshard_killed_anywhere_leaves_a_whole_step_and_its_original(written, tmp_path, point, refuse):
    """`relay checkpoint reshard` SIGKILLed at each point of its swap, with renameat2's exchange and without it (two
    renames, as on NFS): the gate, `relay doctor` or the next reshard finishes or undoes the swap, the tracker names
    a whole, valid step 1, and the original is kept byte for byte, also through later reshards (a reshard clears its
    staging folder, where a swap killed after its exchange left the original)."""
    from relay.common.faultpoint import KILL_ENV, REFUSE_ENV

    run = tmp_path / "run"
    shutil.copytree(written[(2, 2)], run)
    assert admit_dir(run).ok
    want = tree(layout.step_dir(run, 1))
    killed = relay_cli(
        "checkpoint", "reshard", str(run), "--world-size", "1", env={KILL_ENV: f"{point}@1", REFUSE_ENV: refuse}
    )
    assert killed.returncode == -9 and f"killed at {point}" in killed.stdout, killed.stdout + killed.stderr
    assert layout.read_tracker(run) == 1

    admission = admit_dir(run)  # the gate: an interrupted swap is finished or undone first
    assert admission.ok, admission.explain()
    assert not layout.relay_dir(run, "swap.json").exists()
    ws = json.loads((layout.step_dir(run, 1) / "actor" / "fsdp_config.json").read_text())["world_size"]
    assert ws == (1 if point in ("swap_exchanged", "swap_original_aside") else 2), "finished once it had begun"
    assert tree(layout.step_dir(run, 1)) == want or originals(run, want), "the original is kept"

    for m in (2, 1) if ws == 1 else (1, 2, 1):  # later reshards back and forth
        r = relay_cli("checkpoint", "reshard", str(run), "--world-size", str(m))
        assert r.returncode == 0, r.stdout + r.stderr
    assert originals(run, want), "a later reshard deleted the only copy of the original"
    assert admit_dir(run).ok and layout.read_tracker(run) == 1


def test_a_reshard_in_place_fences_out_a_live_trainer(written, tmp_path):
    """A reshard in place takes the run's lease: a trainer still alive holds a token that no longer writes."""
    from relay.common.errors import LeaseLost
    from relay.runs.lease import Lease

    run = tmp_path / "run"
    shutil.copytree(written[(2, 2)], run)
    trainer = Lease(run)
    token = trainer.acquire("a trainer left alive")
    reshard(run, 1)
    with pytest.raises(LeaseLost, match="reshard:"):
        trainer.check(token)


UNNAMED = """
import sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from relay.checkpoints.safeload import load

actor, k = Path(sys.argv[1]), int(sys.argv[2])
for rank in range(k):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=k)
    mesh = init_device_mesh("cpu", (k,))  # one dimension, no name
    def move(v):
        if isinstance(v, DTensor):
            return DTensor.from_local(v.to_local(), mesh, v.placements, shape=v.shape, stride=v.stride())
        if isinstance(v, dict):
            return {key: move(x) for key, x in v.items()}
        return v
    for kind in ("model", "optim"):
        path = actor / f"{kind}_world_size_{k}_rank_{rank}.pt"
        torch.save(move(load(path, mmap=False)), path)
    dist.destroy_process_group()
"""


def test_a_one_dimensional_mesh_without_names_is_resharded(written, tmp_path):
    """FSDP2 over a 1-D device mesh made without dimension names is as valid a layout as verl's named one."""
    import subprocess
    import sys

    from support.helpers import ROOT

    unnamed = tmp_path / "unnamed"
    shutil.copytree(written[(2, 2)], unnamed)
    subprocess.run(
        [sys.executable, "-c", UNNAMED, str(layout.step_dir(unnamed, 1) / "actor"), "2"],
        cwd=ROOT,
        check=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "plugins")},
    )
    assert shards(unnamed, "model")[0]["model.embed_tokens.weight"].device_mesh.mesh_dim_names is None
    for m in (1, 3):
        out = reshard(unnamed, m, out=tmp_path / f"to{m}")
        full_in, full_out = gathered(written[(2, 2)]), gathered(out.step_dir.parent)
        assert full_in.keys() == full_out.keys() and all(torch.equal(full_in[n], full_out[n]) for n in full_in)
        assert shards(out.step_dir.parent, "model")[0]["model.embed_tokens.weight"].device_mesh.mesh_dim_names is None


def test_reshards_back_and_forth_within_one_second_keep_every_original(written, tmp_path, monkeypatch):
    """Each in-place reshard keeps the step it replaced under .relay/resharded/, named by world size and time: a
    reshard from world size 2 again within the same second as the first gets a name of its own."""
    run = tmp_path / "run"
    shutil.copytree(written[(2, 2)], run)
    want = tree(layout.step_dir(run, 1))
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)  # the same second, however fast or slow
    for m in (1, 2, 1):
        reshard(run, m)
    kept = sorted(p.name for p in layout.relay_dir(run, "resharded").iterdir())
    assert len(kept) == 3 and len(set(kept)) == 3, kept
    assert originals(run, want), "the world-size-2 original is kept"
    assert admit_dir(run).ok and layout.read_tracker(run) == 1


def test_a_reshard_killed_after_its_exchange_while_another_reads_the_step_keeps_the_original(written, tmp_path, monkeypatch):
    """Two reshards in place to the same world size: while B reads the step, A reshards it and is killed just after
    its exchange, the original then in A's staging folder. B cleans no staging folder but those of writers older
    than itself: the original is never deleted, and the gate finishes A's swap."""
    import os
    import signal
    import subprocess
    import sys

    from relay.checkpoints import validate
    from relay.common.faultpoint import FAULT_ENV
    from support.faults import wait_for_line
    from support.helpers import ROOT

    run = tmp_path / "run"
    shutil.copytree(written[(2, 2)], run)
    assert admit_dir(run).ok
    want = tree(layout.step_dir(run, 1))
    log = tmp_path / "a.log"
    real = validate.validate_checkpoint

    def b_reads_while_a_swaps(run_dir, step=None, **kw):
        report = real(run_dir, step, **kw)
        if "upto" not in kw:  # B's full read of the step: meanwhile A reshards it, to its exchange, and is killed
            with open(log, "w") as out:
                a = subprocess.Popen(
                    [sys.executable, "-m", "relay", "checkpoint", "reshard", str(run), "--world-size", "1"],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, FAULT_ENV: "swap_exchanged@1", "PYTHONPATH": str(ROOT / "plugins")},
                )
            wait_for_line(log, "[relay-fault] paused at swap_exchanged", a.pid)
            a.send_signal(signal.SIGKILL)
            a.wait()
        return report

    monkeypatch.setattr(validate, "validate_checkpoint", b_reads_while_a_swaps)
    try:
        reshard(run, 1)
    except RelayError:
        pass  # B may lose the lease to A, or refuse a step that changed under it: what matters is what is left
    monkeypatch.setattr(validate, "validate_checkpoint", real)
    assert originals(run, want), f"the only copy of the original was deleted (A: {log.read_text()[-1500:]})"
    assert admit_dir(run).ok and layout.read_tracker(run) == 1
