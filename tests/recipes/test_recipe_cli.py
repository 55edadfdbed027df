"""Each recipe's command line as a new user reads it (`--help`): the whole docstring, a help and a
default for every flag, no abbreviations. Fast: nothing is started."""
import re

import pytest

from recipes import grpo_arithmetic, grpo_async, multiturn_tool

RECIPES = [grpo_arithmetic, grpo_async, multiturn_tool]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__.split(".")[-1])
def test_help_has_the_docstring_and_every_default(recipe, capsys):
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert recipe.__doc__.strip() in text  # whole, with its example command lines
    for block in re.split(r"\n(?=  --)", text.split("\noptions:\n", 1)[1])[1:]:  # one per flag
        flag = block.split()[0]
        if flag not in ("--batch-invariant", "--compare-sync"):  # switches: off unless given
            assert "(default: " in " ".join(block.split()), f"{flag} shows no default:\n{block}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__.split(".")[-1])
def test_abbreviations_are_refused(recipe, capsys):
    with pytest.raises(SystemExit):
        recipe.parse_args(["--step", "3"])
    assert "unrecognized arguments: --step" in capsys.readouterr().err
    assert recipe.parse_args(["--steps", "3"]).steps == 3
