"""The C API (include/ggraph.h) through ctypes, as an embedding application sees it: its structs
and every function's signature, declared once for the tests that call it."""

import ctypes

import ggraph


class Params(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("device", ctypes.c_char_p),
        ("n_ctx", ctypes.c_int),
        ("n_threads", ctypes.c_int),
        ("cuda_graphs", ctypes.c_char_p),
        ("kv_type", ctypes.c_char_p),
        ("allow_longer_context", ctypes.c_int),
        ("n_seq_max", ctypes.c_int64),
        ("swa_full", ctypes.c_int),
    ]


class Sampling(ctypes.Structure):
    _fields_ = [
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_float),
        ("min_p", ctypes.c_float),
        ("repeat_penalty", ctypes.c_float),
        ("seed", ctypes.c_uint64),
    ]


class GenParams(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("max_tokens", ctypes.c_int32),
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_float),
        ("min_p", ctypes.c_float),
        ("repeat_penalty", ctypes.c_float),
        ("frequency_penalty", ctypes.c_float),
        ("presence_penalty", ctypes.c_float),
        ("penalty_last_n", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("stop", ctypes.POINTER(ctypes.c_char_p)),
        ("n_stop", ctypes.c_size_t),
        ("top_logprobs", ctypes.c_int32),
        ("flags", ctypes.c_uint64),
        ("tokens_per_launch", ctypes.c_int32),
    ]


class TokLp(ctypes.Structure):
    _fields_ = [("token", ctypes.c_int32), ("logprob", ctypes.c_float)]


STEP = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_char),
    ctypes.c_size_t,
    ctypes.c_int32,
    ctypes.c_float,
    ctypes.POINTER(TokLp),
    ctypes.c_int32,
    ctypes.c_void_p,
)

_M = ctypes.c_void_p
_IDS = ctypes.POINTER(ctypes.c_int32)
_SIGNATURES = {
    "ggraph_default_params": (Params, []),
    "ggraph_default_sampling": (Sampling, []),
    "ggraph_load": (
        _M,
        [ctypes.c_char_p, ctypes.POINTER(Params), ctypes.c_char_p, ctypes.c_size_t],
    ),
    "ggraph_free": (None, [_M]),
    "ggraph_session_open": (_M, [_M]),
    "ggraph_last_error": (ctypes.c_char_p, [_M]),
    "ggraph_n_vocab": (ctypes.c_int32, [_M]),
    "ggraph_n_ctx": (ctypes.c_int32, [_M]),
    "ggraph_n_past": (ctypes.c_int32, [_M]),
    "ggraph_eval": (ctypes.c_int, [_M, _IDS, ctypes.c_size_t, ctypes.POINTER(ctypes.c_float)]),
    "ggraph_decode_batch": (
        ctypes.c_int,
        [ctypes.POINTER(_M), _IDS, ctypes.c_size_t, ctypes.POINTER(ctypes.c_float)],
    ),
    "ggraph_reset": (None, [_M]),
    "ggraph_cancel": (None, [_M]),
    "ggraph_sample": (ctypes.c_int32, [_M, ctypes.POINTER(Sampling)]),
    "ggraph_tokenize": (
        ctypes.c_int32,
        [_M, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _IDS, ctypes.c_int32],
    ),
    "ggraph_detokenize": (
        ctypes.c_int32,
        [_M, _IDS, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p, ctypes.c_int32],
    ),
    "ggraph_rewind": (ctypes.c_int, [_M, ctypes.c_int32]),
    "ggraph_token_to_piece": (
        ctypes.c_int32,
        [_M, ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32],
    ),
    "ggraph_copy_prefix": (ctypes.c_int, [_M, _M, ctypes.c_int32]),
    "ggraph_default_generate_params": (GenParams, []),
    "ggraph_generate": (
        ctypes.c_int,
        [_M, _IDS, ctypes.c_size_t, ctypes.POINTER(GenParams), STEP, ctypes.c_void_p],
    ),
    "ggraph_save_state": (ctypes.c_int64, [_M, ctypes.c_void_p, ctypes.c_size_t]),
    "ggraph_load_state": (ctypes.c_int, [_M, ctypes.c_void_p, ctypes.c_size_t]),
    "ggraph_save_state_file": (ctypes.c_int, [_M, ctypes.c_char_p]),
    "ggraph_load_state_file": (ctypes.c_int, [_M, ctypes.c_char_p]),
}


def load_library():
    """The installed C library with its functions declared; pytest.skip when it is missing."""
    import pytest

    try:
        lib = ctypes.CDLL(ggraph.c_library_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def params(lib, **fields):
    """ggraph_default_params() with the given fields set, as an application fills it."""
    p = lib.ggraph_default_params()
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def ids(values):
    return (ctypes.c_int32 * len(values))(*values)
