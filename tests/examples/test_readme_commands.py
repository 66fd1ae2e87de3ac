"""Every `kvmiss ...` command the README shows exists, with the flags it shows.

The README is what a new user copies from. Each command in its shell blocks (```sh, ```bash,
```console) is parsed -- never run -- by kvmiss's own argparse parser
(`kvmiss.enricher.cli.build_parser`): the subcommand must exist and every flag must be one of
its options, spelled out in full (argparse would accept an abbreviation; the README should
not rely on it). Inline `kvmiss ...` spans in the prose must name real subcommands and flags
too. `make` targets the README names must be targets of the Makefile, and every TOML block
must be a configuration `kvmiss serve` accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from kvmiss.enricher.cli import build_parser
from kvmiss.schemas.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"

SHELL_BLOCK = re.compile(r"^```(?:sh|bash|console|shell)[ \t]*\n(.*?)^```", re.M | re.S)
ANY_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)
TOML_BLOCK = re.compile(r"^```toml[ \t]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# `$(openssl rand -hex 16)` and the like: one word standing for its output.
SUBSTITUTION = re.compile(r"\$\((?:[^()]|\([^()]*\))*\)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
CONTROL = {"|", "||", "&&", ";", "&", "|&", ";;"}
REDIRECT = re.compile(r"^[0-9]*(>|>>|<|<<|>&|<&|&>)$")
# Placeholders a reader replaces: numbers where the option takes one, a word elsewhere.
NUMERIC_PLACEHOLDERS = {"N", "S", "SECONDS", "PORT"}
WRAPPERS = {"exec", "time", "sudo", "env"}
# The container image as `podman run` names it: kvmiss, localhost/kvmiss:0.2.0, ...
IMAGE = re.compile(r"^([\w.-]+(:[0-9]+)?/)*kvmiss(:[\w.-]+)?$")


# --- extraction ------------------------------------------------------------------------


def shell_lines(text: str) -> list[str]:
    """The command lines of every shell block: continuations joined, prompts and comments
    dropped."""
    lines = []
    for block in SHELL_BLOCK.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def segments(line: str) -> list[list[str]]:
    """One command line split at pipes and list operators into simple commands, each a list
    of words with redirections and command substitutions taken out."""
    line = SUBSTITUTION.sub("SUBSTITUTED", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out, current, skip_next = [], [], False
    for token in lexer:
        if skip_next:  # the target of a redirection
            skip_next = False
            continue
        if token in CONTROL:
            out.append(current)
            current = []
        elif REDIRECT.match(token):
            skip_next = True
            if token in (">&", "<&") and current and current[-1].isdigit():  # 2>&1: its descriptor
                current.pop()
        elif token.startswith(("(", ")")) and set(token) <= set("()"):
            continue
        else:
            current.append(token)
    out.append(current)
    return [words for words in out if words]


def kvmiss_argv(words: list[str]) -> list[str] | None:
    """The arguments after `kvmiss` in a simple command, or None when it runs something else.
    Leading VAR=value assignments and wrappers (`exec`, `env`, `nice -n 10`, ...) are skipped."""
    i = 0
    while i < len(words):
        word = words[i]
        if ASSIGNMENT.match(word) or word in WRAPPERS:
            i += 1
        elif word == "nice":
            i += 3 if i + 1 < len(words) and words[i + 1] == "-n" else 1
        else:
            break
    if i >= len(words):
        return None
    program = words[i]
    if program == "kvmiss" or program.endswith("/kvmiss"):
        return [placeholder(w) for w in words[i + 1:]]
    if program in ("podman", "docker") and words[i + 1:i + 2] == ["run"]:
        # The image's entrypoint is `kvmiss`: what follows the image are its arguments.
        for j in range(i + 2, len(words)):
            if IMAGE.match(words[j]) and not words[j - 1].startswith("-"):
                return [placeholder(w) for w in words[j + 1:]]
    return None


def placeholder(word: str) -> str:
    """A word a reader would replace, made into something the option's type accepts."""
    if re.fullmatch(r"<[^>]*>", word):
        return "placeholder"
    if word in NUMERIC_PLACEHOLDERS:
        return "1"
    return word


