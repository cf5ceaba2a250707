"""An alert with every field filled in, as a failed validation raises it: what the alert and channel tests send."""

from __future__ import annotations

from relay.alerts import Alert


def an_alert(**kw) -> Alert:
    fields = dict(
        kind="checkpoint_invalid",
        run="r1",
        what="checkpoint step 12 failed the integrity check",
        details="✘ integrity: actor/model_world_size_1_rank_0.pt: CRC32 mismatch",
        chunk=2,
        step=12,
        last_valid_step=6,
        last_valid_uri="s3://relay/runs/r1/global_step_6",
        dag_id="relay_t",
        dag_run="manual__1",
        task="chunk_02.validate",
        try_number=1,
        quarantined_to="/ckpt/r1/.relay/quarantine/global_step_12",
        action="quarantined it; the tracker names step 6",
        log_url="http://127.0.0.1:8080/dags/relay_t/runs/manual__1/tasks/chunk_02.validate?try_number=1",
    )
    return Alert(**{**fields, **kw})
