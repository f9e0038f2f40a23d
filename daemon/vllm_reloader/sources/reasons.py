"""obstore's errors as one stable line each, and the store's own words for `status`.

obstore's message is a first line with timings (`in 245.87ms, after 2 retries`) that often
says only "error sending request", then a debug dump holding the cause. The line logged must
be the same at every retry (it is logged once per reason) and name the condition: the store's
code, refused, DNS, TLS, reset, no credentials. The cause is read from the dump's structure
only, with URLs and paths removed first: a bucket or key named `certificate` or `TimedOut` is
not a cause.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_CODE = re.compile(r"<Code>([^<]+)</Code>")
_MESSAGE = re.compile(r"<Message>([^<\n]*)")
_STATUS = re.compile(r"status code: (\d{3} [^:]*)")
_TIMING = re.compile(
    r" in [\d.]+(?:ns|µs|us|ms|s)\b|, after \d+ retries, max_retries: \d+, retry_timeout: \S+"
)
_REQUEST = re.compile(r"\b(?:GET|PUT|HEAD|POST|DELETE) (\w+://[^/\s?]+)")
_NAMES = re.compile(r"\w+://[^\s,)]*|path: \"(?:[^\"\\]|\\.)*\"|Path \"[^\"]*\"")
_CAUSE = re.compile(r'(?:message|error): "([^"]+)"')
METADATA_HOSTS = ("169.254.169.254", "metadata.google.internal", "[fd00:ec2::254]")
"""Where the stores ask for a token when no credentials are set (instance metadata)."""

_TRANSPORT = (  # a marker in the dump's structure → what happened, with {host}
    ('"dns error"', "DNS lookup of {host} failed"),
    ("ConnectionRefused", "connection refused by {host}"),
    ("ConnectionReset", "connection reset by {host}"),
    ("IncompleteMessage", "{host} closed the connection mid-answer"),
    ("TimedOut", "no answer from {host} in time"),
    ("InvalidCertificate", "TLS: the certificate of {host} is not trusted"),
    ("invalid peer certificate", "TLS: the certificate of {host} is not trusted"),
    ("InvalidContentType", "TLS handshake with {host} failed (is it a plain http:// endpoint?)"),
    ("CorruptMessage", "TLS handshake with {host} failed (is it a plain http:// endpoint?)"),
)


def first_line(text: str) -> str:
    return _TIMING.sub("", text.splitlines()[0]) if text else ""


def one_line(exc: BaseException, *, proxy: str | None = None, env_prefix: str = "") -> str:
    """The condition, the same at every retry. `proxy`: the proxy the client goes through,
    which a connection failure is then about."""
    text = str(exc)
    first = first_line(text) or type(exc).__name__
    host = found.group(1) if (found := _REQUEST.search(first)) else "the store"
    status = _STATUS.search(first)
    if "token request" in first or any(f"://{h}" in host for h in METADATA_HOSTS):
        why = status.group(1).strip() if status else _transport(text, host) or "no answer"
        return (
            f"no credentials: the token request to {host} failed ({why}); set the store's"
            " credentials (docs/object-storage.md, Per store)"
        )
    if "BadScheme" in _structure(text):
        return f"http:// is not allowed for {host}: set {env_prefix}ALLOW_HTTP=true, or endpoint_url"
    if not status and (failure := _transport(text, f"the proxy {proxy}" if proxy else host)):
        return failure
    code = _CODE.search(text)
    if code and not code.group(1).isdigit():
        return code.group(1) + (f" ({status.group(1).strip()})" if status else "")
    if status:
        return status.group(1).strip()
    return first[:300]


def detail(exc: BaseException) -> str:
    """The store's own first line and its innermost cause or message, for `status`."""
    text = str(exc)
    first = first_line(text) or type(exc).__name__
    first = first.split(": <?xml", 1)[0].split(": <errorResponse>", 1)[0][:500]
    if code := _CODE.search(text):
        message = _MESSAGE.search(text)
        return f"{first}: {code.group(1)}" + (f": {message.group(1).strip()}" if message else "")
    causes = _CAUSE.findall(text.partition("Debug source:")[2])
    return first + (f"; cause: {causes[-1]}" if causes else "")


def without_password(url: str) -> str:
    """A proxy URL fit for a log line: `user:password@` dropped."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))


def _structure(text: str) -> str:
    """The debug dump with every URL and path removed: only the error's own structure."""
    return _NAMES.sub("", text.partition("Debug source:")[2])


def _transport(text: str, host: str) -> str | None:
    structure = _structure(text)
    return next((said.format(host=host) for marker, said in _TRANSPORT if marker in structure), None)
