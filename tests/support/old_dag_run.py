"""An old DAG run's writers, one per process: what its tasks write into a run, each for the incarnation the DAG
run planned for (tests/preflight/test_seam_stress.py starts them across a fresh start).

    python -m support.old_dag_run ROLE REQUEST [STEP]     (REQUEST: a ChunkRequest's JSON: the old run as planned)

Roles: `lease` (the train task takes the lease for its job: prints the token), `mark` (the train task's phase
marks, every 10 ms for a few seconds), `validate` (the validate task's gate on STEP), `publish` (the publish task
on STEP), `restore` (the train task's restore of the newest published checkpoint). Exit 0: it wrote; 3: it was
refused (the run was started again, or a fresh start is under way); 1: refused otherwise, or nothing to write
(an error that names it).
"""

from __future__ import annotations

import sys
import time

from relay.common.errors import LeaseLost, RelayError
from relay.preflight.admission import admit
from relay.runs.phases import record_phase
from relay.s3.publication import publish_checkpoint
from relay.s3.restore import restore
from relay.s3.store import store_for_spec
from relay.trainers.contract import ChunkRequest

HOLDER = "raysubmit_old-warm-job"


def act(role: str, req: ChunkRequest, step: int) -> str:
    run = req.run
    if role == "lease":
        return str(run.folder.lease().acquire(HOLDER))
    if role == "mark":
        n, until = 0, time.time() + 4
        try:
            while time.time() < until:
                record_phase(run.folder, "job_submitted", chunk=req.chunk, attempt=HOLDER, n=n)
                n += 1
                time.sleep(0.01)
        finally:
            print(f"{n} marks written", flush=True)
        return "marked"
    if role == "validate":
        return admit(run, step).explain()
    if role == "publish":
        return str(publish_checkpoint(run, step, store_for_spec(run.spec)).uri)
    if role == "restore":
        if (restored := restore(store_for_spec(run.spec), run.folder, log=print)) is None:
            raise RelayError(f"nothing of incarnation {run.incarnation} is published: nothing restored", "")
        return f"restored step {restored[0]} from {restored[1]}"
    raise SystemExit(f"unknown role {role}")


def main(argv: list[str]) -> int:
    role, blob, *rest = argv
    try:
        print(act(role, ChunkRequest.from_json(blob), int(rest[0]) if rest else 0), flush=True)
    except LeaseLost as e:
        print(f"refused: {e}", flush=True)
        return 3
    except RelayError as e:
        print(f"refused: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
