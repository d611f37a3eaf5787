"""Token ids as a policy may send them: a JSON list, base64 of little-endian int32, or a numpy array.

:func:`token_array` and :func:`logprob_array` read the fields of a token record given to ``respond``
(``/respond``'s ``"tokens"``, ``Gateway.respond(tokens=...)``, or a
:class:`~ares_gateway.core.canonical.TokenRecord` built by a policy) into int32 / float64 arrays, or
raise :class:`~ares_gateway.core.errors.InvalidAnswerError` saying what is wrong: ids that are not
integers, negative or beyond int32, logprobs that are not one per output token. The ids stay arrays
from there on: a 157k-token prompt is 628 KB of int32, where a list of Python ints would be ~6 MB.

Base64 is the compact wire form: a 100k-token prompt is 533 KB of base64 instead of ~600 KB of
JSON digits that the gateway must parse one by one into Python ints.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import numpy.typing as npt

from ares_gateway.core.errors import InvalidAnswerError

_INT32_MAX = int(np.iinfo(np.int32).max)
_NO_LOGPROBS: npt.NDArray[np.float64] = np.zeros(0, dtype=np.float64)
_NO_LOGPROBS.flags.writeable = False


def token_array(value: Any, what: str) -> npt.NDArray[np.int32]:
    """``value`` (a list of ints, base64 of little-endian int32, or an integer numpy array) as int32.

    Raises :class:`InvalidAnswerError` for anything else, for negative ids and for ids beyond int32.
    """
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidAnswerError(f"{what}: not valid base64 (give a JSON list of ints or base64 of "
                                     "little-endian int32)") from None
        if len(raw) % 4:
            raise InvalidAnswerError(
                f"{what}: base64 decodes to {len(raw)} bytes, not a whole number of int32 ids")
        arr: npt.NDArray[Any] = np.frombuffer(raw, dtype="<i4").astype(np.int32, copy=False)
    elif isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise InvalidAnswerError(f"{what}: must be one-dimensional, got shape {value.shape}")
        if value.size and value.dtype.kind not in "iu":
            raise InvalidAnswerError(f"{what}: must be integers, got dtype {value.dtype}")
        if value.size and int(value.max()) > _INT32_MAX:
            raise InvalidAnswerError(f"{what}: id {int(value.max())} is beyond int32")
        # A copy: the gateway keeps these ids, and the caller may reuse its buffer.
        arr = value.astype(np.int32, copy=True)
    elif isinstance(value, list | tuple):
        # bool is an int subclass, but true is no token id.
        bad = next((v for v in value if type(v) is not int), None)
        if bad is not None and not isinstance(bad, np.integer):
            raise InvalidAnswerError(f"{what}: token ids must be integers, got {type(bad).__name__} {bad!r}")
        try:
            arr = np.asarray(value, dtype=np.int64) if value else np.zeros(0, dtype=np.int64)
        except OverflowError:
            raise InvalidAnswerError(f"{what}: an id is beyond int64") from None
        if arr.size and int(arr.max()) > _INT32_MAX:
            raise InvalidAnswerError(f"{what}: id {int(arr.max())} is beyond int32")
        arr = arr.astype(np.int32)
    else:
        raise InvalidAnswerError(
            f"{what}: give a JSON list of ints or base64 of little-endian int32, not {type(value).__name__}"
        )
    if arr.size and int(arr.min()) < 0:
        raise InvalidAnswerError(f"{what}: token ids must be >= 0, got {int(arr.min())}")
    return arr


def logprob_array(value: Any, n: int | None) -> npt.NDArray[np.float64]:
    """``value`` (a list of numbers, base64 of little-endian float32, or a numpy array) as float64,
    one per output token (``n``; ``None``: any count) or none.

    Raises :class:`InvalidAnswerError` for anything else, for a count other than ``n`` and for
    values that are not finite.
    """
    if value is None:
        return _NO_LOGPROBS
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidAnswerError("output_logprobs: not valid base64 of little-endian float32") from None
        if len(raw) % 4:
            raise InvalidAnswerError("output_logprobs: base64 does not decode to whole float32 values")
        arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif isinstance(value, np.ndarray | list | tuple):
        if (isinstance(value, list | tuple)
            and any(isinstance(v, bool) or not isinstance(v, int | float) for v in value)):
            raise InvalidAnswerError("output_logprobs: must be numbers")
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidAnswerError("output_logprobs: must be numbers") from None
        if arr.ndim != 1:
            raise InvalidAnswerError("output_logprobs: must be one-dimensional")
    else:
        raise InvalidAnswerError("output_logprobs: give a JSON list of numbers or base64 of float32")
    if n is not None and arr.size and arr.size != n:
        raise InvalidAnswerError(
            f"output_logprobs has {arr.size} entries but output_ids has {n}; give one logprob per output "
            "token or none"
        )
    if arr.size and not np.isfinite(arr).all():
        raise InvalidAnswerError("output_logprobs: must be finite numbers")
    return arr if arr.size else _NO_LOGPROBS


def encode_token_ids(ids: Any) -> str:
    """Token ids as base64 of little-endian int32 (the compact form :func:`token_array` reads)."""
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


__all__ = ["encode_token_ids", "logprob_array", "token_array"]
