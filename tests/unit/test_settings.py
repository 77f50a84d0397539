"""Settings written once: `tinkerd up` offers every service setting and hands each to the
children that have it; each service's own flags parse back to the same settings object."""

import dataclasses

import pytest

from launcher import cli, up
from tinkerd import settings


def _up_args(*flags: str):
    return cli.build_parser().parse_args(["up", "--base-model", "/m", *flags])


def test_a_shared_setting_reaches_every_service_that_has_it():
    args = _up_args("--max-lora-rank", "16", "--dtype", "bfloat16", "--alias", "a/b")
    trainer, sampler = up.child_argv(args, "trainer"), up.child_argv(args, "sampler")
    gateway = up.child_argv(args, "gateway", trainer="t:1", samplers=["s:1", "s:2"])
    for argv in (trainer, sampler):
        assert argv[argv.index("--max-lora-rank") + 1] == "16"
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert gateway[gateway.index("--alias") + 1] == "a/b" and trainer[trainer.index("--alias") + 1] == "a/b"
    assert [gateway[i + 1] for i, a in enumerate(gateway) if a == "--sampler"] == ["s:1", "s:2"]


@pytest.mark.parametrize("name", list(up.CHILDREN))
def test_every_setting_of_a_child_is_passed_and_parses_back(name):
    cls = up.CHILDREN[name]
    wiring = {"trainer": "t:1", "samplers": ["s:1"]} if name == "gateway" else {"listen": "127.0.0.1:0"}
    argv = up.child_argv(_up_args("--db-url", "sqlite:///x.db"), name, **wiring)
    for field in settings.fields(cls):
        # An empty list or None has no flag occurrence (a None given a value is checked below).
        if settings.default_of(field) not in ([], None) or field.name in wiring:
            flag = settings.flag_name(field)
            assert flag in argv or "--no-" + flag[2:] in argv, f"{name} never gets {flag}"   # bools: --no-X
    parsed = cli.build_parser().parse_args(argv)
    assert settings.from_args(cls, parsed) == settings.from_args(cls, _up_args("--db-url", "sqlite:///x.db"),
                                                                 **wiring)


def test_a_setting_without_a_default_value_reaches_its_child_when_given():
    """--price-* (gateway/billing.py): None unless given, and then passed on as given."""
    flags = ("--price-training-per-mtok", "1.5", "--price-storage-per-gb-month", "0.25")
    gateway = up.child_argv(_up_args(*flags), "gateway", trainer="t:1", samplers=["s:1"])
    built = settings.from_args(up.CHILDREN["gateway"], cli.build_parser().parse_args(gateway))
    assert (built.price_training_per_mtok, built.price_storage_per_gb_month, built.price_sampled_per_mtok) == (
        1.5, 0.25, None)


def test_defaults_are_the_dataclass_defaults():
    args = _up_args()
    for name, cls in up.CHILDREN.items():
        built = settings.from_args(cls, args, **{f: "x" for f in up.WIRED[name]})
        for field in dataclasses.fields(cls):
            if field.name not in up.WIRED[name] and field.name != "base_model":
                assert getattr(built, field.name) == settings.default_of(field), (name, field.name)


def test_a_repeatable_setting_with_choices_reaches_the_trainer_and_refuses_others(capsys):
    trainer = up.child_argv(_up_args("--weight-transport", "gloo", "--weight-transport", "shm"), "trainer")
    parsed = cli.build_parser().parse_args(trainer)
    assert settings.from_args(up.CHILDREN["trainer"], parsed).weight_transports == ["gloo", "shm"]
    with pytest.raises(SystemExit):
        _up_args("--weight-transport", "tcp")
    assert "invalid choice: 'tcp'" in capsys.readouterr().err


def _bounded_fields():
    for cls in (*up.CHILDREN.values(), up.UpSettings):
        for field in settings.fields(cls):
            if field.metadata.get("at_least") is not None or field.metadata.get("above") is not None:
                yield pytest.param(cls, field, id=f"{cls.__name__}.{field.name}")


@pytest.mark.parametrize("cls, field", list(_bounded_fields()))
def test_a_number_out_of_its_bounds_is_a_usage_error_naming_the_flag(cls, field, capsys):
    """`--max-num-seqs 0` used to start the stack, then the sampler died with vLLM's traceback in
    its log; every bounded number is refused as it is parsed, by `up` and by the service alike."""
    at_least, above = field.metadata.get("at_least"), field.metadata.get("above")
    bad = at_least - 1 if at_least is not None else above
    flag, command = settings.flag_name(field), {up.UpSettings: "up"}.get(cls) or next(
        name for name, child in up.CHILDREN.items() if child is cls)
    wiring = {"gateway": ["--trainer", "t:1"]}.get(command, [])
    kind = settings._kind(cls, field)
    for argv in ([command, "--base-model", "/m", *wiring, flag, str(kind(bad))],
                 ["up", "--base-model", "/m", flag, str(kind(bad))]):
        with pytest.raises(SystemExit) as usage:
            cli.build_parser().parse_args(argv)
        assert usage.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be" in err and f"got {kind(bad)}" in err, err
    default = settings.default_of(field)
    assert default is None or ((at_least is None or default >= at_least)      # the default (None: unset) passes
                               and (above is None or default > above))
    ok = at_least if at_least is not None else (above + 1)
    parsed = cli.build_parser().parse_args([command, "--base-model", "/m", *wiring, flag, str(kind(ok))])
    assert getattr(parsed, field.name) == kind(ok)
