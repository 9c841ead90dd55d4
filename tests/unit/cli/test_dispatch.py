"""``meshtrain.cli`` parses and dispatches only: every subcommand has a body in
:mod:`meshtrain.commands`, and each body resolves to a callable."""

from __future__ import annotations

import argparse

import pytest

from meshtrain.cli import COMMANDS, build_parser, command_body


def _subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def test_every_subcommand_has_a_body_and_no_body_lacks_a_subcommand():
    assert _subcommands() == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_body_lives_in_commands_and_is_callable(name):
    assert COMMANDS[name].startswith("meshtrain.commands.")
    assert callable(command_body(name))
