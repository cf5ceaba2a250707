from relay.spec.plan import ChunkPlan


def test_chunks_end_at_fixed_steps():
    plan = ChunkPlan(60, 20)
    assert [(c.first_step, c.end_step) for c in plan.chunks] == [(1, 20), (21, 40), (41, 60)]
    assert [c.task_group_id for c in plan.chunks] == ["chunk_01", "chunk_02", "chunk_03"]


def test_last_chunk_is_short_when_total_is_not_a_multiple():
    plan = ChunkPlan(50, 20)
    assert [(c.first_step, c.end_step) for c in plan.chunks] == [(1, 20), (21, 40), (41, 50)]
    assert plan.chunk_for_step(41).index == 3


def test_done_chunks_follow_the_latest_checkpoint():
    plan = ChunkPlan(60, 20)
    assert plan.next_chunk(None).index == 1
    assert plan.next_chunk(25).index == 2  # a mid-chunk checkpoint does not finish the chunk
    assert plan.next_chunk(40).index == 3
    assert plan.next_chunk(60) is None
    assert [c.done_by(40) for c in plan.chunks] == [True, True, False]


def test_a_train_to_a_step_inside_a_chunk_is_labelled_with_that_chunk(tmp_path):
    """`relay train --to-step N` off a chunk boundary: its metrics rows, events and job name the chunk N is in."""
    from relay.jobs.chunk_job import chunk_index
    from relay.spec.run_spec import load_spec
    from support.helpers import write_spec

    spec = load_spec(write_spec(tmp_path), check_environment=False)  # 12 steps in chunks of 6
    assert [chunk_index(spec, s) for s in (1, 4, 6, 7, 12)] == [1, 1, 1, 2, 2]
    assert chunk_index(spec, 13) is None and chunk_index(spec, 0) is None
