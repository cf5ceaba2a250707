"""The seams between one run's writers, under stress: an old DAG run's writers (its warm job's trainer, its validate
and publish tasks, its train task's phase marks and restore) started at seeded random points around a new DAG run's
fresh start, each a real process against the real lock and the session's S3 server. After the fresh start no
record of the old incarnation lands in the run (its folder, its events, its checkpoints, its S3 prefix), and the
new incarnation reaches its last step bitwise equal to a run that never had an old one.

RELAY_SEAM_ROUNDS rounds (10 in CI; `./scripts/test.sh --seams` runs more), drawn with RELAY_TEST_SEED (printed)."""

import os
import random
import tempfile
import threading
import time
from pathlib import Path

import pytest

from relay.common.errors import RunError
from relay.preflight.admission import admit
from relay.preflight.prepare import prepare_run
from relay.runs import layout
from relay.runs.metrics import read_events
from relay.s3 import history
from relay.s3.publication import publish_checkpoint
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from relay.trainers.contract import ENV_VAR, ChunkRequest
from support.faults import ForkServer, alive
from support.helpers import assert_bitwise_equal, model_state, read_metrics, write_spec
from support.kill_matrix import seed
from support.old_dag_run import HOLDER

pytestmark = [pytest.mark.services, pytest.mark.processes]

ROUNDS = int(os.environ.get("RELAY_SEAM_ROUNDS", "10"))
SPEC = {"total_steps": 6, "chunk_steps": 3, "trainer.settings.save_freq": 3}
WRITERS = ("trainer", "validate", "publish", "mark", "restore")


class Round:
    """One round: the old incarnation trained to step 3, validated and published; its writers and the fresh start at
    seeded points; the new incarnation trained to step 6 meanwhile, then validated and published."""

    def __init__(self, server: ForkServer, folder, rng: random.Random):
        self.server, self.folder, self.rng = server, folder, rng
        self.spec_path = write_spec(folder, name="r", **SPEC)
        self.spec = load_spec(self.spec_path, check_environment=False)
        self.store = store_for_spec(self.spec)
        self.asking = threading.Lock()  # the fork server answers one request at a time
        self.pids: dict[str, int] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> int:
        with self.asking:
            pid = self.server.start(argv, self.folder / f"{name}.log", env)
        self.pids[name] = pid
        return pid

    def finish(self, name: str) -> int:
        while alive(self.pids[name]):
            time.sleep(0.02)
        with self.asking:
            return self.server.wait(self.pids[name])

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def old_incarnation(self) -> ChunkRequest:
        self.start("old-chunk-1", ["train", str(self.spec_path), "--to-step", "3"])
        assert self.finish("old-chunk-1") == 0, self.log("old-chunk-1")[-3000:]
        old = prepare_run(self.spec, "r", store=self.store).run(self.spec)
        assert admit(old, 3).ok
        publish_checkpoint(old, 3, self.store)
        req = ChunkRequest(run=old, to_step=6, chunk=2, attempt=HOLDER)
        self.start("old-lease", ["-m", "support.old_dag_run", "lease", req.to_json()])  # the old train task's submission
        assert self.finish("old-lease") == 0, self.log("old-lease")
        req.lease_token = int(self.log("old-lease").split()[-1])
        return req

    def writer(self, role: str, req: ChunkRequest) -> None:
        if role == "trainer":  # the old DAG run's warm job, its token taken before the fresh start
            self.start(role, ["-m", "relay.trainers.job"], {ENV_VAR: req.to_json()})
        else:
            self.start(role, ["-m", "support.old_dag_run", role, req.to_json(), "3"])

    def fresh_start(self) -> None:
        """The new DAG run's preflight: refused while the old warm job's trainer lives (asked again, as a person
        would once it ended); then the new incarnation's first chunk, trained to the run's last step."""
        deadline = time.time() + 120
        while True:
            try:
                self.new = prepare_run(
                    self.spec, "r", fresh_start=True, confirm="r", store=self.store, asked_by="DAG run d/new"
                )
                break
            except RunError as e:
                assert "live writer" in str(e) and time.time() < deadline, e
                time.sleep(0.05)
        self.fresh_started_at = time.time()
        self.start("new-train", ["train", str(self.spec_path), "--to-step", "6"])

    def run(self) -> dict:
        req = self.old_incarnation()
        plan = {role: self.rng.uniform(0, 2.5) for role in WRITERS}
        plan["fresh_start"] = self.rng.uniform(0.2, 2.0)
        t0 = time.time()
        threads = []
        for what, at in sorted(plan.items(), key=lambda kv: kv[1]):
            time.sleep(max(0.0, t0 + at - time.time()))
            act = self.fresh_start if what == "fresh_start" else (lambda role=what: self.writer(role, req))
            threads.append(threading.Thread(target=act))
            threads[-1].start()
        for t in threads:
            t.join(timeout=300)
        outcomes = {role: self.finish(role) for role in WRITERS}
        assert self.finish("new-train") == 0, self.log("new-train")[-3000:]
        new = self.new.run(self.spec)
        assert admit(new, 6).ok  # the new DAG run's validate and publish tasks
        publish_checkpoint(new, 6, self.store)
        self.assert_only_the_new_incarnation(req.run.incarnation, new)
        return {"plan": plan, "outcomes": outcomes, "new": new}

    def assert_only_the_new_incarnation(self, old: str, new) -> None:
        events = read_events(new.dir)
        theirs = [e for e in events if e.get("incarnation") == old or e.get("attempt") == HOLDER]
        assert not theirs, f"the old incarnation's events landed in the new one: {theirs[:3]}"
        assert {e["incarnation"] for e in events if "incarnation" in e} == {new.incarnation}
        assert sorted(layout.step_dirs(new.dir)) == [3, 6] and layout.read_tracker(new.dir) == 6
        assert not layout.relay_dir(new.dir, "quarantine").exists(), "nothing of the new incarnation quarantined"
        assert [r["step"] for r in read_metrics(new.dir)] == list(range(1, 7)), "one metrics row per step, its own"
        assert [(m.step, m.incarnation) for m in self.store.published("r")] == [(6, new.incarnation)]
        assert self.store.incarnation("r") == new.incarnation and self.store.latest("r")["step"] == 6
        with tempfile.TemporaryDirectory() as tmp:  # the history S3 holds for the run: the new incarnation's alone
            history.fetch(self.store, "r", Path(tmp))
            published = read_events(Path(tmp))
        assert published and not [e for e in published if e.get("incarnation") == old or e.get("attempt") == HOLDER]


