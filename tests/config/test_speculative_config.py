"""speculative_config: vLLM's dict keyword, the deploy file's `speculative:` section and --speculative-config, all
checked by SpeculativeOptions with errors that name the field."""

from __future__ import annotations

import pytest

from mlaserve.config.deploy import DeployConfigError, load_deploy_config
from mlaserve.config.deploy_overrides import overrides_from_flags
from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.speculative import SpeculativeOptions


def test_defaults_and_vllm_lookup_resolution() -> None:
    assert not EngineConfig().speculative.enabled
    spec = EngineConfig.from_kwargs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    ).speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 5, 5)
    only_max = SpeculativeOptions(method="ngram", num_speculative_tokens=1, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeOptions(method="ngram", num_speculative_tokens=1, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_round_trip_through_flat_options() -> None:
    config = EngineConfig.from_kwargs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert EngineConfig.from_kwargs(**config.as_kwargs()) == config
    assert "speculative_config" not in EngineConfig().as_kwargs()


@pytest.mark.parametrize(
    "value,field",
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
        ({"method": "mtp"}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup_min"),
    ],
)  # fmt: skip
def test_bad_values_name_the_field(value: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"speculative_config\['{field}'\]"):
        EngineConfig.from_kwargs(speculative_config=value)


def test_mtp_and_its_vllm_alias() -> None:
    config = EngineConfig.from_kwargs(
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2}
    )
    assert config.speculative.method == "mtp"
    assert config.speculative.as_dict() == {"method": "mtp", "num_speculative_tokens": 2}


def test_unknown_keys_and_types() -> None:
    with pytest.raises(TypeError, match="unknown speculative_config key"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 1, "k": 2})
    with pytest.raises(TypeError, match="must be a dict"):
        EngineConfig.from_kwargs(speculative_config="ngram")


def test_deploy_section_and_cli_flag(tmp_path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("speculative:\n  method: ngram\n  num_speculative_tokens: 2\n")
    config = load_deploy_config(path, check_model_files=False, check_ports=False)
    assert config.engine_config().speculative.num_speculative_tokens == 2
    assert config.engine_options()["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    flags = {"speculative_config": {"num_speculative_tokens": 4}}
    config = load_deploy_config(path, overrides_from_flags(flags), check_model_files=False, check_ports=False)
    assert config.engine_config().speculative.num_speculative_tokens == 4
    path.write_text("speculative:\n  method: ngram\n")
    with pytest.raises(DeployConfigError, match="speculative.num_speculative_tokens"):
        load_deploy_config(path, check_model_files=False, check_ports=False)
    assert "speculative_config" not in load_deploy_config(None, check_ports=False).engine_options()


def test_cli_parses_json() -> None:
    import argparse

    from mlaserve.server.cli_args import add_serve_args, settings_and_options_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    _, options = settings_and_options_from_args(args)
    assert EngineConfig.from_kwargs(**options).speculative.num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1]"])
