"""A chunk's Ray job entrypoint: `python -m relay.trainers.job`, the request in $RELAY_CHUNK_REQUEST.

Exit codes: 0 the chunk reached its end step (or already had); 3 this attempt lost the run's lease;
4 it stopped early as asked (SIGTERM, a stop request, the spec's save_before) after committing a checkpoint of
its last step (relay.trainers.stopping); 1 anything else (the traceback is in the job's log, which the Airflow
task shows). A Relay error also prints `[relay] cause: <cause>` (relay.runs.failure_cause reads it: refused,
infrastructure, or preempted for a graceful stop).
"""

from __future__ import annotations

import sys

from relay.common.errors import RelayError, StoppedEarly
from relay.common.quiet import quiet_known_noise
from relay.trainers.contract import ChunkRequest, run_chunk


def main() -> int:
    quiet_known_noise()
    req = ChunkRequest.from_env()
    try:
        result = run_chunk(req)
    except RelayError as e:
        ended = "stopped early" if isinstance(e, StoppedEarly) else "failed"
        print(f"[relay] chunk {req.chunk} of run {req.run} {ended}: {e}", flush=True)
        print(
            f"[relay] cause: {e.cause} ({type(e).__name__}; a retry {'can' if e.retry_helps else 'cannot'} help)", flush=True
        )
        return e.exit_code
    print(
        f"[relay] chunk {req.chunk} of run {req.run} done: steps {result.resumed_from} -> "
        f"{result.end_step} in {result.seconds:.1f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