@pytest.fixture(scope="module")
def never_had_an_old_one(tmp_path_factory):
    """The same spec's run trained 0 -> 6 in one process, no old incarnation anywhere: the bitwise baseline."""
    folder = tmp_path_factory.mktemp("straight")
    server = ForkServer()
    spec_path = write_spec(folder, name="r", **SPEC)
    rc = server.run(["train", str(spec_path), "--to-step", "6", "--offline"], folder / "train.log")
    assert rc == 0, (folder / "train.log").read_text()[-3000:]
    yield server, model_state(folder / "ckpt" / "r" / "global_step_6")
    server.close()


@pytest.mark.fault
def test_no_record_of_an_old_incarnation_lands_after_a_fresh_start(tmp_path, s3_server, never_had_an_old_one, fault_row):
    server, baseline = never_had_an_old_one
    drawn = seed()
    print(f"seam stress: {ROUNDS} rounds, RELAY_TEST_SEED={drawn}", flush=True)
    refused = {role: 0 for role in WRITERS}
    for i in range(ROUNDS):
        rng = random.Random(f"{drawn}-{i}")
        r = Round(server, tmp_path / f"round-{i}", rng)
        try:
            got = r.run()
        except AssertionError as e:
            raise AssertionError(f"round {i} (RELAY_TEST_SEED={drawn}): {e}") from None
        assert_bitwise_equal(model_state(got["new"].dir / "global_step_6"), baseline)
        for role, rc in got["outcomes"].items():
            refused[role] += rc != 0
        order = " ".join(f"{what}@{at:.2f}s" for what, at in sorted(got["plan"].items(), key=lambda kv: kv[1]))
        print(f"round {i}: {order}; exit codes {got['outcomes']}", flush=True)
    fault_row(
        case="seam-stress",
        fault=f"{ROUNDS} rounds of an old DAG run's writers (warm job, validate, publish, phase marks, restore) at seeded "
        "points around a fresh start",
        action="every write of the old incarnation after the fresh start refused ("
        + ", ".join(f"{role} {n}/{ROUNDS}" for role, n in refused.items())
        + " rounds refused); the new incarnation bitwise equal to a run that never had an old one",
        steps_lost=0,
        layer="preflight",
        run_dir=got["new"].dir,
        store=r.store,
        test_seed=drawn,
    )
