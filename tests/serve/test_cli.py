"""`jaxengine serve`'s flags, without starting a server: engine arguments by their kebab-case
names over a --config file's engine: section; unknown flags refused by name."""

import argparse

import pytest

from jaxengine import cli
from jaxengine.run_config import ConfigError
from jaxengine.serve.cli import add_parser, engine_arguments


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_engine_flags_over_the_config_file(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: default\nengine: {max_num_seqs: 4, max_model_len: 256, block_size: 32}\n")
    args = parse(
        "--config",
        str(cfg),
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
        "--prefix-cache-retention-interval",
        "none",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
    )
    model, engine = engine_arguments(args)
    assert model == "default"
    assert engine == {
        "max_num_seqs": 8,
        "max_model_len": 256,
        "block_size": 32,
        "enable_prefix_caching": False,
        "prefix_cache_retention_interval": None,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    }


def test_flags_not_given_leave_the_engine_defaults():
    model, engine = engine_arguments(parse("some/dir"))
    assert model == "some/dir" and engine == {}


def test_unknown_flag_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "default", "--max-num-sequences", "4"])
    assert exit_info.value.code == 2
    assert "--max-num-sequences" in capsys.readouterr().err


def test_unknown_engine_key_in_the_config_is_refused(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("engine: {max_num_sequences: 4}\n")
    with pytest.raises(ConfigError, match="max_num_sequences"):
        engine_arguments(parse("default", "--config", str(cfg)))
