"""Every subcommand's --help names what it reads, in one schema line, and gives one example;
an empty input is said to be empty."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmiss.enricher.cli import SUBCOMMANDS, build_parser


def help_text(name: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    return sub.format_help()


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_help_names_its_input_and_shows_an_example(name):
    text = help_text(name)
    assert "\ninput:" in text and "\nexample:" in text
    example = text.split("\nexample:", 1)[1]
    assert f"kvmiss {name}" in example


def run_cli(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", ["hash", "decode"])
@pytest.mark.parametrize("stdin", ["", "\n  \n"])
def test_an_empty_stdin_is_said_to_be_empty(command, stdin):
    proc = run_cli([command], stdin)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "the input is empty" in proc.stderr and f"kvmiss {command} --help" in proc.stderr


@pytest.mark.parametrize("command", ["hash", "decode"])
def test_the_help_example_runs_as_shown(command):
    example = help_text(command).split("\nexample:", 1)[1].strip()
    stdin = example.split("echo '", 1)[1].split("' |", 1)[0]
    proc = run_cli([command], stdin)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("{")
