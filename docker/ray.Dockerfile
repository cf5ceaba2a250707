# The Ray image of docker-compose.yaml (head and GPU worker): Ray 2.60.0 with verl 0.9.1 and its rollout
# engine. verl's [vllm] extra pins its own stack: torch 2.11.0, vllm 0.24.0, transformers 5.9.0, plus
# verl-core (TransferQueue, hydra, ...) that main_ppo's v1 trainer imports. That is NOT the torch 2.13.0
# CPU build of requirements.txt (the Airflow side): on the cluster verl's pins win. Relay's code is not
# installed here; it reaches the cluster in each Ray job's runtime_env (py_modules).
FROM rayproject/ray:2.60.0-py311-gpu

# ray is named again so that verl's resolution cannot move it; boto3 and awscrt are what Relay's job
# code needs beyond verl (S3 restores, CRC64NVME), at the versions requirements.txt pins.
RUN pip install --no-cache-dir "ray[default]==2.60.0" "verl[vllm]==0.9.1" boto3==1.44.8 awscrt==0.38.0

# The checkpoint volume's mount point belongs to `ray` (uid 1000), as on the Airflow services.
USER root
RUN mkdir -p /relay/checkpoints /relay/cache \
 && chown 1000:100 /relay/checkpoints /relay/cache \
 && chmod 2775 /relay/checkpoints /relay/cache
USER ray
