"""The causes a chunk's attempt can fail of, each with what it is, its default policy and what a person does.

The vocabulary alone, so that the spec (`airflow.retry_on`) can name causes and policies without importing the
classification (relay.runs.failure_cause), which reads the run folder.
"""

from __future__ import annotations

PREEMPTED = "preempted"
NODE_LOST = "node_lost"
HOST_OOM = "host_oom"
ACCELERATOR_OOM = "accelerator_oom"
COLLECTIVE_TIMEOUT = "collective_timeout"
EXCEPTION = "exception"
REFUSED = "refused"
INFRASTRUCTURE = "infrastructure"
STALLED = "stalled"
UNKNOWN = "unknown"

RETRY, BACKOFF, STOP = "retry", "backoff", "stop"
POLICIES = (RETRY, BACKOFF, STOP)

# cause -> (what it is, in an alert's words; its default policy; what a person does about it)
CAUSES: dict[str, tuple[str, str, str]] = {
    NODE_LOST: (
        "a Ray node of the job was lost (its raylet died: a dead host, a reclaimed spot node)",
        RETRY,
        "nothing for an elastic run (nnodes as [min, max]): its retry goes on at the world size the cluster still "
        "holds after elastic.wait_for_nodes_minutes, and grows back when nodes return. Otherwise the retry waits for "
        "the same GPUs: bring the node back, or give the spec a range. If it repeats, look at the node's health",
    ),
    PREEMPTED: (
        "preempted or node lost: the job was killed from outside",
        RETRY,
        "nothing, if it was a preemption: the retry resumes from the latest checkpoint. If it repeats, "
        "look for what kills the node (spot reclaims, `ray job stop`, a node's health checks)",
    ),
    HOST_OOM: (
        "out of host memory",
        BACKOFF,
        "lower the memory a step needs (the spec's batch-size keys: data.train_batch_size, "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, rollout.n) or give the Ray workers more "
        "memory; look for another process on the node using it",
    ),
    ACCELERATOR_OOM: (
        "out of accelerator (GPU) memory",
        STOP,
        "lower the memory a step needs: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, "
        "actor_rollout_ref.rollout.gpu_memory_utilization, data.max_response_length, or turn on "
        "gradient checkpointing / parameter offload; a retry with the same settings fails again",
    ),
    COLLECTIVE_TIMEOUT: (
        "collective timeout (NCCL/gloo watchdog, lost peer)",
        BACKOFF,
        "check the nodes' network and that every rank is alive; a rank that died first has its own "
        "error in its worker's log",
    ),
    EXCEPTION: (
        "an exception in the training code (reward function, dataset, model)",
        RETRY,
        "read the traceback below; fix the reward function or the data row it names, then clear the task",
    ),
    REFUSED: (
        "refused by Relay (a check failed: validation, settings drift, data change, lease)",
        STOP,
        "read Relay's reason below and do what it says; retrying without a change is refused again",
    ),
    INFRASTRUCTURE: (
        "Relay or infrastructure error (S3, the Ray cluster, a lock)",
        RETRY,
        "check that S3 and the Ray head answer (`relay doctor`); the retry resumes from the latest checkpoint",
    ),
    STALLED: (
        "stalled or timed out: Relay stopped a job that made no progress",
        RETRY,
        "look at the job's log for where it hangs (a dead rank, a deadlocked dataloader)",
    ),
    UNKNOWN: ("unknown: no evidence names a cause", RETRY, "read the job's log below"),
}
