"""Text generation with transformers inside verl's rollout workers: the CPU path's rollout, named `hf`.

verl 0.9.1 generates through rollout *replicas* (`verl/workers/rollout/replica.py`): each replica
launches server actors, and verl's agent loop sends token-in, token-out requests to a server's
`generate()` through `LLMServerClient`. Only vLLM, SGLang and TensorRT-LLM replicas exist, and none
runs on a CPU. This module adds a fourth, registered through verl's own registries:

- `HFServerAdapter` (verl's `_ROLLOUT_REGISTRY[("hf", "async")]`): the rollout object verl's
  `ActorRolloutRefWorker.init_model` builds inside the hybrid worker. It holds a transformers copy of
  the policy. verl's naive checkpoint engine feeds it: `ActorRolloutRefWorker.update_weights` passes
  the actor engine's `get_per_tensor_param()` generator to `update_weights()` after every step,
  in-process, as it does for vLLM's adapter.
- `HFReplica` (verl's `RolloutReplicaRegistry["hf"]`): one server actor per replica, over one hybrid worker
  or (separate_async) over one standalone rollout worker: verl's `CheckpointEngineWorker`, which builds the
  adapter in a process of its own and feeds it the weights its checkpoint engine receives (Relay's gloo
  engine on a CPU) after every step.
- `HFRolloutServer`: the server verl's client calls, and the engine's behaviour. It holds no model: each
  `generate()` samples in the replica's worker (Ray's `__ray_call__`), so generation uses exactly the weights that
  worker was given. With `engine_kwargs.hf.token_latency_ms` (the spec's `hf_engine`) it then streams the response
  one token per that latency, many requests at once (an async actor: as an engine's continuous batch), and honours
  verl's abort as vLLM does: `abort_all_requests` cuts every request where its stream is (stop_reason `aborted`,
  the tokens so far), and parks the requests that arrive until `resume_generation`; verl's client then asks again
  with the prompt and the tokens so far, generated on under the weights of then (a partial rollout).
  `response_lengths: long_tail` draws each sample's length from a Pareto tail (most short, a few at the maximum).
  separate_async's replicas run in processes of their own, so generation overlaps training there.

Sampling draws from a `torch.Generator` of its own, seeded from the rollout seed, the step, the sample's
index in the dataset and its place in its GRPO group (`RelaySingleTurnAgentLoop`, verl's single-turn
agent loop that passes that identity along with each request), so that neither which worker serves a
request nor the order requests arrive in changes a response; and generation never touches the worker's
global RNG, whose state verl saves with every checkpoint and restores on resume.

This stands in for a production inference engine only in speed and scale: the weights, the prompts, the
sampling parameters and the token ids verl receives are those of verl's own loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import threading
import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from relay.trainers.verl_ppo.cpu.hf_sampling import sample, seed_of

_ADAPTER: HFServerAdapter | None = None  # the adapter of this process (a hybrid or standalone worker holds one)


class HFServerAdapter(BaseRollout):
    """The policy's copy for generation, in a hybrid worker (weights from verl's naive engine) or a standalone one
    (from its checkpoint engine)."""

    def __init__(self, config, model_config, device_mesh, *args, replica_rank: int = 0, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        global _ADAPTER
        self.replica_rank = replica_rank  # a standalone worker's (verl's CheckpointEngineWorker asks for it)
        self.is_leader_rank = True  # one worker per replica
        from transformers import AutoModelForCausalLM

        path = self.model_config.local_path
        attention = (self.model_config.override_config or {}).get("attn_implementation") or "sdpa"  # the actor's
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
        self.model.eval()
        self.eos_ids = _eos_ids(self.model_config, self.model)
        self.global_steps = 0
        self._seen: dict[str, int] = {}  # responses given per prompt in this step (seeds the next one)
        self._lock = threading.Lock()
        _ADAPTER = self

    async def resume(self, tags: list[str]):
        pass  # weights and cache live in host memory; nothing was released

    async def release(self):
        pass

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes full named tensors, not {wire_format!r}")
        own = self.model.state_dict()
        loaded = set()
        with torch.no_grad():
            # a generator in a hybrid worker (verl's naive engine), an async one from a standalone worker's engine
            async for name, tensor in ensure_async_iterator(weights):
                if name not in own:
                    raise KeyError(
                        f"the actor sent {name!r}, which the rollout model {self.model_config.local_path} does not have"
                    )
                own[name].copy_(tensor.to(own[name].dtype))
                loaded.add(name)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = set(own) - loaded - tied
        if missing:
            raise KeyError(f"the actor's weights lack {sorted(missing)[:5]}: the rollout would generate with stale ones")
        with self._lock:
            if kwargs.get("global_steps") is not None:
                self.global_steps = int(kwargs["global_steps"])
            self._seen.clear()

    def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        sample_id: str | None = None,
        limit: int | None = None,
    ) -> TokenOutput:
        """One response to one prompt, sampled with a generator of its own (see the module's docstring).
        sample_id: the request's identity (dataset index/place in group); without it, the prompt and how many
        responses it had in this step so far (then the order requests arrive in matters). limit: at most this many
        tokens (the stand-in engine's drawn length)."""
        with self._lock:
            step = self.global_steps
            if sample_id is None:
                key = hashlib.sha256(repr(list(prompt_ids)).encode()).hexdigest()
                nth = self._seen.get(key, 0)
                self._seen[key] = nth + 1
                sample_id = f"prompt:{key}:{nth}"
        seed = seed_of(self.config.seed, step, sample_id)
        max_new = int(
            sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens") or self.config.response_length
        )
        if limit is not None:
            max_new = max(1, min(max_new, limit))
        tokens, logps = sample(
            self.model,
            prompt_ids,
            max_new,
            self.eos_ids,
            seed,
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_k=int(sampling_params.get("top_k", -1) or -1),
            top_p=float(sampling_params.get("top_p", 1.0) or 1.0),
        )
        return TokenOutput(
            token_ids=tokens,
            log_probs=logps if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": step},
        )


def _eos_ids(model_config, model) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model_config, "generation_config", None), model.generation_config, model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    tok = getattr(model_config, "tokenizer", None)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


def _generate_in_worker(_worker, prompt_ids, sampling_params, sample_id, limit=None) -> TokenOutput:
    """Run by Ray's __ray_call__ inside the replica's worker process, where the adapter lives."""
    if _ADAPTER is None:
        raise RuntimeError(
            "no hf rollout in this worker: actor_rollout_ref.rollout.name must be 'hf' "
            "and the worker's init_model must have run"
        )
    return _ADAPTER.generate(prompt_ids, sampling_params, sample_id, limit)


def tail_length(seed: int, sample_id: str, longest: int, alpha: float = 1.5) -> int:
    """A sample's length under response_lengths long_tail: a Pareto draw (shape alpha) scaled to an eighth of the
    longest, capped there: the median about a fifth of the longest, about one sample in 23 at it. The same for a
    sample wherever and whenever it is generated (seeded by its identity, not the step)."""
    u = (seed_of(seed, 0, f"length:{sample_id}") % 1_000_003 + 1) / 1_000_004  # uniform in (0, 1)
    return max(1, min(longest, math.ceil(longest / 8 * u ** (-1 / alpha))))


SAMPLE_KWARG = "relay_sample"  # the request's identity, from RelaySingleTurnAgentLoop to HFRolloutServer
TRACE_ENV = "RELAY_HF_ENGINE_TRACE"  # a file: one JSON line per request served (bench/async.py)


class RelaySingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop, its requests tagged with the sample's identity: the dataset index and
    the place in the GRPO group (verl's session_id), which seed that response's sampling."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> Any:
        index, session = kwargs.get("index"), kwargs.get("session_id")
        if index is not None and session is not None:
            # (setattr: verl's class is untyped here, and mypy cannot tell the attribute's type)
            setattr(self, "server_manager", _Tagged(self.server_manager, f"{index}/{session}"))  # noqa: B010
        return await super().run(sampling_params, **kwargs)


class _Tagged:
    """verl's LLMServerClient, adding the sample's identity to each generate() (it forwards extra keyword
    arguments to the server's generate)."""

    def __init__(self, client, sample_id: str):
        self._client, self._sample_id = client, sample_id

    async def generate(self, *args, **kwargs):
        return await self._client.generate(*args, **{**kwargs, SAMPLE_KWARG: self._sample_id})

    def __getattr__(self, name):
        return getattr(self._client, name)


def _node_id(_worker) -> str:
    return ray.get_runtime_context().get_node_id()


class HFRolloutServer:
    """The server verl's LLMServerClient calls, behaving as an inference engine in time (see the module's docstring):
    the sampling itself runs in the replica's worker."""

    def __init__(self, worker, engine: dict | None = None, seed: int = 0):
        engine = dict(engine or {})
        self.worker = worker
        self.latency = float(engine.get("token_latency_ms") or 0.0) / 1000.0
        self.long_tail = engine.get("response_lengths") == "long_tail"
        self.seed = seed
        self._open = asyncio.Event()  # closed between abort_all_requests and resume_generation
        self._open.set()
        self._cut = asyncio.Event()  # set by an abort: every stream now running stops where it is
        self._reject = False
        self._done: dict[str, int] = {}  # request id -> tokens given before an abort (its drawn length counts them)
        self.counts = {"requests": 0, "cut_short": 0, "continued": 0}

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        relay_sample: str | None = None,
        **_multimodal,
    ) -> TokenOutput:
        if not self._open.is_set():
            if self._reject:  # leaving the balancer: verl's client asks again, elsewhere
                return _cut_short(TokenOutput(token_ids=[], log_probs=[], extra_fields={}), 0)
            await self._open.wait()  # parked until resume_generation, as vLLM parks them
        cut = self._cut
        self.counts["requests"] += 1
        before = self._done.pop(request_id, 0)
        if before:
            self.counts["continued"] += 1
        identity = relay_sample if before == 0 or relay_sample is None else f"{relay_sample}+{before}"
        limit = None
        if self.long_tail:
            longest = before + int(sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens") or 1)
            limit = max(1, tail_length(self.seed, relay_sample or request_id, longest) - before)
        began = time.time()
        out = await self.worker.__ray_call__.remote(
            _generate_in_worker, list(prompt_ids), dict(sampling_params), identity, limit
        )
        given = await self._stream(out, cut)
        if given is not None:
            self.counts["cut_short"] += 1
            self._done[request_id] = before + given
            out = _cut_short(out, given)
        if TRACE_ENV in os.environ:  # the async benchmark's record of when the engine was busy
            with open(os.environ[TRACE_ENV], "a") as f:
                f.write(json.dumps({"began": began, "ended": time.time(), "cut": given is not None}) + "\n")
        return out

    async def _stream(self, out: TokenOutput, cut: asyncio.Event) -> int | None:
        """Stream the response a token per latency: None once it is whole; the tokens given when an abort cuts it."""
        if self.latency <= 0 and not cut.is_set():
            return None
        began = time.monotonic()
        if not cut.is_set():
            try:
                await asyncio.wait_for(cut.wait(), timeout=self.latency * len(out.token_ids))
            except TimeoutError:
                return None
        given = int((time.monotonic() - began) / self.latency) if self.latency else 0
        return max(0, min(len(out.token_ids) - 1, given))

    async def abort_all_requests(self, reject_request: bool = False):
        self._reject = reject_request
        self._open.clear()
        self._cut.set()

    async def resume_generation(self):
        self._cut = asyncio.Event()
        self._reject = False
        self._open.set()

    # What verl asks of every server between steps: nothing to free here.
    async def wake_up(self):
        pass

    async def sleep(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


def _cut_short(out: TokenOutput, given: int) -> TokenOutput:
    """The first `given` tokens of a response, as an engine returns a request it aborted (with no token, no policy
    version: verl's client then dates the response by the weights that generate it)."""
    logps = out.log_probs[:given] if out.log_probs is not None else None
    extra = dict(out.extra_fields or {})
    if given == 0:
        extra.pop("global_steps", None)
    return TokenOutput(
        token_ids=list(out.token_ids[:given]), log_probs=logps, stop_reason="aborted", num_preempted=0, extra_fields=extra
    )


# An actor of no CPU: it only forwards each request to the worker, which does the work.
_SERVER_ACTOR = ray.remote(num_cpus=0)(HFRolloutServer)


class HFReplica(RolloutReplica):
    """A replica of one worker, hybrid or standalone (tensor, data and pipeline parallel sizes of 1)."""

    async def launch_servers(self):
        if len(self.workers) != 1:
            raise ValueError(
                f"the hf rollout serves from one worker per replica, got {len(self.workers)}: "
                "set actor_rollout_ref.rollout.tensor_model_parallel_size=1"
            )
        worker = self.workers[0]
        node = await worker.__ray_call__.remote(_node_id)
        server = _SERVER_ACTOR.options(
            name=f"relay_hf_rollout_{self.replica_rank}{self.name_suffix}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(worker, _engine_kwargs(self.config), int(getattr(self.config, "seed", 0) or 0))
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-rollout-{self.replica_rank}{self.name_suffix}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


def _engine_kwargs(config) -> dict:
    """The spec's hf_engine, from verl's rollout config (actor_rollout_ref.rollout.engine_kwargs.hf)."""
    kwargs = getattr(config, "engine_kwargs", None) or {}
    hf = kwargs.get("hf") if hasattr(kwargs, "get") else None
    return {str(k): v for k, v in dict(hf or {}).items()}
