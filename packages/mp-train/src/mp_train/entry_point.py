"""What an entry point (apps/gpt's pretrain_gpt.py) calls to read its configuration.

    try:
        config = load_config(argv)
        ...
    except ConfigError as error:
        return report(error)  # one line from rank 0; 2

load_config parses the command line and the --config file, validates the
result against the world size the launcher set and checks the files the run
will read, all before torch.distributed starts, so that every rank finds the
same mistake at the same point (errors.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mp_train.configuration.arguments import parse_config
from mp_train.configuration.config import RunConfig, validate
from mp_train.configuration.run_checks import check_backend, check_input_files, check_tokenizer
from mp_train.configuration.yaml_config import field_owners
from mp_train.errors import config_errors

__all__ = ["load_config"]


def load_config(argv: list[str] | None = None, *, environ: Mapping[str, str] = os.environ,
                prog: str = "pretrain_gpt.py") -> RunConfig:  # fmt: skip
    """An entry point's RunConfig: parse_config, then validate against the world size the
    launcher set (WORLD_SIZE; 1 without one), then the data prefixes and tokenizer files.
    Any mistake raises a ConfigError naming flags (errors.py)."""
    with config_errors(frozenset(field_owners())):
        config = parse_config(argv, environ=environ, prog=prog, exit_on_error=False)
        validate(config, int(environ.get("WORLD_SIZE", 1)))
    check_tokenizer(config)
    check_input_files(config)
    check_backend(config)
    return config
