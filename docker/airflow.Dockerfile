# The Airflow image of docker-compose.yaml, built from requirements.txt exactly as scripts/bootstrap.sh
# builds .venv (the CPU build of torch first, then everything else, `pip check` clean): the image runs
# the package set CI tests. Airflow's own image is not the base: its preinstalled providers would be a
# second, untested resolution. Tasks here validate and publish checkpoints and export Hugging Face
# models: no GPU is needed. Relay's code (dags/, plugins/, include/) is bind-mounted, not copied.
FROM python:3.11.14-slim-bookworm

ENV AIRFLOW_HOME=/opt/airflow PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

COPY requirements.txt /tmp/relay-requirements.txt
RUN pip install "$(grep -E '^torch==' /tmp/relay-requirements.txt)" \
        --index-url https://download.pytorch.org/whl/cpu \
 && pip install -r /tmp/relay-requirements.txt \
 && pip check

# uid 1000 with gid 0: the uid of Ray's `ray` user, since Airflow and Ray write the same checkpoint
# folders. The mount points belong to it, so fresh named volumes start with that owner.
RUN useradd --uid 1000 --gid 0 --home-dir /opt/airflow --no-create-home relay \
 && mkdir -p /opt/airflow/logs /opt/airflow/auth /relay/checkpoints \
 && chown 1000:0 /opt/airflow /opt/airflow/logs /opt/airflow/auth /relay/checkpoints \
 && chmod 2775 /opt/airflow /opt/airflow/logs /opt/airflow/auth /relay/checkpoints
USER 1000:0
WORKDIR /opt/airflow
