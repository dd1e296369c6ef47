"""Scrub secrets from anything mainspring records (DESIGN §3).

Events, spans, reports, Temporal failures and log lines are read by more people, and kept
longer, than the credentials a worker holds. Everything written there passes through
`redact` (text) or `redact_value` (JSON-like payloads). What counts as a secret:

- the values of this process's secret-named environment variables (`is_secret_name`,
  ≥ 8 characters): a secret we know of is scrubbed wherever it appears;
- URL userinfo: `scheme://user:pass@host` → `scheme://***@host`;
- the value after a secret-named key: `key=value`, `"key": "value"`, `key: value`,
  `--key value`, `Authorization: Bearer …` (numbers and booleans are kept: they are
  counts such as `flops_per_token=…`, never credentials);
- well-known token shapes: AWS access key ids (and a 40-character secret right after one),
  JWTs, GitHub / Hugging Face / OpenAI / Slack / GitLab / Google API tokens.

Pure functions over strings; the only input besides the text is `os.environ`. Precision
matters as much as recall: a checkpoint URI, a sha256 digest, a run id or a step count
must come out unchanged, or the record stops being evidence.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
MIN_ENV_SECRET = 8  # shorter values ("1", "true", "us-east-1") would mask ordinary text

# A name is secret when its last word is one of these (HF_TOKEN, X-Amz-Signature) ...
_SECRET_LAST = frozenset({"token", "auth", "oauth", "authorization", "session", "pass",
                          "cookie", "signature", "sig", "bearer"})
# ... or any word is one of these (AWS_SECRET_ACCESS_KEY, X-Amz-Credential) ...
_SECRET_ANY = frozenset({"secret", "secrets", "password", "passwd", "passphrase",
                         "credential", "credentials", "apikey", "accesskey", "privatekey"})
# ... or it holds one of these word pairs (WANDB_API_KEY, accessKeyId).
_SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"),
                           ("secret", "key"), ("client", "secret")})
# A name that ends like this points at a secret (a file, a socket) or describes one; its
# value is not itself secret (AWS_SHARED_CREDENTIALS_FILE, SSH_AUTH_SOCK, AUTH_MODE).
_NOT_SECRET_LAST = frozenset({"file", "path", "dir", "sock", "socket", "url", "uri",
                              "endpoint", "host", "port", "type", "mode", "name", "ttl",
                              "expiry", "expires", "expiration", "enabled", "length"})
_WORD_ENDINGS = ("token", "secret", "password", "passwd", "apikey")  # "authtoken", "ghtoken"

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SPLIT = re.compile(r"[^a-z0-9]+")


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """True for a variable / key / header / flag name that holds a credential."""
    words = [w for w in _SPLIT.split(_CAMEL.sub("_", name).lower()) if w]
    if not words or words[-1] in _NOT_SECRET_LAST:
        return False
    last = words[-1]
    if last in _SECRET_LAST or last.endswith(_WORD_ENDINGS):
        return True
    return any(w in _SECRET_ANY for w in words) or any(p in _SECRET_PAIRS
                                                       for p in itertools.pairwise(words))


def env_secrets(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Values of the secret-named variables, longest first (so no prefix masks a longer one).

    Not an `…_ID` (AWS_ACCESS_KEY_ID): an id names a credential without granting anything,
    and a self-hosted store's id is often a plain word ("mainspring", "minioadmin") that,
    masked verbatim, would also mask the bucket or path of the same name in every record."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if len(v) >= MIN_ENV_SECRET and is_secret_name(k)
              and not k.upper().endswith("_ID")}
    return tuple(sorted(values, key=lambda v: (-len(v), v)))


def secret_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secret-named variables of `environ` (default: os.environ), as `env_secrets` takes
    them: passed as `environ`, it scrubs the same. Reading os.environ costs ~40 µs; a caller
    that scrubs thousands of strings (a run's event log) takes it once, not once a string."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if is_secret_name(k)}


@functools.lru_cache(maxsize=8)
def _literal_pattern(values: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(map(re.escape, values))) if values else None


_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s/@?#'\"<>]+@")
_AWS_KEY_ID = r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA)[0-9A-Z]{16}\b"
_TOKENS = re.compile("|".join((
    # an access key id, and the 40-character secret that often follows it on the same line
    _AWS_KEY_ID + r"(?:[\s:=,;'\"]{1,4}[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=]))?",
    r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*",  # JWT: header.payload.sig
    # Prefixed tokens. The body must hold an upper-case letter: real ones are random mixed
    # case, while run ids, paths and cache names that share a prefix are lower case.
    r"\b(?:gh[pousr]_|github_pat_)(?=[A-Za-z0-9_]*[A-Z])[A-Za-z0-9_]{20,}",
    r"\bhf_(?=[A-Za-z0-9]*[A-Z])[A-Za-z0-9]{20,}",
    r"\bsk-(?:proj-|ant-)?(?=[A-Za-z0-9_-]*[A-Z])[A-Za-z0-9_-]{20,}",
    r"\bglpat-[A-Za-z0-9_-]{20,}",
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
    r"\bAIza[0-9A-Za-z_-]{35}\b",
)))
_BEARER = re.compile(r"\b(?P<scheme>Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
# key <sep> value: `k=v`, `k: v`, `"k": "v"`, `'k'='v'`, `?k=v&`; a quoted value may hold spaces.
_KEY_VALUE = re.compile(
    r"""(?<![\w.])(?P<key>[A-Za-z][\w.-]*)(?P<kq>["']?)(?P<sep>[ \t]*[=:][ \t]*)(?!//)"""
    r"""(?:"(?P<dq>(?:[^"\\]|\\.)*)"|'(?P<sq>[^']*)'"""
    r"""|(?P<bare>(?:(?:Bearer|Basic|Token)[ \t]+)?[^\s"'&,;}\])<>]+))""", re.IGNORECASE)
_FLAG = re.compile(r"(?<![\w-])--(?P<key>[A-Za-z][\w-]*)(?P<sep>[ \t]+)(?P<val>[^\s-]\S*)")
_PLAIN = re.compile(r"(?:[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?|true|false|none|null|nan|inf)",
                    re.IGNORECASE)


def _harmless(value: str) -> bool:
    """Values that cannot be credentials: numbers, booleans, empties, masks."""
    return not value or value == MASK or bool(_PLAIN.fullmatch(value))


def _mask_key_value(m: re.Match[str]) -> str:
    head = m[0][:m.end("sep") - m.start()]
    if not is_secret_name(m["key"]):
        # the value may itself hold `key=value` ("leaked: password=…"): a match has
        # consumed it, so look inside it again
        return head + _KEY_VALUE.sub(_mask_key_value, m[0][len(head):])
    if m["dq"] is not None:
        return m[0] if _harmless(m["dq"]) else f'{head}"{MASK}"'
    if m["sq"] is not None:
        return m[0] if _harmless(m["sq"]) else f"{head}'{MASK}'"
    bare = m["bare"]
    if _harmless(bare):
        return m[0]
    scheme = bare.split()[0] + " " if len(bare.split()) > 1 else ""
    return f"{head}{scheme}{MASK}"


def _mask_flag(m: re.Match[str]) -> str:
    if not is_secret_name(m["key"]) or _harmless(m["val"]):
        return m[0]
    return f"--{m['key']}{m['sep']}{MASK}"


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret it holds replaced by `***` (see the module docstring)."""
    if not text:
        return text
    literal = _literal_pattern(env_secrets(environ))
    if literal is not None:
        text = literal.sub(MASK, text)
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _TOKENS.sub(MASK, text)
    text = _BEARER.sub(lambda m: f"{m['scheme']} {MASK}", text)
    text = _FLAG.sub(_mask_flag, text)
    return _KEY_VALUE.sub(_mask_key_value, text)


def redact_value(obj: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A JSON-like value (dicts, lists, tuples, strings) with its secrets scrubbed; a string
    under a secret-named key is masked whole. Other leaves are returned as they are."""
    if obj is None or type(obj) in (int, float, bool):  # most leaves: no ABC check for them
        return obj
    if environ is None and isinstance(obj, (Mapping, list, tuple)):
        environ = secret_environ()  # once for the whole value, not once per string in it
    if isinstance(obj, str):
        return redact(obj, environ)
    if isinstance(obj, Mapping):
        return {k: (MASK if isinstance(k, str) and is_secret_name(k) and isinstance(v, str)
                    and not _harmless(v) else redact_value(v, environ))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_value(v, environ) for v in obj]
    if isinstance(obj, tuple):
        return tuple(redact_value(v, environ) for v in obj)
    return obj
