"""docs/migrating-from-megatron.md lists every Megatron-LM flag mp accepts without effect
or refuses (mp_train.configuration.megatron_flags), so the page and the code cannot drift apart."""

from pathlib import Path

from mp_train.configuration.megatron_flags import IGNORED, REFUSED, RENAMED

DOC = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-megatron.md"


def test_every_flag_of_the_table_is_documented():
    text = DOC.read_text()
    missing = [f"--{dest.replace('_', '-')}" for dest in [*IGNORED, *REFUSED, *RENAMED]
               if f"`--{dest.replace('_', '-')}" not in text]  # fmt: skip
    assert not missing, missing
