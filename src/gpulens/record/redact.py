"""Secrets out of the run record: tokens, passwords and keys on command lines and in environments.

A run record (and the MLflow run made from it) keeps the command that ran and the environment it
ran in. What looks like a secret is replaced by ``REDACTED`` where it is captured, and the rest of
the command stays readable:

- options named like a secret, ``--token=abc``, ``--password abc``, ``--api-key abc``,
  ``--hf_token abc``, ``--client-secret abc`` (but not ``--max-tokens``, ``--tokenizer`` or
  ``--token-file``: a count, a name or a path is not the secret itself);
- assignments and environment variables named like one: ``HF_TOKEN=...``, ``WANDB_API_KEY=...``,
  ``AWS_SECRET_ACCESS_KEY=...``, ``PGPASSWORD=...`` (names ending in ``_KEY``, ``_TOKEN``,
  ``_SECRET``, or containing ``PASSWORD``, ``PASSWD``, ``SECRET``, ``TOKEN`` or ``CREDENTIAL``);
- a password in a URL, ``https://user:pass@host`` -> ``https://user:REDACTED@host``, and
  secret-named query parameters, ``?access_token=...``.

:func:`redact` walks any JSON-like value; :class:`gpulens.record.writer.RunWriter` applies it to
the requested and effective config and the environment it writes.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "REDACTED"

_SECRET_WORDS = ("token", "password", "passwd", "secret", "apikey", "credential", "credentials")
_KEY_QUALIFIERS = ("api", "access", "secret", "private", "auth", "client", "license", "encryption")
_NOT_THE_SECRET = ("file", "path", "dir", "env", "var", "name", "id", "type", "url", "count")
_URL_CREDENTIALS = re.compile(
    r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/\s:@]*):[^/\s@]+@"
)
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")
_VALUE = r"(?:'[^']*'|\"[^\"]*\"|[^\s'\"]+)"
_OPTION_IN_TEXT = re.compile(
    rf"(?P<opt>--?[A-Za-z][A-Za-z0-9_.-]*)(?P<sep>=|\s+)(?P<value>{_VALUE})"
)
_ASSIGN_IN_TEXT = re.compile(rf"(?<![\w-])(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>{_VALUE})")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _parts(name: str) -> list[str]:
    return [p for p in re.split(r"[-_.]+", _CAMEL.sub("_", name).lower()) if p]


def is_secret_name(name: str) -> bool:
    """Whether an option, variable or key called ``name`` holds a secret (see the module)."""
    parts = _parts(name.lstrip("-"))
    if not parts or parts[-1] in _NOT_THE_SECRET:
        return False
    if parts[-1] == "key":
        # HF_KEY=..., WANDB_API_KEY=...: a variable ending in _KEY; an option only when
        # qualified (--api-key), as --key alone is often a sort key or a file.
        return len(parts) > 1 and (name.isupper() or parts[-2] in _KEY_QUALIFIERS)
    return any(p.endswith(w) for p in parts for w in _SECRET_WORDS)


def redact_url(text: str) -> str:
    """Passwords in URLs and secret-named query parameters."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    if "?" in text:
        text = _QUERY_PARAM.sub(
            lambda m: (
                f"{m['sep']}{m['name']}={REDACTED}"
                if is_secret_name(m["name"]) and m["value"]
                else m.group(0)
            ),
            text,
        )
    return text


def _looks_like_option(arg: str) -> bool:
    return arg.startswith("-") and arg.lstrip("-")[:1].isalpha()


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with its secrets replaced, argument by argument."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            hide_next = False
            if not _looks_like_option(arg):
                out.append(REDACTED)
                continue
        if _looks_like_option(arg):
            name, eq, value = arg.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{name}={REDACTED}" if value else arg)
                else:
                    out.append(arg)
                    hide_next = True
                continue
            out.append(f"{name}={redact_url(value)}" if eq else arg)
            continue
        name, eq, value = arg.partition("=")
        if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and is_secret_name(name):
            out.append(f"{name}={REDACTED}" if value else arg)
            continue
        out.append(redact_url(arg))
    return out


def redact_text(text: str) -> str:
    """The same for a command line given as one string; everything else is left as it was."""
    if not text:
        return text

    def option(m: re.Match) -> str:
        if not is_secret_name(m["opt"]) or m["value"].startswith("-"):
            return m.group(0)
        return f"{m['opt']}{m['sep']}{REDACTED}"

    def assign(m: re.Match) -> str:
        return f"{m['name']}={REDACTED}" if is_secret_name(m["name"]) else m.group(0)

    text = _OPTION_IN_TEXT.sub(option, text)
    text = _ASSIGN_IN_TEXT.sub(assign, text)
    return redact_url(text)


def redact_env(env: dict[str, Any]) -> dict[str, Any]:
    """An environment with the values of secret-named variables replaced."""
    return {
        k: REDACTED if is_secret_name(str(k)) and v not in (None, "") else redact(v)
        for k, v in env.items()
    }


def redact(value: Any) -> Any:
    """Any JSON-like value with its secrets replaced: secret-named keys lose their (string or
    number) values, strings are redacted as command lines, lists of strings as argv."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if (
                isinstance(k, str)
                and is_secret_name(k)
                and isinstance(v, (str, int, float))
                and not isinstance(v, bool)
                and v != ""
            ):
                out[k] = REDACTED
            else:
                out[k] = redact(v)
        return out
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return redact_argv(list(value))
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
