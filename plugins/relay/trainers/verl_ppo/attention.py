"""Can the attention a verl_ppo spec asks for be loaded where its models load? (`relay spec check`,
`relay doctor`, the DAG's resume checklist.) A warning, never a failure: what is known from here is partial.

verl loads its FSDP models with attn_implementation flash_attention_2 unless the spec says otherwise
(`trainer.settings.attn_implementation`), and verl 0.9.1 loads a critic's value model (adv_estimator
gae) with flash_attention_2 whatever the setting says. Either needs the flash_attn package on every
worker, or the model load fails with an ImportError about flash_attn. sdpa and eager are built into
torch and always load.

Where that can be known: whether flash_attn imports on the host the check runs on (an Airflow worker
or a laptop need not be a Ray node), and what the cluster image says it provides, RELAY_IMAGE_ATTENTION:
in this process's environment (a process in Relay's Ray image), else on the ENV line of
docker/ray.Dockerfile under the project root (the image Relay builds; a cluster may run another).
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from relay.common import project

MARKER = "RELAY_IMAGE_ATTENTION"
FLASH = "flash_attention_2"
SETTING = "trainer.settings.attn_implementation"
BUILT_IN = ("sdpa", "eager")  # torch's own: every image has them
_ENV_LINE = re.compile(rf"^\s*ENV\s+{MARKER}(?:=|\s+)(?:\"([^\"]*)\"|'([^']*)'|(\S+))", re.MULTILINE)


@dataclass(frozen=True)
class ImageAttention:
    """What the cluster image says it provides; backends None when that cannot be known here."""

    backends: frozenset[str] | None
    where: str  # how it was learned, or why not


@dataclass(frozen=True)
class AttentionCheck:
    ok: bool  # False: a warning (the spec still loads and runs its checks)
    detail: str
    fix: str = ""


def dockerfile(root: Path | None = None) -> Path:
    return (root or project.root()) / "docker" / "ray.Dockerfile"


def image_attention(environ=None, root: Path | None = None) -> ImageAttention:
    """RELAY_IMAGE_ATTENTION from this process's environment, else from docker/ray.Dockerfile's ENV line."""
    env = os.environ if environ is None else environ
    if env.get(MARKER, "").strip():
        return ImageAttention(frozenset(env[MARKER].split()), f"this host's image ({MARKER}={env[MARKER]!r})")
    path = dockerfile(root)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ImageAttention(None, f"{path} is not here to say")
    m = _ENV_LINE.search(text)
    if not m:
        return ImageAttention(None, f"{path} has no ENV {MARKER} to say")
    value = next(g for g in m.groups() if g is not None)
    return ImageAttention(frozenset(value.split()), f"the image Relay builds (docker/ray.Dockerfile, {MARKER}={value!r})")


def flash_attn_here() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def check(
    spec, *, flash_attn_importable: bool | None = None, image: ImageAttention | None = None, host: str | None = None
) -> AttentionCheck | None:
    """The spec's attention against what can be known here (verl_ppo's environment check, relay.spec.kinds)."""
    s = spec.settings
    asked = s.attention  # None: verl's default
    effective = asked or FLASH
    critic = bool(getattr(s, "has_critic", False))
    what = f"{effective}" + ("" if asked else " (verl's default: the spec sets no attn_implementation)")
    if effective != FLASH and not critic:
        return AttentionCheck(True, f"{what}: built into torch, no flash-attn needed")
    if effective != FLASH and getattr(s, "device", None) == "cpu":
        return AttentionCheck(
            True,
            f"{what}: built into torch; on Relay's CPU platform the critic's value model is loaded with sdpa too "
            "(relay.trainers.verl_ppo.cpu.patches)",
        )
    needs = (
        f"{SETTING} is {what}"
        if effective == FLASH
        else f"adv_estimator {s.adv_estimator} has a critic, whose value model verl 0.9.1 loads with {FLASH} "
        f"whatever {SETTING} ({effective}) says"
    )
    if flash_attn_importable is None:
        flash_attn_importable = flash_attn_here()
    host = host or socket.gethostname()
    if flash_attn_importable:
        return AttentionCheck(
            True, f"{needs}: flash_attn imports on this host ({host}); the cluster's image must have it too"
        )
    image = image or image_attention()
    if image.backends is not None and FLASH in image.backends:
        return AttentionCheck(
            True,
            f"{needs}: {image.where} provides it (flash_attn does not import on this "
            f"host, {host}, which need not be a Ray node)",
        )
    if image.backends is None:
        known = f"what the cluster's image provides cannot be known here ({image.where})"
    else:
        known = f"{image.where} provides {', '.join(sorted(image.backends)) or 'nothing'} only"
        known += "" if image.where.startswith("this host") else "; a cluster that runs another image with flash-attn is fine"
    detail = (
        f"{needs}, which needs flash-attn on the Ray workers: without it verl fails at model load, with an "
        f"ImportError about flash_attn on every worker. Checked here: flash_attn does not import on this host "
        f"({host}; it need not be a Ray node), and {known}"
    )
    if effective == FLASH:
        fix = (
            f"set {SETTING}: sdpa (built into torch; works with FSDP and the vLLM rollout), or install "
            f"flash-attn in the cluster image (a prebuilt wheel matching its torch, CUDA and Python: "
            f"docker/ray.Dockerfile says how) and add {FLASH} to its {MARKER}"
        )
    else:
        fix = (
            f"install flash-attn in the cluster image (docker/ray.Dockerfile says how) and add {FLASH} to its "
            f"{MARKER}, or use an adv_estimator without a critic (grpo)"
        )
    return AttentionCheck(False, detail, fix)
