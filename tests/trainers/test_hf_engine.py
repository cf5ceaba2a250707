"""The hf rollout's server as an inference engine in time (relay.trainers.verl_ppo.cpu.hf_rollout.HFRolloutServer):
responses streamed a token per latency, cut where they are by verl's abort, requests parked until its resume, a
cut-short request continued to its drawn length; the sampling itself is the worker's (stood in here by one that
answers a fixed response: the DAG tests run the real worker, tests/airflow/test_verl_separate_dag.py)."""

from __future__ import annotations

import asyncio
import statistics

from verl.workers.rollout.replica import TokenOutput

from relay.trainers.verl_ppo.cpu.hf_rollout import HFRolloutServer, tail_length


class Worker:
    """A replica's worker: answers `limit` tokens (or 20) at once, recording what each call asked."""

    def __init__(self):
        self.calls: list[tuple[str | None, int | None]] = []
        self.__ray_call__ = self

    def remote(self, _fn, prompt_ids, sampling_params, sample_id, limit=None):
        self.calls.append((sample_id, limit))

        async def answer():
            n = limit or 20
            return TokenOutput(token_ids=list(range(n)), log_probs=[-1.0] * n, stop_reason="completed", extra_fields={})

        return answer()


def test_an_abort_cuts_each_stream_where_it_is_parks_new_requests_and_a_resume_lets_them_go_on():
    async def scenario():
        worker = Worker()
        server = HFRolloutServer(worker, {"token_latency_ms": 10})
        params = {"max_tokens": 20, "logprobs": True}
        first = asyncio.create_task(server.generate("r1", [1, 2], params, relay_sample="7/0"))
        await asyncio.sleep(0.065)
        await server.abort_all_requests()
        cut = await first
        parked = asyncio.create_task(server.generate("r1", [1, 2, *cut.token_ids], params, relay_sample="7/0"))
        await asyncio.sleep(0.05)
        assert not parked.done()  # nothing is generated between an abort and the resume
        await server.resume_generation()
        whole = await parked
        return worker, server, cut, whole

    worker, server, cut, whole = asyncio.run(scenario())
    assert cut.stop_reason == "aborted" and 3 <= len(cut.token_ids) <= 8 and len(cut.log_probs) == len(cut.token_ids)
    assert whole.stop_reason == "completed" and len(whole.token_ids) == 20
    # the continuation is sampled as a sample of its own (its identity carries the tokens already given)
    assert worker.calls == [("7/0", None), (f"7/0+{len(cut.token_ids)}", None)]
    assert server.counts == {"requests": 2, "cut_short": 1, "continued": 1}


def test_without_latency_a_response_returns_at_once_and_a_leaving_replica_turns_requests_away():
    async def scenario():
        server = HFRolloutServer(Worker())
        at_once = await server.generate("r", [1], {"max_tokens": 20})
        await server.abort_all_requests(reject_request=True)
        turned = await asyncio.wait_for(server.generate("q", [1], {"max_tokens": 20}), timeout=1)
        return at_once, turned

    at_once, turned = asyncio.run(scenario())
    assert at_once.stop_reason == "completed" and len(at_once.token_ids) == 20
    assert turned.stop_reason == "aborted" and turned.token_ids == []  # verl's client asks again, elsewhere


def test_long_tail_lengths_are_mostly_short_a_few_at_the_longest_and_a_continuation_keeps_its_draw():
    lengths = [tail_length(1234, f"{i}/{j}", 64) for i in range(250) for j in range(4)]
    assert 8 <= statistics.median(lengths) <= 18 and 0.02 <= lengths.count(64) / len(lengths) <= 0.08
    assert lengths == [tail_length(1234, f"{i}/{j}", 64) for i in range(250) for j in range(4)]  # the same draws

    async def scenario():
        worker = Worker()
        server = HFRolloutServer(worker, {"token_latency_ms": 5, "response_lengths": "long_tail"}, seed=1234)
        sample = next(f"{i}/0" for i in range(100) if tail_length(1234, f"{i}/0", 64) > 20)
        task = asyncio.create_task(server.generate("r", [1], {"max_tokens": 64}, relay_sample=sample))
        await asyncio.sleep(0.03)
        await server.abort_all_requests()
        cut = await task
        await server.resume_generation()
        rest = await server.generate("r", [1], {"max_tokens": 64 - len(cut.token_ids)}, relay_sample=sample)
        return tail_length(1234, sample, 64), cut, rest

    drawn, cut, rest = asyncio.run(scenario())
    assert cut.stop_reason == "aborted" and len(cut.token_ids) + len(rest.token_ids) == drawn