def shell_commands(text: str) -> list[tuple[str, list[str]]]:
    """(the line as written, argv after `kvmiss`) for each kvmiss command in the shell blocks."""
    found = []
    for line in shell_lines(text):
        for words in segments(line):
            argv = kvmiss_argv(words)
            if argv is not None:
                found.append((line, argv))
    return found


def prose(text: str) -> str:
    return ANY_BLOCK.sub("", text)


def inline_commands(text: str) -> list[str]:
    """Inline code spans of the prose that start with the `kvmiss` command (not `kvmiss.label`,
    not `kvmiss-demo-out/...`)."""
    return [span for span in INLINE.findall(prose(text))
            if re.match(r"kvmiss(\s|$)", span) and not re.match(r"kvmiss [\w-]+:", span)]  # not a message


def make_targets_named(text: str) -> set[str]:
    named = set()
    for line in shell_lines(text):
        for words in segments(line):
            if words[0] == "make":
                named.update(w for w in words[1:] if not w.startswith("-") and "=" not in w)
    for span in INLINE.findall(prose(text)):
        if m := re.fullmatch(r"make ([\w.-]+)", span.strip()):
            named.add(m[1])
    return named


def makefile_targets() -> set[str]:
    text = MAKEFILE.read_text()
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.M))


# --- checking against the parser --------------------------------------------------------


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve(argv: list[str]) -> tuple[argparse.ArgumentParser, str]:
    """The innermost parser the words name (`config example` -> its parser), and the path."""
    parser, path = build_parser(), "kvmiss"
    for word in argv:
        if word.startswith("-"):
            continue
        choices = subparsers_of(parser)
        if not choices:
            break
        if word not in choices:
            raise AssertionError(f"`{path} {word}`: no such command (commands: {', '.join(choices)})")
        parser, path = choices[word], f"{path} {word}"
    return parser, path


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def check_flags(argv: list[str]) -> None:
    """Every --flag is an option of the parser it reaches, in full. Options are looked up along
    the path (a top-level option such as --version before the subcommand)."""
    parser, path = build_parser(), "kvmiss"
    known = option_strings(parser)
    for word in argv:
        if word.startswith("-") and word != "-":
            flag = word.split("=", 1)[0]
            if flag not in known:
                raise AssertionError(f"`{path}` has no option {flag} (it has: {', '.join(sorted(known))})")
            continue
        choices = subparsers_of(parser)
        if choices:
            if word not in choices:
                raise AssertionError(f"`{path} {word}`: no such command (commands: {', '.join(choices)})")
            parser, path = choices[word], f"{path} {word}"
            known = option_strings(parser)


