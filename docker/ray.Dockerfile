# The Ray image of docker-compose.yaml (head and GPU worker): Ray 2.60.0 with verl 0.9.1 and its rollout
# engine. verl's [vllm] extra pins its own stack: torch 2.11.0, vllm 0.24.0, transformers 5.9.0, plus
# verl-core (TransferQueue, hydra, ...) that main_ppo's v1 trainer imports. That is NOT the torch 2.13.0
# CPU build of requirements.txt (the Airflow side): on the cluster verl's pins win. Relay's code is not
# installed here; it reaches the cluster in each Ray job's runtime_env (py_modules).
FROM rayproject/ray:2.60.0-py311-gpu

# ray is named again so that verl's resolution cannot move it; boto3, awscrt and isal are what Relay's job
# code needs beyond verl (S3 restores, CRC64NVME, the zip entries' CRC-32), at the versions requirements.txt pins.
RUN pip install --no-cache-dir "ray[default]==2.60.0" "verl[vllm]==0.9.1" boto3==1.44.8 awscrt==0.38.0 isal==1.9.1

# Attention: no flash-attn here. verl loads its FSDP models with attn_implementation flash_attention_2 unless
# told otherwise, and verl[vllm] does not bring flash-attn. verl's [fsdp] extra does, but its prebuilt wheel
# (CPython 3.12) comes through a uv-only source; pip reads the bare pin flash-attn==2.8.3, an sdist that would
# most likely compile from source (about an hour, needs nvcc). So this image provides the attention built into
# torch, sdpa and eager, and include/runs/gsm8k_grpo.yaml asks for sdpa; vLLM's rollout has its own kernels.
# RELAY_IMAGE_ATTENTION says so to `relay spec check` and `relay doctor` (plugins/relay/preflight/attention.py).
# To add flash_attention_2: install a prebuilt flash-attn wheel for this image's exact tuple (torch 2.11, CUDA
# 13.0 as verl pairs with torch 2.11, CPython 3.11, cxx11 ABI), e.g. flash_attn-2.8.3+cu130torch2.11-cp311-
# cp311-linux_x86_64.whl from github.com/mjun0812/flash-attention-prebuild-wheels release v0.9.4 (a third-party
# build Relay has not tested), add flash_attention_2 to the line below, and set it in the spec.
ENV RELAY_IMAGE_ATTENTION="sdpa eager"

# The checkpoint volume's mount point belongs to `ray` (uid 1000), as on the Airflow services.
USER root
RUN mkdir -p /relay/checkpoints /relay/cache \
 && chown 1000:100 /relay/checkpoints /relay/cache \
 && chmod 2775 /relay/checkpoints /relay/cache
USER ray
