"""``mempo up``'s command line: its own options (``UpOptions``' fields) and the services'
settings it exposes (``FEEDS``), each an option made from the setting's field: its
docstring as help, its value under the tiny preset as default, its validation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mempo.options import command_options, field_option, read_options, validated
from mempo_cli.launcher.up import SERVICES, UpOptions, service_settings

# Each option that feeds a service's setting: option -> (service, the setting's path).
FEEDS: dict[str, tuple[str, str]] = {
    "steps": ("learner", "total_steps"),
    "questions": ("learner", "questions_per_task"),
    "group_size": ("learner", "group_size"),
    "batch_groups": ("learner", "batch_groups"),
    "mode": ("learner", "mode"),
    "max_rounds": ("learner", "max_rounds"),
    "max_staleness": ("learner", "max_staleness"),
    "lr": ("learner", "trainer.lr"),
    "warmup_steps": ("learner", "trainer.warmup_steps"),
    "lr_decay_steps": ("learner", "trainer.decay_steps"),
    "ppo_epochs": ("learner", "trainer.ppo_epochs"),
    "beta_kl": ("learner", "trainer.beta_kl"),
    "alpha": ("learner", "trainer.alpha"),
    "mem_min_std": ("learner", "trainer.mem_min_std"),
    "neg_adv_scale": ("learner", "trainer.neg_adv_scale"),
    "mem_loss": ("learner", "trainer.mem_loss"),
    "mem_baseline": ("learner", "trainer.mem_baseline"),
    "mem_gate": ("learner", "trainer.mem_gate"),
    "mem_norm": ("learner", "trainer.mem_norm"),
    "weight_sync": ("learner", "weight_sync"),
    "track": ("learner", "tracking"),
    "sample_every": ("learner", "sample_every"),
    "reward": ("worker", "reward_kind"),
    "max_new_tokens": ("worker", "max_new_tokens"),
}
OWN = [name for name in UpOptions.model_fields if name != "given"]  # not on the command line

HELP = """Run the whole training loop on this machine (CPU, no set-up), then plot it.

The defaults are the tiny model's recipe (the learner's and the workers' tiny preset,
docs/results.md): plain GRPO (--alpha 1 for MemPO's memory advantage) on 1-question
tasks, 8 groups of 8 rollouts a step, 2 PPO epochs, KL to the starting policy 0.02,
negative advantages scaled by 0.2, 30 steps. A MEMPO_<SERVICE>_<NAME> variable sets any
other setting of that service; options win."""


def setting_field(service: str, path: str) -> FieldInfo:
    """The field a setting's dotted path names (``trainer.lr``: TrainerConfig.lr)."""
    model: type[BaseModel] = SERVICES[service]
    *blocks, name = path.split(".")
    for block in blocks:
        model = model.model_fields[block].annotation  # type: ignore[assignment]
    return model.model_fields[name]


def setting_value(settings: BaseModel, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


def defaults() -> dict[str, Any]:
    """What each FEEDS option is when not given: its setting under the tiny preset (and the
    environment's variables, as in the service)."""
    built = {
        service: service_settings(UpOptions(), service)
        for service in {s for s, _ in FEEDS.values()}
    }
    return {
        option: setting_value(built[service], path) for option, (service, path) in FEEDS.items()
    }


def parse_up(args: Sequence[str]) -> UpOptions:
    """``mempo up``'s options from ``args``; ``--help`` lists them all with their defaults.
    A bad value exits 2 naming the option, before anything starts."""
    shown = defaults()
    params = command_options(UpOptions, exclude=["given"]) + [
        field_option(option, setting_field(*FEEDS[option]), shown[option]) for option in FEEDS
    ]
    given = read_options("mempo up", params, args, HELP)
    settings: dict[str, dict[str, Any]] = {}
    for option, (service, path) in FEEDS.items():
        if option in given:
            *blocks, name = path.split(".")
            target = settings.setdefault(service, {})
            for block in blocks:
                target = target.setdefault(block, {})
            target[name] = given[option]
    values = {**{name: given[name] for name in OWN if name in given}, "given": settings}
    opts = validated(lambda: UpOptions(**values), _option)
    for service in settings:  # each service's settings checked now, not in its process
        validated(lambda: service_settings(opts, service), lambda where: _option(where, service))  # noqa: B023
    return opts


def _option(where: str, service: str | None = None) -> str:
    """The option a setting's error names (``trainer.lr`` of the learner: ``--lr``)."""
    if service is None:
        return f"--{where.replace('_', '-')}"
    for option, (owner, path) in FEEDS.items():
        if owner == service and path == where:
            return f"--{option.replace('_', '-')}"
    return f"{service} setting {where}"
