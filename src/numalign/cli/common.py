"""What every command shares: the help formatter, subparsers, checks of a model folder,
of dtypes and of the options a command hands on to the suites."""

from __future__ import annotations

import argparse
from typing import Any


def check_dtypes(text: str | None, option: str, command: str) -> None:
    """A comma list of dtypes, checked before any work: an unknown name (``bf16``) exits
    with the option's message, never after a capture has run."""
    from numalign.session.option_values import parse_dtypes

    if text:
        try:
            parse_dtypes(text)
        except ValueError as exc:
            raise SystemExit(f"numalign {command}: {option} {text!r}: {exc}") from None


def check_model(model_dir: str, command: str) -> None:
    from numalign.golden.model_folder import ModelFolderError, check_model_dir

    try:
        check_model_dir(model_dir)
    except ModelFolderError as exc:
        raise SystemExit(f"numalign {command}: {exc}") from None


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that names every option's default: argparse's "(default: X)" where the help
    text does not already say it in words (None and False defaults: the help says what
    happens without the option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def subparser(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, formatter_class=Formatter, allow_abbrev=False, **kwargs
    )
    return parser


def check_run_options(args: argparse.Namespace, command: str) -> None:
    """The options ``run`` and ``nightly`` hand to the suites (those ``options.add_to`` gave
    the command), validated before any work as the plugin validates them
    (``Settings.from_options``)."""
    from numalign.session.options import command_values
    from numalign.session.settings import Settings

    try:
        Settings.from_options(command_values(args))
    except ValueError as exc:
        raise SystemExit(f"numalign {command}: {exc}") from None
