"""What a path or URL names: the tensorstore kvstore spec of a local path, ``file://``,
``memory://``, ``s3://`` or ``gs://`` URL, checked before anything is written, with the store's
endpoint and credentials as messages name them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from jaxckpt._errors import CheckpointError
from jaxckpt._format.names import FILE_NAME_BYTES, LOCK_SUFFIX

GCS_HTTP_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"  # tensorstore's GCS endpoint, read at each open


def endpoint(spec: dict[str, Any]) -> str:
    """The server a kvstore spec talks to, for messages: an S3 spec's ``endpoint``; for GCS
    ``$TENSORSTORE_GCS_HTTP_URL`` (an emulator or proxy), else Google's.

    Example:
      >>> endpoint({"driver": "s3", "endpoint": "http://127.0.0.1:9000"})
      'http://127.0.0.1:9000'
    """
    if spec.get("endpoint"):
        return str(spec["endpoint"])
    if spec["driver"] == "gcs":
        return os.environ.get(GCS_HTTP_URL_ENV) or "https://storage.googleapis.com"
    return f"the {spec['driver']} service"


def credentials_hint(spec: dict[str, Any]) -> str:
    """Where the credentials of an object store's spec come from, for messages.

    Example:
      >>> credentials_hint({"driver": "gcs", "bucket": "b", "path": ""}).split(" or ")[0]
      'GOOGLE_APPLICATION_CREDENTIALS'
    """
    if spec["driver"] == "gcs":
        return (
            f"GOOGLE_APPLICATION_CREDENTIALS or the application default credentials, "
            f"{GCS_HTTP_URL_ENV} for an emulator"
        )
    return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible server"


def _path_error(url: str, what: str, fix: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint path {url!r} {what}, which tensorstore's file driver reads differently "
        f"from Python (its data would go elsewhere than its manifest). {fix}"
    )


def check_file_url(url: str, text: str) -> None:
    # tensorstore decodes a file:// URL (%XX escapes, no ?/# parts); jaxckpt takes it literally.
    bad = [c for c in "%?#" if c in text]
    if bad:
        raise _path_error(
            url,
            f"contains {bad[0]!r} in a file:// URL",
            "Pass the plain local path instead of a file:// URL.",
        )
    if text and not text.startswith("/"):
        raise CheckpointError(
            f"{url!r} is not an absolute file:// URL: write file:///ABSOLUTE/PATH or a plain path."
        )


def local_path(url: str, text: str) -> Path:
    """The absolute path, refusing what tensorstore's file driver would read differently."""
    for c, name in (("\\", "a backslash (tensorstore reads it as '/')"), ("\0", "a NUL byte")):
        if c in text:
            raise _path_error(url, f"contains {name}", "Rename it without that character.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _path_error(url, "is not valid UTF-8", "Rename it to a UTF-8 name.") from None
    path = Path(text).absolute()
    if ".." in path.parts:  # resolved as the kernel would (tensorstore refuses '..' outright)
        keep = path.name != ".."
        path = Path(os.path.realpath(path.parent if keep else path)) / (path.name if keep else "")
    for part in path.parts:
        if part.endswith(LOCK_SUFFIX):
            raise _path_error(
                url,
                f"has a part ending in {LOCK_SUFFIX!r} (reserved by tensorstore)",
                "Choose another name.",
            )
        if len(os.fsencode(part)) > FILE_NAME_BYTES:
            raise CheckpointError(
                f"Checkpoint path {url!r} has a part of {len(os.fsencode(part))} bytes; file "
                f"names are limited to {FILE_NAME_BYTES} bytes. Choose a shorter name."
            )
    return path


def kvstore_spec(url: str) -> dict[str, Any]:
    scheme, rest = url.split("://", 1)
    if scheme == "memory":
        rest = rest.strip("/")
        return {"driver": "memory", "path": rest + "/" if rest else ""}
    if scheme in ("gs", "s3"):
        bucket, _, prefix = rest.rstrip("/").partition("/")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}", bucket):
            raise CheckpointError(
                f"{url!r} names no valid bucket ({bucket!r}): write {scheme}://BUCKET/PREFIX with "
                f"a bucket name of 3 or more letters, digits, '.', '-' or '_'."
            )
        spec: dict[str, Any] = {
            "driver": "gcs" if scheme == "gs" else "s3",
            "bucket": bucket,
            "path": prefix.strip("/") + "/" if prefix else "",
        }
        if scheme == "s3":
            spec.update(s3_options())
        return spec
    raise CheckpointError(
        f"Unsupported path scheme {scheme!r} in {url!r}: use a local path, file://, memory://, "
        f"gs:// or s3://."
    )


def retries(driver: str, seconds: float) -> dict[str, Any]:
    """The store's retry policy: throttling (429, 503, S3's SlowDown) is slowness, not failure.

    Exponential backoff with jitter (tensorstore's: each retry waits ``initial_delay * 2**n``,
    at most ``max_delay``, plus up to a second of jitter). The first retry waits at least
    ``initial_delay`` = 1 s: the ``Retry-After`` GCS and S3 send when they throttle (tensorstore
    does not read the header; a longer one is covered by the backoff, which reaches the
    deadline's quarter after 3 retries). 12 retries span about 74 s at the default 30 s
    deadline: a store throttling that long still completes the request, and the deadline is
    counted from its last "slow down" (``jaxckpt._storage.throttle``). Bounded all the same:
    tensorstore's default (32 retries, up to 32 s apart) would go on retrying an operation
    against a dead server for a quarter of an hour after jaxckpt gave it up, holding one of
    the process's request slots all along. A failed chunk write or read is retried so before
    its save or restore fails.

    Example:
      >>> retries("s3", 30.0)["s3_request_retries"]
      {'max_retries': 12, 'initial_delay': '1s', 'max_delay': '7.5s'}
    """
    policy = {
        "max_retries": RETRIES,
        "initial_delay": f"{INITIAL_DELAY:g}s",
        "max_delay": f"{max(2 * INITIAL_DELAY, seconds / 4):g}s",
    }
    return {f"{driver}_request_retries": policy}


RETRIES = 12  # tensorstore's retries of one request (docs/object_storage.md, "Throttling")
INITIAL_DELAY = 1.0  # seconds before the first: the Retry-After of a throttling store


def s3_options() -> dict[str, Any]:
    """Endpoint, region and credentials for ``s3://`` from the standard AWS variables.

    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` select an S3-compatible server (MinIO,
    moto, ...; addressed path-style, ``ENDPOINT/BUCKET/KEY``); ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION`` the region (otherwise tensorstore asks the bucket). With
    ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` set, those keys (and
    ``AWS_SESSION_TOKEN``) are used; otherwise tensorstore's default chain (profile, instance
    metadata). ``TENSORSTORE_S3_USE_CONDITIONAL_WRITE=1`` (``0``) makes each conditional write
    one PUT with ``If-None-Match``/``If-Match`` (a HEAD, then a PUT), as tensorstore does on
    AWS's own endpoints by default; tensorstore 0.1.86 and before take it only in the spec.
    """
    env = os.environ
    opts: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint"] = endpoint.rstrip("/")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        opts["aws_region"] = region
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        opts["aws_credentials"] = {"type": "environment"}
    conditional = env.get("TENSORSTORE_S3_USE_CONDITIONAL_WRITE", "").strip().lower()
    if conditional in ("1", "true", "0", "false"):  # else: tensorstore's choice by endpoint
        opts["use_conditional_write"] = conditional in ("1", "true")
    return opts
