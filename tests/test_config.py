"""SchedConfig: one definition of every knob, resolved flag > file > env > tuned > default."""

import json

import pytest

from bsrun.config import (KNOBS, Credit, SchedConfig, job_signature, load_tuned, parse_credit, parse_size,
                          resolve)
from bsrun.errors import BsrunError


@pytest.mark.parametrize("text,expected", [("4MB", 4_000_000), ("512KiB", 524_288), ("1048576", 1_048_576),
                                           ("2M", 2 * 2**20), ("1.5GB", 1_500_000_000), ("64 kb", 64_000)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "-4MB", "0", "4XB", ""])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_credit_is_bytes_or_a_multiple_of_the_partition():
    assert parse_credit("4x").resolve(1000) == 4000
    assert parse_credit("16MB").resolve(1000) == 16_000_000
    assert str(parse_credit("2.5x")) == "2.5x"
    with pytest.raises(ValueError):
        parse_credit("-1x")


def test_resolution_order_and_sources(tmp_path):
    file = tmp_path / "k.toml"
    file.write_text('credit = "2x"\ntimeout = 60\n')
    env = {"BSRUN_CREDIT": "9MB", "BSRUN_TIMEOUT": "30", "BSRUN_PARTITION": "3MB"}
    config = resolve({"partition": "1MB"}, file, env=env, tuned={"partition": "7MB", "credit": "8x"})
    assert config.partition == 1_000_000 and config.sources["partition"] == "flag"
    assert config.credit == Credit(times=2.0) and config.sources["credit"] == f"config {file}"
    assert config.timeout == 60 and config.sources["timeout"] == f"config {file}"
    assert config.enabled and config.sources["enabled"] == "default"
    tuned = resolve({}, None, env={}, tuned={"partition": "7MB"})
    assert tuned.partition == 7_000_000 and tuned.sources["partition"].startswith("tuned")
    assert tuned.fixed_by_user() == set()
    assert config.fixed_by_user() == {"partition", "credit", "timeout"}


def test_workers_see_exactly_the_launcher_config():
    config = resolve({"partition": "1MB", "enabled": "False"}, None, env={})
    again = SchedConfig.from_env(config.to_env())
    assert again.as_dict() == config.as_dict()


# A value other than the default for every knob: a new knob needs one here too.
NOT_DEFAULT = {"enabled": "0", "partition": "1MB", "credit": "3x", "timeout": "1.5m", "order": "tic",
               "arch": "ps", "servers": "3", "check_every": "7",
               "adapt": "0"}


def test_every_knob_is_one_row_the_cli_env_and_summary_all_follow():
    from bsrun.cli import cli

    assert set(NOT_DEFAULT) == {k.name for k in KNOBS}
    config = resolve(NOT_DEFAULT, None, env={})
    env, shown = config.to_env(), config.as_dict()
    options = {p.name: p for p in cli.commands["run"].params}
    for knob in KNOBS:
        assert getattr(config, knob.name) != getattr(resolve({}, None, env={}), knob.name), knob.name
        option = options[knob.name]  # the launch commands' option, under the knob's name
        assert option.opts + option.secondary_opts == knob.flag.split("/") and option.help == knob.help
        assert env[knob.env] == knob.text(getattr(config, knob.name)) and knob.name in shown
    again = SchedConfig.from_env(env)
    assert again == config and again.as_dict() == shown
    assert shown["credit_bytes"] == 3_000_000 and shown["sources"]["partition"] == "flag"


def test_bad_values_name_their_source(tmp_path):
    with pytest.raises(BsrunError, match="BSRUN_PARTITION must be a size such as 4MB, or tensor, got 'big'"):
        resolve({}, None, env={"BSRUN_PARTITION": "big"})
    file = tmp_path / "bad.toml"
    file.write_text("partiton = 3\n")
    with pytest.raises(BsrunError, match="unknown keys partiton"):
        resolve({}, file, env={})
    file.write_text("partition = [\n")
    with pytest.raises(BsrunError, match="not valid TOML"):
        resolve({}, file, env={})


def test_tuned_config_is_keyed_by_job(tmp_path):
    path = tmp_path / "tuned.json"
    sig = job_signature(["python", "train.py"], 2)
    assert sig != job_signature(["python", "train.py"], 4)
    path.write_text(json.dumps({"jobs": {sig: {"config": {"partition": "2MB", "credit": "3x"}}}}))
    assert load_tuned(sig, path) == {"partition": "2MB", "credit": "3x"}
    assert load_tuned("other", path) == {}


def test_a_corrupt_tuned_file_is_moved_aside_not_overwritten(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    path.write_text("{not json")
    assert load_tuned("any", path) == {}
    assert not path.exists()
    aside = list(tmp_path.glob("tuned.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == "{not json"
    assert "is corrupt; moved it to" in capsys.readouterr().err
