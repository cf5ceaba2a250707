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
- `HFRolloutServer`: the server verl's client calls. It holds no model: each `generate()` runs in the
  replica's worker (Ray's `__ray_call__`), so generation uses exactly the weights that worker was given.

Sampling draws from a `torch.Generator` of its own, seeded from the rollout seed, the step, the sample's
index in the dataset and its place in its GRPO group (`RelaySingleTurnAgentLoop`, verl's single-turn
agent loop that passes that identity along with each request), so that neither which worker serves a
request nor the order requests arrive in changes a response; and generation never touches the worker's
global RNG, whose state verl saves with every checkpoint and restores on resume.

This stands in for a production inference engine only in speed: the weights, the prompts, the
sampling parameters and the token ids verl receives are those of verl's own loop.
"""

from __future__ import annotations

import hashlib
import threading
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

    def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], sample_id: str | None = None) -> TokenOutput:
        """One response to one prompt, sampled with a generator of its own (see the module's docstring).
        sample_id: the request's identity (dataset index/place in group); without it, the prompt and how many
        responses it had in this step so far (then the order requests arrive in matters)."""
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


def _generate_in_worker(_worker, prompt_ids, sampling_params, sample_id) -> TokenOutput:
    """Run by Ray's __ray_call__ inside the replica's worker process, where the adapter lives."""
    if _ADAPTER is None:
        raise RuntimeError(
            "no hf rollout in this worker: actor_rollout_ref.rollout.name must be 'hf' "
            "and the worker's init_model must have run"
        )
    return _ADAPTER.generate(prompt_ids, sampling_params, sample_id)


SAMPLE_KWARG = "relay_sample"  # the request's identity, from RelaySingleTurnAgentLoop to HFRolloutServer


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
    """The server verl's LLMServerClient calls; the generation itself runs in the replica's worker."""

    def __init__(self, worker):
        self.worker = worker

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        relay_sample: str | None = None,
        **_multimodal,
    ) -> TokenOutput:
        return await self.worker.__ray_call__.remote(
            _generate_in_worker, list(prompt_ids), dict(sampling_params), relay_sample
        )

    # What verl asks of every server between steps: nothing to free or resume here.
    async def wake_up(self):
        pass

    async def sleep(self):
        pass

    async def abort_all_requests(self, reject_request: bool = False):
        pass

    async def resume_generation(self):
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
        ).remote(worker)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-rollout-{self.replica_rank}{self.name_suffix}"

    def rollout_worker_use_gpu(self) -> bool:
        return False
