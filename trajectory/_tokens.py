"""Compact token storage and fast token comparison.

Token ids live in 1-D ``numpy.int32`` arrays (4 bytes per token) instead of lists of
Python ints (about 36 bytes per token), and logprobs in ``float32`` arrays.  Every bulk
operation here runs inside numpy; nothing loops over tokens in Python.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

TokenArray: TypeAlias = npt.NDArray[np.int32]
LogprobArray: TypeAlias = npt.NDArray[np.float32]
#: What callers may pass as token ids: a sequence of ints, a numpy integer array or an ``array.array``.
TokenIdsLike: TypeAlias = Sequence[int] | npt.NDArray[Any] | array

_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)

EMPTY_TOKENS: TokenArray = np.zeros(0, dtype=np.int32)
EMPTY_TOKENS.flags.writeable = False


def as_token_array(ids: Any, *, what: str = "token ids") -> TokenArray:
    """Return ``ids`` as a 1-D int32 array.

    An int32 array is returned as is (a view, no copy): callers that keep tokens beyond
    the current call copy exactly the part they keep.  Other integer arrays are range
    checked and cast in C.  Lists go through ``array('i', ...)``, whose C loop rejects
    floats and out-of-range values instead of truncating them silently.
    """
    if isinstance(ids, np.ndarray):
        arr: np.ndarray = ids
    elif isinstance(ids, array):
        if ids.typecode in "fduw":
            raise ValueError(f"{what} must be integers, got array('{ids.typecode}')")
        arr = np.frombuffer(ids, dtype=np.dtype(ids.typecode)) if len(ids) else EMPTY_TOKENS
    else:
        try:
            packed = array("i", ids)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"{what} must be a sequence of int32 token ids: {exc}") from exc
        return np.frombuffer(packed, dtype=np.int32) if len(packed) else EMPTY_TOKENS
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.int32:
        return arr
    if arr.size == 0:
        return EMPTY_TOKENS
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must have an integer dtype, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < _INT32_MIN or hi > _INT32_MAX:
        raise ValueError(f"{what} out of int32 range: [{lo}, {hi}]")
    return arr.astype(np.int32)


def as_logprob_array(values: Any, n_tokens: int) -> LogprobArray | None:
    """Return logprobs as a float32 array of length ``n_tokens``, or None when empty.

    float32 is what inference engines compute logprobs in, so nothing is lost for
    engine-produced values while storage is halved.
    """
    if values is None or (type(values) in (tuple, list) and not values):
        return None  # the common "no logprobs" case, without a numpy round trip
    arr = np.asarray(values, dtype=np.float32)
    if arr.ndim != 1:
        raise ValueError(f"output_logprobs must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return None
    if arr.size != n_tokens:
        raise ValueError(
            f"output_logprobs has {arr.size} values but output_ids has {n_tokens} tokens; "
            "give one logprob per output token or none at all"
        )
    return arr


def owned_copy(arr: TokenArray) -> TokenArray:
    """A compact, private copy of ``arr`` (so a slice never pins a caller's big buffer)."""
    if arr.size == 0:
        return EMPTY_TOKENS
    out = np.array(arr, dtype=np.int32, copy=True)
    out.flags.writeable = False
    return out


# First chunk small so a mismatch near the start (a volatile header) is found at once;
# later chunks large so long equal runs cost one vectorized pass.
_FIRST_CHUNK = 1 << 11
_MAX_CHUNK = 1 << 17


def _first_diff(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> int:
    """Index of the first differing element of equal-length arrays, or -1."""
    diff = a != b
    # argmax on booleans stops at the first True (and is a direct C call, unlike .any()).
    i = int(diff.argmax())
    return i if diff[i] else -1


def common_prefix_len(a: TokenArray, b: TokenArray) -> int:
    """Length of the longest common prefix of two int32 token arrays.

    Compares pairs of tokens as int64 words, so equal prefixes cost one vectorized pass
    over half as many elements; a small first chunk catches early mismatches cheaply and
    large later chunks stop the scan soon after the chunk that holds a mismatch.
    """
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    a = a[:n]
    b = b[:n]
    if n <= 2 * _FIRST_CHUNK or a.strides[0] != 4 or b.strides[0] != 4:
        i = _first_diff(a, b)
        return n if i < 0 else i
    pairs = n // 2
    a64 = a[: 2 * pairs].view(np.int64)
    b64 = b[: 2 * pairs].view(np.int64)
    start = 0
    chunk = _FIRST_CHUNK
    while start < pairs:
        stop = min(pairs, start + chunk)
        j = _first_diff(a64[start:stop], b64[start:stop])
        if j >= 0:
            i = 2 * (start + j)
            return i if a[i] != b[i] else i + 1
        start = stop
        chunk = _MAX_CHUNK
    if n > 2 * pairs and a[n - 1] != b[n - 1]:  # odd tail token
        return n - 1
    return n