def check_parses(argv: list[str]) -> None:
    """argparse accepts the whole command line (values, required options, choices). Parsed
    only: nothing runs; --help and --version answer and exit 0, which counts as parsed."""
    check_flags(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise AssertionError(f"kvmiss {' '.join(argv)}: {err.getvalue().strip()}") from None


def check_inline(span: str) -> None:
    """`kvmiss serve --config FILE [--check]`, `kvmiss status [--url URL | --config FILE]`:
    the command path and every --flag named exist; placeholders and brackets are prose."""
    words = span.replace("[", " ").replace("]", " ").replace("|", " ").split()[1:]
    path = []
    for word in words:
        if word.startswith("-") or not re.fullmatch(r"[a-z][a-z-]*", word):
            break
        path.append(word)
    parser, where = build_parser(), "kvmiss"
    for word in path:
        choices = subparsers_of(parser)
        if not choices:
            break
        if word not in choices:
            raise AssertionError(f"`{span}`: `{where} {word}` is no command")
        parser, where = choices[word], f"{where} {word}"
    known = option_strings(parser) | option_strings(build_parser())
    for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", span):
        assert flag in known, f"`{span}`: `{where}` has no option {flag}"


# --- the tests --------------------------------------------------------------------------

README_TEXT = README.read_text()
SHELL_COMMANDS = shell_commands(README_TEXT)


def test_the_readme_shows_kvmiss_commands():
    assert len(SHELL_COMMANDS) >= 3, SHELL_COMMANDS
    shown = {tuple(argv[:1]) for _, argv in SHELL_COMMANDS}
    assert {("serve",), ("config",), ("status",), ("--version",)} <= shown, shown


@pytest.mark.parametrize("line, argv", SHELL_COMMANDS, ids=[" ".join(a)[:60] for _, a in SHELL_COMMANDS])
def test_each_shell_command_parses(line, argv):
    check_parses(argv)


INLINE_COMMANDS = inline_commands(README_TEXT)


@pytest.mark.parametrize("span", INLINE_COMMANDS)
def test_each_inline_command_names_real_commands_and_flags(span):
    check_inline(span)


def test_make_targets_named_in_the_readme_exist():
    named = make_targets_named(README_TEXT)
    assert {"demo", "test"} <= named, named
    assert named <= makefile_targets(), named - makefile_targets()


def test_every_toml_block_is_a_config_serve_accepts():
    blocks = TOML_BLOCK.findall(README_TEXT)
    assert blocks, "the README shows no configuration"
    for block in blocks:
        config = parse_config(block, source="README.md")
        assert config.privacy.digest_key_env == "KVMISS_DIGEST_KEY"
        assert config.export.endpoint or config.export.file or config.export.discard


# --- the checker catches what it is for ---------------------------------------------------


def test_extraction_handles_pipes_assignments_continuations_and_redirections():
    text = (
        "```sh\n"
        "kvmiss config example | KVMISS_DIGEST_KEY=$(openssl rand -hex 16) kvmiss serve --check --config -\n"
        "kvmiss collect --config kvmiss.toml --record events.rec &   # beside serve\n"
        "nice -n 10 .venv/bin/kvmiss whatif --events e.rec \\\n"
        "    --requests r.jsonl --pool-blocks N\n"
        "kvmiss config example single > kvmiss.toml 2>&1\n"
        "podman run -e K=v -p 1:1 -v ./f.toml:/etc/kvmiss/f.toml:ro localhost/kvmiss:0.2.0 status --url u\n"
        "pip install . && make demo\n"
        "```\n"
        "```console\n$ kvmiss status --config kvmiss.toml\n```\n"
    )
    assert [argv for _, argv in shell_commands(text)] == [
        ["config", "example"],
        ["serve", "--check", "--config", "-"],
        ["collect", "--config", "kvmiss.toml", "--record", "events.rec"],
        ["whatif", "--events", "e.rec", "--requests", "r.jsonl", "--pool-blocks", "1"],
        ["config", "example", "single"],
        ["status", "--url", "u"],
        ["status", "--config", "kvmiss.toml"],
    ]
    for _, argv in shell_commands(text):
        check_parses(argv)
    assert make_targets_named(text) == {"demo"}


@pytest.mark.parametrize("argv, why", [
    (["serve", "--config", "k.toml", "--no-such-flag"], "no option --no-such-flag"),
    (["serve", "--conf", "k.toml"], "no option --conf"),  # an abbreviation argparse would take
    (["sevre", "--config", "k.toml"], "no such command"),
    (["config", "sample"], "no such command"),
    (["status", "--url", "u", "--config", "k"], "not allowed with"),  # mutually exclusive
    (["serve"], "required"),
])
def test_a_wrong_command_fails(argv, why):
    with pytest.raises(AssertionError, match=why):
        check_parses(argv)


@pytest.mark.parametrize("span", ["kvmiss sevre --config FILE", "kvmiss status [--uri URL]",
                                  "kvmiss config exampel"])
def test_a_wrong_inline_command_fails(span):
    with pytest.raises(AssertionError):
        check_inline(span)


def test_a_make_target_the_makefile_lacks_is_found():
    assert "install" in make_targets_named("```sh\nmake install\n```\n")
    assert "install" not in makefile_targets()
