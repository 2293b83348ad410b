"""Wire errors of a remote store, translated once into the package's taxonomy: transient
(retried with backoff) or permanent (not retried; the message says what to fix), by S3 error
code, HTTP status or exception type."""

from __future__ import annotations

import asyncio

from ..errors import IntegrityError, PermanentTierError, TransientTierError
from . import s3_checksums

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "OperationAborted",
    "InternalServerError",
    "BadGateway",
    "GatewayTimeout",
    "500",
    "502",
    "503",
    "504",
    # A body that fails the CRC32C sent with it (a store that checks: s3_checksums) was
    # corrupted on the way, not stored: sending it again is the fix.
    "BadDigest",
}
PERMANENT_HINTS = {
    "AccessDenied": "check the credentials' permissions on this bucket/prefix",
    "InvalidAccessKeyId": "check the access key (AWS_ACCESS_KEY_ID or storage_options['key'])",
    "SignatureDoesNotMatch": "check the secret key and the endpoint's region",
    "NoSuchBucket": "create the bucket or fix the remote URL",
    "InvalidBucketName": "fix the bucket name in the remote URL",
    "ExpiredToken": "refresh the session token",
    "InvalidToken": "refresh the session token",
    "403": "the store refused the credentials (HTTP 403): check the access key, secret and "
    "their permissions on this bucket/prefix",
    "401": "the store wants credentials (HTTP 401): set storage_options['key'/'secret'] or "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY",
}
# botocore's own errors for credentials it cannot find or use: no retry makes them work.
_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "NoAuthTokenError",
}


def _caused_by(exc: BaseException | None, name: str) -> bool:
    for _ in range(5):
        if exc is None:
            return False
        if type(exc).__name__ == name:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def translate(exc: BaseException, op: str, where: str) -> BaseException:
    """Map a backend exception to our taxonomy; FileNotFound/FileExists pass through."""
    if (
        isinstance(exc, (FileNotFoundError, FileExistsError))
        and s3_checksums.client_error(exc) is None
    ):
        return exc
    if _caused_by(exc, "FlexibleChecksumError"):
        # botocore checked the body against the checksum the store recorded with it at
        # upload: the object is corrupt in the store, and reading it again will not help.
        return IntegrityError(
            f"{op} {where}: the stored object fails the checksum recorded at "
            f"its upload ({exc}); it is corrupt in the store"
        )
    ce = s3_checksums.client_error(exc)
    if ce is not None:
        err = ce.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(ce.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(f"{where}: not found")
        if code == "PreconditionFailed" or (status == 412):
            return FileExistsError(f"{where}: already exists")
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return TransientTierError(f"{op} {where}: {code or status} (transient, retrying)")
        hint = (
            PERMANENT_HINTS.get(code)
            or PERMANENT_HINTS.get(str(status))
            or ("see the error code in the S3 documentation")
        )
        return PermanentTierError(f"{op} {where} failed: {code} {err.get('Message', '')}; {hint}")
    if type(exc).__name__ in _CREDENTIAL_ERRORS:
        return PermanentTierError(
            f"{op} {where}: no usable credentials ({type(exc).__name__}: {exc}); set "
            "storage_options['key'] and ['secret'] (or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or a profile)"
        )
    if isinstance(exc, PermissionError):
        return PermanentTierError(f"{op} {where}: permission denied ({exc}); check credentials")
    if isinstance(exc, (FileNotFoundError, FileExistsError)):
        return exc
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError)):
        return TransientTierError(f"{op} {where}: {type(exc).__name__}: {exc}")
    name = type(exc).__module__ + "." + type(exc).__name__
    if name.startswith(("aiohttp.", "botocore.", "urllib3.")):
        return TransientTierError(f"{op} {where}: {type(exc).__name__}: {exc}")
    return exc
